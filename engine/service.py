"""The event-loop side of the engine: request handles, delivery, accounting.

:class:`EngineService` is what the HTTP handlers talk to. ``submit`` checks a
request and queues it on the engine thread (or sends it to the scheduler
process); each step's one hand-off (the engine thread's
``call_soon_threadsafe``, or the scheduler process's pipe becoming readable)
lands in :meth:`EngineService.deliver`, which
puts each output on its request's ``asyncio.Queue`` with ``put_nowait`` (the
queues are unbounded, so this never waits) and, when a request finishes for
whatever reason, writes its accounting line: tokens generated are billed even
when nobody was left to read them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from tokenwire.engine.backend import GenerationRequest, RequestOutput, RequestRejected
from tokenwire.engine.metrics import EngineMetrics
from tokenwire.engine.runner import Runner

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
    first_token_s: float | None = None
    abort_reason: str | None = None
    finished: bool = False
    """Set by the handler once it has read the final output."""


class EngineService:
    """Submit, abort, deliver: the engine as seen from the event loop."""

    def __init__(self, runner: Runner, metrics: EngineMetrics) -> None:
        self._runner = runner
        self._metrics = metrics
        self._handles: dict[str, RequestHandle] = {}

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._handles)

    def submit(
        self, request: GenerationRequest, *, endpoint: str, model: str, user: str | None,
        received_s: float,
    ) -> RequestHandle:
        """Queue ``request``; raises ``RequestRejected`` (a 400/503) without queueing."""
        if request.request_id in self._handles:
            raise RequestRejected(f"request id {request.request_id!r} is already in flight",
                                  param="X-Request-Id")
        self._runner.submit(request)
        handle = RequestHandle(
            request_id=request.request_id, endpoint=endpoint, model=model,
            prompt_tokens=len(request.prompt_token_ids), user=user, received_s=received_s,
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
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if handle.first_token_s is None and output.token_ids:
                handle.first_token_s = now_s
                self._metrics.time_to_first_token_seconds.observe(now_s - handle.received_s)
            generated += len(output.token_ids)
            handle.outputs.put_nowait(output)
            if output.finished:
                del self._handles[output.request_id]
                self._account(handle, output, now_s)
        # One counter update per step, not per row (each takes a lock).
        self._metrics.generated_tokens.inc(generated)

    def _account(self, handle: RequestHandle, output: RequestOutput, now_s: float) -> None:
        reason = output.finish_reason or "error"
        self._metrics.requests_finished.labels(finish_reason=reason).inc()
        self._metrics.prompt_tokens.inc(output.prompt_tokens)
        record = {
            "event": "request_finished",
            "request_id": handle.request_id,
            "endpoint": handle.endpoint,
            "model": handle.model,
            "user": handle.user,
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.completion_tokens,
            "finish_reason": reason,
            "abort_reason": handle.abort_reason if reason == "abort" else None,
            "error": output.error,
            "ttft_s": None if handle.first_token_s is None
            else round(handle.first_token_s - handle.received_s, 6),
            "duration_s": round(now_s - handle.received_s, 6),
        }
        request_log.info(json.dumps(record, separators=(",", ":")))
