"""What the logs and traces say about one stream: its end line's fields, its milestones.

At INFO a stream is one line, when it ends (``logs.StreamLog``); this module
adds what the wire core's record cannot know (the wall-clock start, method,
path, client address, HTTP version). At DEBUG each milestone is a line of its
own, on the ``tokenwire.lifecycle`` logger: ``accepted``, ``committed``,
``first token``, ``retry``, ``paused``, ``heartbeat only`` (every heartbeat
written while no token has come for ``heartbeat_s`` or more) and ``ended``.
Every line carries the request id and, with resume on, the stream id.

With tracing on (``tokenwire.middleware.process.tracing``) the same milestones are the
events of the stream's span, ``tokenwire.stream``, which is a child of the
client's ``traceparent`` and whose own context goes upstream in its place.

Nothing from the request's headers or body but its method and path (without
the query) is logged: no Authorization, no cookie, no prompt, no completion.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from tokenwire.middleware import (
    Action,
    CommitHeaders,
    Finished,
    PauseUpstream,
    RetryUpstream,
    StreamRecord,
    WireStream,
)
from tokenwire.middleware.process.tracing import extract, loop_wall_ns, set_attributes, with_span_headers

Header = tuple[bytes, bytes]

lifecycle_log = logging.getLogger("tokenwire.lifecycle")


def request_fields(method: bytes, target: bytes, client_address: str, http_version: str) -> dict[str, Any]:
    """The request's loggable fields: method, path (never the query), client, HTTP version."""
    return {"method": method.decode("latin-1"),
            "path": target.partition(b"?")[0].decode("latin-1", "replace"),
            "client": client_address, "http_version": http_version}


def open_span(tracer: Tracer | None, request_id: str, fields: dict[str, Any],
              upstream_headers: Sequence[Header]) -> tuple[Span | None, list[Header]]:
    """The stream's span (None without a tracer) and the upstream headers that carry it."""
    if tracer is None:
        return None, list(upstream_headers)
    span = tracer.start_span("tokenwire.stream", context=extract(upstream_headers), kind=SpanKind.SERVER,
                             attributes={"http.request.method": fields["method"], "url.path": fields["path"],
                                         "client.address": fields["client"],
                                         "network.protocol.version": fields["http_version"],
                                         "tokenwire.request_id": request_id})
    return span, with_span_headers(upstream_headers, span)


class Milestones:
    """Debug lines and span events for one stream; made only when either is on."""

    __slots__ = ("_debug", "_fields", "_first_token", "_heartbeats", "_span", "_stream")

    def __init__(self, stream: WireStream, fields: dict[str, Any], span: Span | None = None) -> None:
        self._stream = stream
        self._fields = {"request_id": stream.request_id, **fields}
        self._first_token = False
        self._heartbeats = 0
        self._span = span
        self._debug = lifecycle_log.isEnabledFor(logging.DEBUG)

    @staticmethod
    def wanted() -> bool:
        return lifecycle_log.isEnabledFor(logging.DEBUG)

    def _log(self, what: str, at_ns: int | None = None, **fields: Any) -> None:
        if self._debug:
            lifecycle_log.debug(what, extra={"fields": {**self._fields, **fields}})
        if self._span is not None:
            self._span.add_event(what, {k: v for k, v in fields.items() if v is not None}, at_ns)

    def accepted(self, stream_id: str | None) -> None:
        if stream_id:
            self._fields["stream_id"] = stream_id
        self._log("accepted")

    def after(self, actions: Sequence[Action], now: float) -> None:
        """After the driver executed the core's actions (``now``: the loop's clock)."""
        stream = self._stream
        meter = stream.meter
        if not self._first_token and meter.first_token_at is not None:
            # Before "ended": the write that carried it may also have finished the stream.
            self._first_token = True
            self._log("first token", loop_wall_ns(meter.first_token_at, now),
                      ttft_s=round(meter.first_token_at - stream.started_at, 6))
        for action in actions:
            if isinstance(action, CommitHeaders):
                self._log("committed", status=action.status, streaming=action.streaming,
                          upstream=stream.upstream)
            elif isinstance(action, RetryUpstream):
                self._log("retry", attempt=action.attempt)
            elif isinstance(action, PauseUpstream):
                self._log("paused", pending_bytes=stream.pending_bytes)
            elif isinstance(action, Finished):
                record = action.record
                self._log("ended", end_reason=record.end_reason.value,
                          error=record.error_code.label if record.error_code else None)
                self._end_span(record)
        if stream.heartbeats != self._heartbeats:
            self._heartbeats = stream.heartbeats
            since = meter.last_write_at if meter.first_token_at is not None else stream.started_at
            self._log("heartbeat only", silent_s=round(now - since, 3), heartbeats=stream.heartbeats)

    def _end_span(self, record: StreamRecord) -> None:
        span = self._span
        if span is None:
            return
        tokens, source = record.tokens_out
        set_attributes(span, {
            "http.response.status_code": record.status or None, "server.address": record.upstream,
            "tokenwire.end_reason": record.end_reason.value,
            "tokenwire.error.code": record.error_code.value if record.error_code else None,
            "tokenwire.error.number": record.error_code.number if record.error_code else None,
            "tokenwire.stream_id": record.stream_id, "tokenwire.ttft_s": record.ttft_s,
            "tokenwire.ttfb_s": record.ttfb_s, "tokenwire.tokens_out": tokens,
            "tokenwire.tokens_source": source, "tokenwire.bytes_out": record.bytes_out,
            "tokenwire.retries": record.retries})
        if record.error_code is not None:
            span.set_status(StatusCode.ERROR, record.error_code.label)
        span.end()
        self._span = None
