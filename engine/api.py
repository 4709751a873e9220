"""The engine's HTTP API, as a Starlette app: three dialects over one scheduler.

``POST /v1/chat/completions`` and ``/v1/completions`` (OpenAI), ``/v1/responses``
(the OpenAI Responses API) and ``/v1/messages`` (the Anthropic Messages API)
are one handler, ``_Handlers.generate``, given the route's dialect
(``dialect.py``): validate, check the model, tokenize, submit to the
:class:`~tokenwire.engine.service.EngineService`, then stream the dialect's
events (``_ResponseStream``) or answer in one body. Refusals before the first
byte are the dialect's error body with its status; after it, failures travel
in-band in the dialect's shape. A client that leaves aborts its sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from tokenwire.engine.access_log import RECEIVED_KEY
from tokenwire.engine.backend import (
    EngineBackend,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
)
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.dialect import Answer, AnswerContext, Conversation, Dialect, Prompt, failed
from tokenwire.engine.loader import LoadedModel
from tokenwire.engine.messages_api import MessagesDialect
from tokenwire.engine.metrics import CONTENT_TYPE, EngineMetrics
from tokenwire.engine.openai_dialect import ChatDialect, CompletionsDialect
from tokenwire.engine.request_fields import ProtocolError, SamplingFields
from tokenwire.engine.responses_api import ResponsesDialect
from tokenwire.engine.runner import EngineRunner, Runner
from tokenwire.engine.sampling import SamplingParams
from tokenwire.engine.scheduler import ContinuousBatchingScheduler
from tokenwire.engine.scheduler_process import LaunchedScheduler, SchedulerProcessRunner
from tokenwire.engine.service import EngineService, RequestHandle
from tokenwire.engine.streaming import SERVER_SEND_KEY, PushedEventStream
from tokenwire.middleware.core.errors import ErrorCode, error_object
from tokenwire.middleware.process.tracing import extract_text, get_tracer

REQUEST_ID_HEADER = "x-request-id"
# ``/`` is no API route, so it stays a 404; but it is the first thing a person
# opens in a browser, and the sidecar (``tokenwire up``'s API port) forwards it
# here, so its body says where the API and the playground page are.
ROOT_NOT_FOUND_TEXT = """\
404 Not Found: there is no page at /. This port is the API (the tokenwire engine
answers it, directly or through the sidecar in front of it):

  POST /v1/chat/completions   /v1/completions   /v1/responses   /v1/messages
  GET  /v1/models   /health   /healthz   /readyz   /metrics

To try it in a browser, open the playground on the sidecar's admin port: with
`tokenwire up`, the "playground" line of its banner (http://127.0.0.1:8081/ by default).
"""
_MAX_REQUEST_ID_CHARS = 128
Endpoint = Callable[[Request], Awaitable[Response | PushedEventStream[RequestOutput]]]


@dataclass(frozen=True, slots=True)
class EngineApp:
    """What ``build_app`` wires together; ``app.state.engine`` holds it."""

    service: EngineService
    runner: Runner
    backend: EngineBackend | None
    """The scheduler, or ``None`` when it runs in a process of its own."""
    metrics: EngineMetrics
    loaded: LoadedModel
    model_name: str
    max_model_len: int


def build_app(
    loaded: LoadedModel, config: EngineConfig, *, backend: EngineBackend | None = None,
    launched: LaunchedScheduler | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Starlette:
    """The bare Starlette app; the engine starts and stops with its lifespan.

    The scheduler runs in a thread of this process over ``backend`` (default:
    a :class:`ContinuousBatchingScheduler` of ``loaded``), or, given
    ``launched``, in that scheduler process (``loaded`` is then its front).
    ``tracer_provider``: where request spans go (``tokenwire.middleware.process.tracing``).
    """
    metrics = EngineMetrics()
    service_box: list[EngineService] = []

    def deliver(outputs: list[RequestOutput]) -> None:
        service_box[0].deliver(outputs)

    scheduler: EngineBackend | None
    runner: Runner
    if launched is not None:
        scheduler = None
        max_model_len = launched.facts.max_model_len
        runner = SchedulerProcessRunner(launched, deliver, on_step=metrics.observe_step)
    else:
        scheduler = backend or ContinuousBatchingScheduler(loaded, config)
        max_model_len = getattr(scheduler, "max_model_len", loaded.max_model_len)
        runner = EngineRunner(scheduler, deliver, on_step=metrics.observe_step)
    service = EngineService(runner, metrics, get_tracer(tracer_provider))
    service_box.append(service)
    engine = EngineApp(
        service=service, runner=runner, backend=scheduler, metrics=metrics, loaded=loaded,
        model_name=config.served_model_name or loaded.name, max_model_len=max_model_len,
    )
    handlers = _Handlers(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            runner.stop()

    app = _EngineStarlette(
        routes=[
            Route("/v1/completions", handlers.generate(CompletionsDialect()), methods=["POST"]),
            Route("/v1/chat/completions", handlers.generate(ChatDialect()), methods=["POST"]),
            Route("/v1/responses", handlers.generate(ResponsesDialect()), methods=["POST"]),
            Route("/v1/messages", handlers.generate(MessagesDialect()), methods=["POST"]),
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/v1/abort/{request_id}", handlers.abort, methods=["POST"]),
            Route("/health", handlers.health, methods=["GET"]),
            # The probes: 503 from these (and /health) while the scheduler is down;
            # while the model loads, loading.py answers them (/healthz 200, /readyz 503).
            Route("/healthz", handlers.health, methods=["GET"]),
            Route("/readyz", handlers.ready, methods=["GET"]),
            Route("/metrics", handlers.metrics, methods=["GET"]),
            # A response is an ASGI app, and a route to one takes every method:
            # ``POST /`` stays the 404 it was before ``/`` had a route, never a 405.
            Route("/", PlainTextResponse(ROOT_NOT_FOUND_TEXT, status_code=404)),
        ],
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


class _EngineStarlette(Starlette):
    """Starlette, keeping the ``send`` it is called with in the scope: a streamed
    response writes its events there, past Starlette's own wrappers (``streaming.py``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND_KEY] = send
        await super().__call__(scope, receive, send)


class _Handlers:
    def __init__(self, engine: EngineApp) -> None:
        self._engine = engine
        self._tokenizer = engine.loaded.tokenizer
        self._vocab_size = len(self._tokenizer)

    # -- endpoints ----------------------------------------------------------------

    def generate(self, dialect: Dialect[Any]) -> Endpoint:
        """The endpoint of a route that generates, in ``dialect``."""

        async def endpoint(request: Request) -> Response | PushedEventStream[RequestOutput]:
            return await self._generate(request, dialect)

        return endpoint

    async def _generate(
        self, request: Request, dialect: Dialect[Any],
    ) -> Response | PushedEventStream[RequestOutput]:
        """Every generating endpoint: parse, check, tokenize, submit, then stream or answer whole."""
        request_id = _request_id(request)
        # From the outermost wrapper (access_log.RECEIVED_KEY) when there is one: the
        # time a client waits includes the middleware's and the framework's share.
        received_s = request.scope.get(RECEIVED_KEY) or time.monotonic()
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            parsed = dialect.parse(await _json_body(request))
            self._check_model(parsed.model)
            prompt_ids = self._tokenize(dialect.prompt(parsed))
            params = _sampling_params(parsed.sampling, len(prompt_ids), self._engine.max_model_len,
                                      self._engine.loaded.default_temperature)
            handle = self._engine.service.submit(
                GenerationRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params),
                endpoint=dialect.endpoint, model=self._engine.model_name, user=parsed.user,
                received_s=received_s, trace_context=extract_text(request.headers),
                streaming=parsed.stream,
            )
        except (ProtocolError, RequestRejected) as error:
            status, body = dialect.refusal(error)
            return JSONResponse(body, status_code=status, headers=headers)
        context = AnswerContext(request_id=request_id, model=self._engine.model_name,
                                created=int(time.time()), prompt_tokens=len(prompt_ids), params=params)
        stream = _ResponseStream(self._engine, handle, dialect.answer(parsed, context))
        if parsed.stream:
            return stream.response()
        return await stream.whole_response(request)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self._engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenwire",
            "root": str(self._engine.loaded.path),
            "max_model_len": self._engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def abort(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if self._engine.service.abort(request_id, "abort_endpoint"):
            return JSONResponse({"request_id": request_id, "aborted": True})
        return JSONResponse(
            error_object(f"no request {request_id!r} in flight", "invalid_request_error",
                         ErrorCode.STREAM_NOT_FOUND, param=None),
            status_code=404,
        )

    async def health(self, request: Request) -> Response:
        in_flight = self._engine.service.in_flight
        if not self._engine.runner.alive:
            # The scheduler (thread or process) has stopped: nothing will be generated.
            return JSONResponse({"status": "scheduler_down", "in_flight": in_flight},
                                status_code=503)
        return JSONResponse({"status": "ok", "in_flight": in_flight})

    async def ready(self, request: Request) -> Response:
        if not self._engine.runner.alive:
            return JSONResponse({"status": "scheduler_down"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics(self, request: Request) -> Response:
        return Response(self._engine.metrics.render(), media_type=CONTENT_TYPE)

    # -- helpers ------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is None or model == self._engine.model_name:
            return
        raise ProtocolError(f"The model `{model}` does not exist.", param="model",
                            http_status=404)

    def _tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, Conversation):
            return self._apply_chat_template(prompt)
        if isinstance(prompt, str):
            return tuple(self._tokenizer(prompt).input_ids)
        out_of_range = [t for t in prompt if not 0 <= t < self._vocab_size]
        if out_of_range:
            raise ProtocolError(
                f"prompt token ids must be in [0, {self._vocab_size}); got {out_of_range[:5]}",
                param="prompt",
            )
        return prompt

    def _apply_chat_template(self, conversation: Conversation) -> tuple[int, ...]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ProtocolError("this model has no chat template; use /v1/completions",
                                param=conversation.param)
        messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
        continue_final = conversation.continue_final
        token_ids = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=not continue_final, continue_final_message=continue_final,
            tokenize=True, return_dict=False,
        )
        return tuple(int(t) for t in token_ids)


class _ResponseStream:
    """Turns one request's outputs into its dialect's events or one body (``answer``)."""

    def __init__(self, engine: EngineApp, handle: RequestHandle, answer: Answer) -> None:
        self._engine = engine
        self._handle = handle
        self._answer = answer

    def response(self) -> PushedEventStream[RequestOutput]:
        """The streamed answer: the engine's hand-off pushes each output into it
        (``RequestHandle.sink``), which writes it at once; see ``streaming.py``."""
        response = PushedEventStream(self._render, {REQUEST_ID_HEADER: self._handle.request_id},
                                     first_event=self._answer.opening(), on_close=self._closed)
        self._engine.service.attach(self._handle, response.push)
        return response

    def _render(self, batch: list[RequestOutput]) -> tuple[list[str], bool]:
        """SSE events for outputs delivered together (usually one), and whether the
        stream ends with them (the dialect's last events, or its in-band error)."""
        handle = self._handle
        final = batch[-1]
        text = final.text if len(batch) == 1 else "".join(output.text for output in batch)
        if final.finished:
            handle.finished = True
            if text and handle.first_token_sent_s is None:
                self._engine.service.first_token_sent(handle)
            if failed(final):
                return self._answer.failure(text, final), True
            return self._answer.closing(text, final), True
        if not text:
            return [], False
        if handle.first_token_sent_s is None:
            self._engine.service.first_token_sent(handle)
        return [self._answer.delta(text)], False

    def _closed(self) -> None:
        """The response is over, or torn down (client gone): free the row if it still runs."""
        handle = self._handle
        if not handle.finished:
            self._engine.service.abort(handle.request_id, "client_disconnect")
        self._engine.service.response_done(handle)

    async def whole_response(self, request: Request) -> Response:
        """Wait for the end (or the client leaving) and answer in one JSON body."""
        collector = asyncio.ensure_future(self._collect())
        listener = asyncio.ensure_future(_wait_for_disconnect(request))
        await asyncio.wait({collector, listener}, return_when=asyncio.FIRST_COMPLETED)
        listener.cancel()
        if not collector.done():
            collector.cancel()
            self._engine.service.abort(self._handle.request_id, "client_disconnect")
            return Response(status_code=499)
        text, final = collector.result()
        headers = {REQUEST_ID_HEADER: self._handle.request_id}
        if failed(final):
            status, body = self._answer.error_body(final)
            return JSONResponse(body, status_code=status, headers=headers)
        return JSONResponse(self._answer.body(text, final), headers=headers)

    async def _collect(self) -> tuple[str, RequestOutput]:
        parts: list[str] = []
        while True:
            output = await self._handle.outputs.get()
            parts.append(output.text)
            if output.finished:
                self._handle.finished = True
                return "".join(parts), output


def _sampling_params(sampling: SamplingFields, prompt_tokens: int, max_model_len: int,
                     default_temperature: float) -> SamplingParams:
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        # Chat's default: whatever the context leaves (at least one, so an
        # over-long prompt is refused by the scheduler with the usual message).
        max_tokens = max(1, max_model_len - prompt_tokens)
    try:
        return SamplingParams(
            max_tokens=max_tokens, top_p=sampling.top_p,
            temperature=default_temperature if sampling.temperature is None else sampling.temperature,
            top_k=sampling.top_k, seed=sampling.seed, stop=sampling.stop,
            stop_token_ids=sampling.stop_token_ids, ignore_eos=sampling.ignore_eos,
            min_tokens=min(sampling.min_tokens, max_tokens),
            skip_special_tokens=sampling.skip_special_tokens,
        )
    except ValueError as error:
        field_name = str(error).split(":", 1)[0]
        raise ProtocolError(str(error), param=field_name) from None


def _request_id(request: Request) -> str:
    """The client's ``X-Request-Id``, else the middleware's id, else a fresh one.

    Using the middleware's id when it made one up keeps its logs and our abort
    endpoint talking about the same request.
    """
    given = request.headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= _MAX_REQUEST_ID_CHARS and given.isprintable() and "/" not in given:
        return given
    control = request.scope.get("extensions", {}).get("tokenwire")
    wire_id = getattr(control, "request_id", None)
    if isinstance(wire_id, str) and wire_id:
        return wire_id
    return uuid.uuid4().hex


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProtocolError(f"the request body is not valid JSON: {error}") from None


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
