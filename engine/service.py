"""The event-loop side of the engine: request handles, delivery, accounting.

:class:`EngineService` is what the HTTP handlers talk to. ``submit`` checks a
request and queues it on the engine thread (or sends it to the scheduler
process); each step's one hand-off (the engine thread's
``call_soon_threadsafe``, or the scheduler process's pipe becoming readable)
lands in :meth:`EngineService.deliver`, which
hands each output to its request: a streamed response's ``push`` (its sink,
which writes it then and there: ``streaming.py``), else the request's
``asyncio.Queue`` with ``put_nowait`` (unbounded, so this never waits); neither
waits on a client. When a request finishes for
whatever reason, it writes the request's accounting line: tokens generated are billed even
when nobody was left to read them.

Per request it times the queue wait (received to admitted), the prefill
(admitted to first token), the time to first token and the gaps between
token deliveries, into the metrics; with a tracer, the finished request
becomes an ``engine.request`` span (a child of the caller's ``traceparent``)
with ``engine.queue``, ``engine.prefill`` and ``engine.decode`` under it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode, Tracer, set_span_in_context
from tokenwire.engine.backend import GenerationRequest, RequestOutput, RequestRejected
from tokenwire.engine.metrics import EngineMetrics, observe_many
from tokenwire.engine.runner import Runner
from tokenwire.middleware.process.tracing import set_attributes, wall_ns

request_log = logging.getLogger("tokenwire.engine.requests")
"""One JSON line per finished request (aborted and failed ones included)."""


@dataclass(eq=False, slots=True)
class RequestHandle:
    """One in-flight request as the HTTP handler sees it."""

    request_id: str
    endpoint: str
    model: str
    prompt_tokens: int
    user: str | None
    received_s: float
    outputs: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    """Outputs for a handler that awaits them (the whole-body answer)."""
    sink: Callable[[RequestOutput], None] | None = None
    """Where outputs go instead, called by the step's hand-off (a streamed response's ``push``)."""
    streaming: bool = False
    first_token_s: float | None = None
    """When the first token was delivered to this handle (the engine produced it)."""
    first_token_sent_s: float | None = None
    """When the streamed response handed its first token on (``first_token_sent``)."""
    admitted_s: float | None = None
    last_token_s: float | None = None
    trace_context: Context | None = None
    """The caller's ``traceparent`` (with tracing on), parent of the request's span."""
    deferred_account: tuple[RequestOutput, float] | None = None
    """The final output and its time, while its log line waits for the first token's hand-off."""
    abort_reason: str | None = None
    finished: bool = False
    """Set by the handler once it has read the final output."""


class EngineService:
    """Submit, abort, deliver: the engine as seen from the event loop."""

    def __init__(self, runner: Runner, metrics: EngineMetrics, tracer: Tracer | None = None) -> None:
        self._runner = runner
        self._metrics = metrics
        self._tracer = tracer
        self._handles: dict[str, RequestHandle] = {}

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._handles)

    def submit(
        self, request: GenerationRequest, *, endpoint: str, model: str, user: str | None,
        received_s: float, trace_context: Context | None = None, streaming: bool = False,
    ) -> RequestHandle:
        """Queue ``request``; raises ``RequestRejected`` (a 400/503) without queueing."""
        if request.request_id in self._handles:
            raise RequestRejected(f"request id {request.request_id!r} is already in flight",
                                  param="X-Request-Id")
        self._runner.submit(request)
        handle = RequestHandle(
            request_id=request.request_id, endpoint=endpoint, model=model,
            prompt_tokens=len(request.prompt_token_ids), user=user, received_s=received_s,
            trace_context=trace_context, streaming=streaming,
        )
        self._handles[request.request_id] = handle
        return handle

    def abort(self, request_id: str, reason: str) -> bool:
        """Abort an in-flight request; its row leaves the batch at the next step.

        Returns whether the id was in flight.
        """
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        if handle.abort_reason is None:
            handle.abort_reason = reason
        self._runner.cancel(request_id)
        return True

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Event loop: one step's outputs, from the engine thread's one hand-off."""
        now_s = time.monotonic()
        generated = 0
        metrics = self._metrics
        gaps_s: list[float] = []
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.admitted_s is not None and handle.admitted_s is None:
                handle.admitted_s = output.admitted_s
                metrics.queue_wait_seconds.observe(max(output.admitted_s - handle.received_s, 0.0))
            if output.token_ids:
                if handle.first_token_s is None:
                    handle.first_token_s = now_s
                    if not handle.streaming:
                        metrics.time_to_first_token_seconds.observe(now_s - handle.received_s)
                    if handle.admitted_s is not None:
                        metrics.prefill_seconds.observe(max(now_s - handle.admitted_s, 0.0))
                elif handle.last_token_s is not None:
                    gaps_s.append(now_s - handle.last_token_s)
                handle.last_token_s = now_s
            generated += len(output.token_ids)
            sink = handle.sink
            if sink is None:
                handle.outputs.put_nowait(output)
            else:
                sink(output)
            if output.finished:
                del self._handles[output.request_id]
                self._account(handle, output, now_s)
        # One counter update per step, and the gaps at once, not per row (each takes a lock).
        self._metrics.generated_tokens.inc(generated)
        observe_many(metrics.inter_token_seconds, gaps_s)

    def attach(self, handle: RequestHandle, sink: Callable[[RequestOutput], None]) -> None:
        """From now on ``handle``'s outputs go to ``sink`` (any already queued first)."""
        while not handle.outputs.empty():
            sink(handle.outputs.get_nowait())
        handle.sink = sink

    def first_token_sent(self, handle: RequestHandle) -> None:
        """The streamed response hands its first token to the wire now: the
        engine's time to first token, measured where the sidecar's next hop starts."""
        now_s = time.monotonic()
        handle.first_token_sent_s = now_s
        self._metrics.time_to_first_token_seconds.observe(now_s - handle.received_s)
        self.response_done(handle)

    def _account(self, handle: RequestHandle, output: RequestOutput, now_s: float) -> None:
        reason = output.finish_reason or "error"
        self._metrics.requests_finished.labels(finish_reason=reason).inc()
        self._metrics.prompt_tokens.inc(output.prompt_tokens)
        self._metrics.request_duration_seconds.labels(finish_reason=reason).observe(now_s - handle.received_s)
        if (handle.streaming and handle.first_token_sent_s is None and output.completion_tokens
                and reason not in ("abort", "error")):
            # Generation ended before the response handed on its first token (a short
            # answer): the line waits for that moment, so its ttft_s is the response's.
            handle.deferred_account = (output, now_s)
            return
        self._write_account(handle, output, now_s)

    def response_done(self, handle: RequestHandle) -> None:
        """The streamed response read its last output (or was torn down)."""
        if handle.deferred_account is not None:
            output, now_s = handle.deferred_account
            handle.deferred_account = None
            self._write_account(handle, output, now_s)

    def _write_account(self, handle: RequestHandle, output: RequestOutput, now_s: float) -> None:
        reason = output.finish_reason or "error"
        first_s = handle.first_token_sent_s or handle.first_token_s
        record = {
            "request_id": handle.request_id,
            "endpoint": handle.endpoint,
            "model": handle.model,
            "user": handle.user,
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.completion_tokens,
            "finish_reason": reason,
            "abort_reason": handle.abort_reason if reason == "abort" else None,
            "error": output.error,
            "ttft_s": None if first_s is None else round(first_s - handle.received_s, 6),
            "queue_wait_s": None if handle.admitted_s is None
            else round(handle.admitted_s - handle.received_s, 6),
            "duration_s": round(now_s - handle.received_s, 6),
        }
        request_log.info("request finished", extra={"fields": record})
        if self._tracer is not None:
            self._trace(self._tracer, handle, output, now_s, reason)

    @staticmethod
    def _trace(tracer: Tracer, handle: RequestHandle, output: RequestOutput, now_s: float,
               reason: str) -> None:
        """The finished request as spans: the request, and its queue, prefill and decode."""
        end_ns = wall_ns(now_s)
        span = tracer.start_span("engine.request", context=handle.trace_context, kind=SpanKind.SERVER,
                                 start_time=wall_ns(handle.received_s))
        set_attributes(span, {"tokenwire.request_id": handle.request_id, "gen_ai.request.model": handle.model,
                              "gen_ai.usage.input_tokens": output.prompt_tokens,
                              "gen_ai.usage.output_tokens": output.completion_tokens,
                              "gen_ai.response.finish_reasons": (reason,),
                              "tokenwire.endpoint": handle.endpoint})
        if reason in ("error", "abort"):
            span.set_status(StatusCode.ERROR, output.error or reason)
        parent = set_span_in_context(span)
        admitted_s, first_s = handle.admitted_s, handle.first_token_s
        phases = [("engine.queue", handle.received_s, admitted_s if admitted_s is not None else now_s)]
        if admitted_s is not None:
            phases.append(("engine.prefill", admitted_s, first_s if first_s is not None else now_s))
        if first_s is not None:
            phases.append(("engine.decode", first_s, now_s))
        for name, start_s, end_s in phases:
            child = tracer.start_span(name, context=parent, start_time=wall_ns(start_s))
            child.end(end_time=min(wall_ns(end_s), end_ns))
        span.end(end_time=end_ns)
