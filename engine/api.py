"""The OpenAI-compatible HTTP API, as a Starlette app.

Handlers are thin: validate (``openai_requests.py``), tokenize, submit to the
:class:`~tokenwire.engine.service.EngineService`, then turn outputs into
OpenAI-shaped JSON or SSE chunks. Errors become OpenAI error bodies here, in
one function, ``_error_response``; after the first SSE byte they travel in-band
as ``data: {"error": ...}`` and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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
from tokenwire.engine.loader import LoadedModel
from tokenwire.engine.metrics import CONTENT_TYPE, EngineMetrics
from tokenwire.engine.openai_requests import (
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    SamplingFields,
    parse_chat_request,
    parse_completion_request,
)
from tokenwire.engine.runner import EngineRunner, Runner
from tokenwire.engine.sampling import SamplingParams
from tokenwire.engine.scheduler import ContinuousBatchingScheduler
from tokenwire.engine.scheduler_process import LaunchedScheduler, SchedulerProcessRunner
from tokenwire.engine.service import EngineService, RequestHandle
from tokenwire.engine.streaming import SERVER_SEND_KEY, PushedEventStream
from tokenwire.middleware.errors import ErrorCode, error_object
from tokenwire.middleware.tracing import extract_text, get_tracer

REQUEST_ID_HEADER = "x-request-id"
_quote: Callable[[str], str] = encode_basestring
"""``json.dumps(text, ensure_ascii=False)`` without building an encoder per call: the
C function that call ends in (the same bytes; ``test_api`` compares)."""
_MAX_REQUEST_ID_CHARS = 128


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
    ``tracer_provider``: where request spans go (``tokenwire.middleware.tracing``).
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
            Route("/v1/completions", handlers.completions, methods=["POST"]),
            Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/v1/abort/{request_id}", handlers.abort, methods=["POST"]),
            Route("/health", handlers.health, methods=["GET"]),
            Route("/metrics", handlers.metrics, methods=["GET"]),
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

    async def completions(self, request: Request) -> Response | PushedEventStream[RequestOutput]:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | PushedEventStream[RequestOutput]:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response | PushedEventStream[RequestOutput]:
        """Both completion endpoints: parse, check, tokenize, submit, then stream or answer whole."""
        request_id = _request_id(request)
        # From the outermost wrapper (access_log.RECEIVED_KEY) when there is one: the
        # time a client waits includes the middleware's and the framework's share.
        received_s = request.scope.get(RECEIVED_KEY) or time.monotonic()
        parsed: CompletionRequest | ChatRequest
        try:
            body = await _json_body(request)
            if chat:
                parsed = parse_chat_request(body)
                self._check_model(parsed.model)
                prompt_ids = self._apply_chat_template(parsed)
            else:
                parsed = parse_completion_request(body)
                self._check_model(parsed.model)
                prompt_ids = self._tokenize_prompt(parsed)
            handle = self._submit(request_id, prompt_ids, parsed.sampling,
                                  "chat" if chat else "completions", parsed.user, received_s,
                                  extract_text(request.headers), streaming=parsed.stream)
        except (ProtocolError, RequestRejected) as error:
            return _error_response(error, request_id)
        stream = _ResponseStream(self._engine, handle, parsed, chat=chat)
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

    async def metrics(self, request: Request) -> Response:
        return Response(self._engine.metrics.render(), media_type=CONTENT_TYPE)

    # -- helpers ------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is None or model == self._engine.model_name:
            return
        raise ProtocolError(f"The model `{model}` does not exist.", param="model",
                            http_status=404)

    def _tokenize_prompt(self, parsed: CompletionRequest) -> tuple[int, ...]:
        if isinstance(parsed.prompt, str):
            return tuple(self._tokenizer(parsed.prompt).input_ids)
        out_of_range = [t for t in parsed.prompt if not 0 <= t < self._vocab_size]
        if out_of_range:
            raise ProtocolError(
                f"prompt token ids must be in [0, {self._vocab_size}); got {out_of_range[:5]}",
                param="prompt",
            )
        return parsed.prompt

    def _apply_chat_template(self, parsed: ChatRequest) -> tuple[int, ...]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ProtocolError("this model has no chat template; use /v1/completions",
                                param="messages")
        messages = [{"role": m.role, "content": m.content} for m in parsed.messages]
        token_ids = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return tuple(int(t) for t in token_ids)

    def _submit(
        self, request_id: str, prompt_ids: tuple[int, ...], sampling: SamplingFields,
        endpoint: str, user: str | None, received_s: float, trace_context: Context | None = None,
        *, streaming: bool = False,
    ) -> RequestHandle:
        params = _sampling_params(sampling, len(prompt_ids), self._engine.max_model_len,
                                  self._engine.loaded.default_temperature)
        return self._engine.service.submit(
            GenerationRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params),
            endpoint=endpoint, model=self._engine.model_name, user=user, received_s=received_s,
            trace_context=trace_context, streaming=streaming,
        )


class _ResponseStream:
    """Turns one request's outputs into OpenAI chunks or one OpenAI response."""

    def __init__(
        self, engine: EngineApp, handle: RequestHandle,
        parsed: CompletionRequest | ChatRequest, *, chat: bool,
    ) -> None:
        self._engine = engine
        self._handle = handle
        self._parsed = parsed
        self._chat = chat
        self._id = f"{'chatcmpl' if chat else 'cmpl'}-{handle.request_id}"
        self._created = int(time.time())
        self._object = "chat.completion.chunk" if chat else "text_completion"
        # The body of every text-only chunk, split around its text: a token's
        # chunk is then one json.dumps of the text, not of the whole dict (the
        # event loop builds tens of thousands a second at 64 streams).
        marker = "\u0001tokenwire-text\u0001"
        template = self._chunk(marker, None)
        quoted = json.dumps(marker, ensure_ascii=False)
        self._text_prefix, self._text_suffix = template.split(quoted, 1)

    def response(self) -> PushedEventStream[RequestOutput]:
        """The streamed answer: the engine's hand-off pushes each output into it
        (``RequestHandle.sink``), which writes it at once; see ``streaming.py``."""
        first = self._chunk({"role": "assistant", "content": ""}, None) if self._chat else None
        response = PushedEventStream(self._render, {REQUEST_ID_HEADER: self._handle.request_id},
                                     first_event=first, on_close=self._closed)
        self._engine.service.attach(self._handle, response.push)
        return response

    def _render(self, batch: list[RequestOutput]) -> tuple[list[str], bool]:
        """SSE events for outputs delivered together (usually one), and whether the
        stream ends with them (``[DONE]`` or an in-band error)."""
        handle = self._handle
        final = batch[-1]
        text = final.text if len(batch) == 1 else "".join(output.text for output in batch)
        if final.finished:
            handle.finished = True
            if text and handle.first_token_sent_s is None:
                self._engine.service.first_token_sent(handle)
            if final.finish_reason in ("abort", "error"):
                error = _sse(_finish_error(final.finish_reason, final.error))
                return ([self._chunk(text, None), error] if text else [error]), True
            events = [self._chunk(text, final.finish_reason, final.stop_reason)]
            if self._parsed.include_usage:
                events.append(_sse(self._usage_chunk(final.prompt_tokens, final.completion_tokens)))
            events.append("data: [DONE]\n\n")
            return events, True
        if not text:
            return [], False
        if handle.first_token_sent_s is None:
            self._engine.service.first_token_sent(handle)
        return [self._text_prefix + _quote(text) + self._text_suffix], False

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
        if final.finish_reason in ("abort", "error"):
            body, status = _finish_error(final.finish_reason, final.error), 500
            return JSONResponse(body, status_code=status, headers=headers)
        usage = _usage(final.prompt_tokens, final.completion_tokens)
        if self._chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": final.finish_reason,
                "stop_reason": final.stop_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}
            obj = "text_completion"
        body = {"id": self._id, "object": obj, "created": self._created,
                "model": self._engine.model_name, "choices": [choice], "usage": usage}
        return JSONResponse(body, headers=headers)

    async def _collect(self) -> tuple[str, Any]:
        parts: list[str] = []
        while True:
            output = await self._handle.outputs.get()
            parts.append(output.text)
            if output.finished:
                self._handle.finished = True
                return "".join(parts), output

    def _chunk(
        self, content: str | dict[str, str], finish_reason: str | None,
        stop_reason: int | str | None = None,
    ) -> str:
        if self._chat:
            if isinstance(content, dict):
                delta: dict[str, str] = content
            else:
                delta = {"content": content} if content else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None,
                      "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk: dict[str, Any] = {"id": self._id, "object": self._object,
                                 "created": self._created, "model": self._engine.model_name,
                                 "choices": [choice]}
        if self._parsed.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"id": self._id, "object": self._object, "created": self._created,
                "model": self._engine.model_name, "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens)}


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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_error(reason: str | None, message: str | None) -> dict[str, Any]:
    if reason == "abort":
        return error_object("the request was aborted", "server_error", ErrorCode.CANCELLED, param=None)
    return error_object(message or "generation failed", "server_error", ErrorCode.INTERNAL, param=None)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(
        payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def _error_response(error: ProtocolError | RequestRejected, request_id: str) -> Response:
    """The one place a refused request becomes an HTTP error body."""
    status = error.http_status
    if status == 503:
        kind, ours = "server_error", ErrorCode.UPSTREAM_UNAVAILABLE
    else:
        kind, ours = "invalid_request_error", ErrorCode.BAD_REQUEST
    body = error_object(error.message, kind, ours, param=error.param)
    if status == 404:
        # OpenAI's own code for an unknown model; tokenwire's stays bad_request.
        body["error"]["code"] = "model_not_found"  # type: ignore[index]
    return JSONResponse(body, status_code=status, headers={REQUEST_ID_HEADER: request_id})


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
