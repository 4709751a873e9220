"""The per-stream wire state machine: every rule about what goes on the wire.

Theory of operation
-------------------
One :class:`WireStream` exists per response. A driver (the ASGI middleware or
the sidecar) feeds it inputs from ``tokenwire.middleware.events`` with
``handle(input, now)``, executes the actions it returns in order, then writes
``data_to_send(now)`` when non-empty and reports ``WriteCompleted`` once the
socket took those bytes. It calls ``handle(Tick(), now)`` at
``next_deadline()``. The core never reads a clock: ``now`` is passed in, so its
tests never sleep.

Lifecycle (anything not in ``TRANSITIONS`` raises ``LocalProtocolError``)::

    WAITING ──COMMIT──▶ COMMITTED ──SEND──▶ STREAMING ──SEND──▶ STREAMING
       │                   │                    │
       └──ABORT──▶ ABORTED ◀──ABORT── (any) ──FINISH──▶ DONE ──ABORT──▶ ABORTED

* WAITING: no byte has gone to the client. The upstream status and headers
  are held until the first upstream event or ``commit_deadline_s``. Only here
  may an upstream failure be retried ("may we retry?" is "are we WAITING?"),
  with backoff and a shared :class:`RetryBudget`; when it cannot be, the
  client gets a real HTTP status with a JSON error body.
* COMMITTED: headers are out (SSE headers, or an error/passthrough status).
  Heartbeats keep the connection alive through a silent prefill.
* STREAMING: events flow. Failures now travel in-band as an error event,
  after which the body is cut without its chunked terminator.
* DONE: the upstream finished (its terminal marker, or a clean EOF for a
  passthrough body); the tail is being flushed. ABORTED: ended for any other
  reason; ``end_reason`` says which.

Once DONE or ABORTED has nothing left to write, the core emits ``CloseClient``
and ``Finished`` with the accounting record — exactly once per stream.

Flow control: bytes go out only when the socket is writable (not paused, no
write outstanding); meanwhile events wait in a :class:`PendingBuffer`, which
merges text deltas (``coalesce``), replaces stale state (``drop``) or pauses
the upstream (``block``). A stall longer than ``write_deadline_s`` or a buffer
over ``max_pending_bytes`` means the client is treated as gone.

Resume (``config.resume``): every event the stream carries is numbered,
``id: <stream>.<seq>``, and also handed to the driver, without its id, in
``ReplayAppend`` actions for the replay store; the end goes with the last one.
The first numbered event also carries ``retry: <resume_retry_ms>`` and the
headers name the stream. ``id:`` and ``retry:`` ride only on events that carry
data, and a heartbeat is one comment line with no blank line after it: the
decoders of openai-python and httpx-sse dispatch every blank line after an
``id:`` as an event, and an event with empty data crashes their JSON decoding.
A core fed ``ReplaySource`` first is a *reader*: its upstream is the replay
store, so it numbers on from where the client left and records nothing. With
``resume_grace_s`` > 0 a client that leaves mid-stream does not end it: the
core emits ``AwaitReader`` and keeps recording the upstream into the store
until the grace ends (then it aborts as usual) or a ``ReaderAttached`` comes,
after which the answer is completed into the store for that reader.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import Enum, StrEnum
from typing import Any

from .config import SlowClientPolicy, WireConfig
from .errors import (
    NO_CLIENT_RETRY,
    ErrorCode,
    LocalError,
    LocalProtocolError,
    SSEProtocolError,
    UpstreamError,
    UpstreamErrorEvent,
    WireError,
)
from .events import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    FailureKind,
    Finished,
    Input,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ReplaySource,
    ResumeUpstream,
    RetryUpstream,
    SocketPaused,
    SocketResumed,
    StopRequested,
    StreamRecord,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
    WriteCompleted,
)
from .headers import (
    STREAM_ID_HEADER,
    is_compressed,
    is_event_stream,
    passthrough_headers,
    sse_response_headers,
)
from .meter import TokenMeter
from .pending import PendingBuffer
from .retry import RetryBudget
from .sse import SSEEvent, SSEParser, encode

# How much of an error answer that arrives after the commit is read for its message.
_LATE_ERROR_BODY_BYTES = 16 * 1024

HEARTBEAT = b": keepalive\n"
"""A comment line alone: no blank line, so no decoder can dispatch it as an event
(see the module docstring)."""
RETRYABLE_STATUSES = frozenset({502, 503, 504})


class StreamState(StrEnum):
    """Lifecycle states; see the module docstring."""

    WAITING = "waiting"
    COMMITTED = "committed"
    STREAMING = "streaming"
    DONE = "done"
    ABORTED = "aborted"


class _Trigger(Enum):
    COMMIT = "commit"
    SEND = "send"
    FINISH = "finish"
    ABORT = "abort"


W, C, S, D, A = (StreamState.WAITING, StreamState.COMMITTED, StreamState.STREAMING,
                 StreamState.DONE, StreamState.ABORTED)
TRANSITIONS: dict[StreamState, dict[_Trigger, StreamState]] = {
    W: {_Trigger.COMMIT: C, _Trigger.ABORT: A},
    C: {_Trigger.SEND: S, _Trigger.FINISH: D, _Trigger.ABORT: A},
    S: {_Trigger.SEND: S, _Trigger.FINISH: D, _Trigger.ABORT: A},
    D: {_Trigger.ABORT: A},
    A: {},
}
_ENDED = frozenset({D, A})


def _error_object(data: str) -> dict[str, Any] | None:
    """The parsed payload if ``data`` is an upstream error event."""
    if '"error"' not in data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if isinstance(obj, dict) and obj.get("error") is not None and "choices" not in obj:
        return obj
    return None


def _plain_event_count(data: bytes, limit_bytes: int, marker: bytes | None) -> int:
    """How many events ``data`` holds if it is nothing but whole, single-line
    ``data: `` events that need no look inside (no terminal marker, no error,
    no usage block, no comment, id, event type or CR); else 0.

    A few C-speed scans of the bytes, conservative by design: anything that
    might need the full algorithm (even the marker's text inside a chunk)
    answers 0 and takes the parser.
    """
    if (len(data) > limit_bytes or not data.startswith(b"data: ") or not data.endswith(b"\n\n")
            or b"\r" in data or b'"error"' in data or (marker is not None and marker in data)):
        return 0
    count = data.count(b"\n\n")
    if (data.count(b"\n") != 2 * count or data.count(b"data: ") != count
            or data.count(b"\n\ndata: ") != count - 1):
        return 0
    usage = data.count(b'"usage"')
    if usage and usage != data.count(b'"usage":null') + data.count(b'"usage": null'):
        return 0
    if not data.isascii():
        # The parser replaces invalid UTF-8 with U+FFFD; bytes passed through
        # unparsed must be no different, or the output would depend on timing.
        try:
            data.decode()
        except UnicodeDecodeError:
            return 0
    return count


class WireStream:
    """The wire core for one response. See the module docstring."""

    def __init__(
        self,
        config: WireConfig,
        *,
        now: float,
        request_id: str,
        upstreams: Sequence[str] = ("",),
        retry_budget: RetryBudget | None = None,
        expect_stream: bool = True,
        stream_id: str | None = None,
        may_repeat: bool = True,
    ) -> None:
        """``expect_stream``: the request asked for a stream, so the commit
        deadline runs from now; otherwise it starts only if the upstream
        answers with an event stream (a plain JSON answer is passed through).
        ``stream_id``: the resume id of this stream, required with ``config.resume``.
        ``may_repeat``: the request may reach an upstream twice
        (:func:`~tokenwire.middleware.retry.may_repeat`); if not, it is retried
        only after a failure that proves no upstream processed it."""
        if not upstreams:
            raise ValueError("upstreams must name at least one upstream")
        if config.resume and not stream_id:
            raise ValueError("config.resume needs a stream_id")
        self.config = config
        self.request_id = request_id
        self.started_at = now
        self._upstreams = tuple(upstreams)
        self._upstream_index = 0
        self._budget = retry_budget
        self._may_repeat = may_repeat
        if retry_budget is not None:
            retry_budget.on_request(now)
        self._state = StreamState.WAITING
        self._parser = self._new_parser()
        self._plain_limit_bytes = min(config.max_line_bytes, config.max_event_bytes)
        marker = config.terminal_marker
        self._marker_bytes = marker.encode() if marker is not None else None
        policy = config.slow_client_policy
        # Answer text merges under every policy: ``drop`` only ever replaces
        # events of the listed (state) types, never answer content.
        self._pending = PendingBuffer(merge=True, drop=policy is SlowClientPolicy.DROP,
                                      droppable_types=frozenset(config.droppable_event_types),
                                      volatile=frozenset(config.volatile_chunk_fields))
        self._actions: list[Action] = []
        # Upstream attempt.
        self._attempt = 0
        self._retry_at: float | None = None
        self._headers_deadline_at: float | None = now + config.upstream_headers_timeout_s
        self._upstream_status: int | None = None
        self._held_headers: tuple[tuple[bytes, bytes], ...] = ()
        self._upstream_open = True
        self._upstream_paused = False
        self._upstream_seen_at = now  # the upstream's last byte, for upstream_idle_timeout_s
        self._passthrough = False
        self._commit_at: float | None = now + config.commit_deadline_s if expect_stream else None
        # Downstream.
        self._paused = False
        self._write_in_flight = False
        self._last_write_at = now
        self._last_progress_at = now
        self._first_pending_at: float | None = None
        self._client_gone = False
        self._finished = False
        self._close_abrupt = False
        self._status = 0
        self._end_reason: EndReason | None = None
        self._error_code: ErrorCode | None = None
        # Accounting.
        self.events_in = 0
        self.events_out = 0
        self.bytes_out = 0
        self.heartbeats = 0
        self.retries = 0
        self.refused_retries = 0
        self.upstream_comments = 0
        self.pending_high_water_bytes = 0
        self._ttfb_s: float | None = None
        self.meter = TokenMeter(now)
        """Time to first token, inter-token gaps (see ``meter.py``); read live by drivers."""
        self._usage: dict[str, Any] | None = None
        # Resume.
        self._stream_id = stream_id or ""
        self._seq = 0  # the last numbered event
        self._retry_field_due = False  # the next numbered event carries ``retry:``
        # An error status that came after the commit: its body, read to tell the client.
        self._late_error_body: bytearray | None = None
        self._late_error_status = 0
        self._replaying = False
        self._recording = config.resume
        self._recorded_bytes = 0
        self._record_frames: list[bytes] = []
        self._record_first_seq = 1
        self._record_end: EndReason | None = None
        self._record_overflow = False
        self._sse_committed = False
        self._hold_until: float | None = None
        self._hold_reason = (EndReason.CLIENT_GONE, ErrorCode.CANCELLED)  # why, if it expires
        self._reader_attached = False
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            UpstreamHeaders: self._on_upstream_headers,
            UpstreamData: self._on_upstream_data,
            UpstreamEvent: self._on_upstream_event,
            UpstreamEnded: self._on_upstream_ended,
            UpstreamFailed: self._on_upstream_failed,
            SocketPaused: self._on_paused,
            SocketResumed: self._on_resumed,
            WriteCompleted: self._on_write_completed,
            ClientGone: self._on_client_gone,
            StopRequested: self._on_stop,
            Rejected: self._on_rejected,
            ReplaySource: self._on_replay_source,
            ReaderAttached: self._on_reader_attached,
            Tick: self._on_tick,
        }

    # ------------------------------------------------------------ public API

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def finished(self) -> bool:
        """True once ``Finished`` was emitted: nothing more will happen."""
        return self._finished

    @property
    def pending_bytes(self) -> int:
        return self._pending.pending_bytes

    @property
    def backpressured(self) -> bool:
        """True while the client is not keeping up (events are queueing)."""
        return self._paused or (self._write_in_flight and bool(self._pending))

    @property
    def upstream(self) -> str:
        """The upstream of the current (or last) attempt."""
        return self._upstreams[self._upstream_index]

    @property
    def end_reason(self) -> EndReason | None:
        return self._end_reason

    def handle(self, event: Input, now: float) -> list[Action]:
        """Feed one input; return the actions to execute, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a wire core input: {event!r}")
        if self._finished:
            if isinstance(event, WriteCompleted) and self._write_in_flight:
                self._write_in_flight = False
            return []
        handler(event, now)
        self._fire_timers(now)
        if self._recording:
            self._flush_record()
        self._maybe_finish(now)
        actions, self._actions = self._actions, []
        return actions

    def data_to_send(self, now: float) -> bytes:
        """Bytes to write now, or ``b""``. After writing non-empty bytes, the
        driver must ``handle(WriteCompleted())`` once the socket took them."""
        if (self._finished or self._paused or self._write_in_flight or not self._pending
                or self._state is StreamState.WAITING or self._client_gone):
            return b""
        window_s = self.config.coalesce_ms / 1000.0
        if (window_s and self._state not in _ENDED and self._first_pending_at is not None
                and now < self._first_pending_at + window_s):
            return b""
        data, events = self._pending.take()
        self._first_pending_at = None
        self._write_in_flight = True
        self._last_write_at = now
        self._last_progress_at = now
        self.bytes_out += len(data)
        if events:
            self._count_content_write(events, now)
        return data

    def forward_read(self, data: bytes, now: float) -> bytes | None:
        """The keeps-up path, in one call, for a driver whose socket writes
        complete at once (the sidecar: ``transport.write`` takes the bytes or
        calls ``pause_writing`` before it returns).

        ``data`` is one upstream read. When the client keeps up (nothing
        pending, no write outstanding, not paused), no timer is due and the
        read is nothing but plain ``data:`` events (the check of the fast
        branch of ``UpstreamData``), returns the bytes to write now, already
        counted as written: exactly what ``handle(UpstreamData(data))``,
        ``data_to_send`` and ``handle(WriteCompleted())`` would have done,
        which would have returned no actions. Otherwise returns None and
        changes nothing: the driver then takes the usual way with
        ``UpstreamData``. Anything ``_on_upstream_data`` records per read
        (for a timer, say) must be recorded here too.
        """
        if (self._state is not StreamState.STREAMING or self._pending or self._paused
                or self._write_in_flight or self._client_gone or self._upstream_paused
                or self._retry_at is not None or self._passthrough or self._finished
                or self.config.resume or self.config.coalesce_ms
                or not self._parser.at_boundary or len(data) > self.config.max_pending_bytes):
            return None
        deadline = self.next_deadline()
        if deadline is not None and now >= deadline:
            return None
        count = _plain_event_count(data, self._plain_limit_bytes, self._marker_bytes)
        if not count:
            return None
        self.events_in += count
        self._upstream_seen_at = now
        if len(data) > self.pending_high_water_bytes:
            self.pending_high_water_bytes = len(data)
        self._last_write_at = now
        self._last_progress_at = now
        self.bytes_out += len(data)
        if self.meter.awaiting_token:
            self.meter.queued(data)
        self._count_content_write(count, now)
        return data

    def next_deadline(self) -> float | None:
        """When the driver should next ``handle(Tick(), now)``; None = no timer."""
        if self._finished:
            return None
        config = self.config
        deadlines: list[float] = []
        if self._retry_at is not None:
            deadlines.append(self._retry_at)
        elif self._headers_deadline_at is not None:
            deadlines.append(self._headers_deadline_at)
        if self._commit_at is not None and self._state is StreamState.WAITING \
                and self._retry_at is None:
            deadlines.append(self._commit_at)
        if self._stalled():
            deadlines.append(self._last_progress_at + config.write_deadline_s)
        elif self._heartbeat_eligible():
            deadlines.append(self._last_write_at + config.heartbeat_s)
        if config.coalesce_ms and self._first_pending_at is not None:
            deadlines.append(self._first_pending_at + config.coalesce_ms / 1000.0)
        if self._hold_until is not None:
            deadlines.append(self._hold_until)
        if self._idle_watched():
            deadlines.append(self._upstream_seen_at + config.upstream_idle_timeout_s)
        if config.max_stream_duration_s and self._state not in _ENDED:
            deadlines.append(self.started_at + config.max_stream_duration_s)
        return min(deadlines) if deadlines else None

    def record(self, now: float) -> StreamRecord:
        """The accounting record as of ``now`` (final once ``finished``)."""
        return StreamRecord(
            request_id=self.request_id,
            upstream=self.upstream,
            status=self._status,
            end_reason=self._end_reason or EndReason.COMPLETE,
            error_code=self._error_code,
            started_at=self.started_at,
            duration_s=now - self.started_at,
            ttfb_s=self._ttfb_s,
            max_event_gap_s=self.meter.max_gap_s,
            event_gap_buckets=tuple(self.meter.gap_buckets),
            events_in=self.events_in,
            events_out=self.events_out,
            bytes_out=self.bytes_out,
            heartbeats=self.heartbeats,
            coalesced_events=self._pending.coalesced_events,
            dropped_events=self._pending.dropped_events,
            retries=self.retries,
            refused_retries=self.refused_retries,
            pending_high_water_bytes=self.pending_high_water_bytes,
            usage=self._usage,
            ttft_s=self.meter.ttft_s,
            event_gap_sum_s=self.meter.gap_sum_s,
            content_events=self.meter.content_events,
            stream_id=self._stream_id or None,
        )

    # ------------------------------------------------------------ state

    def _transition(self, trigger: _Trigger) -> None:
        try:
            self._state = TRANSITIONS[self._state][trigger]
        except KeyError:
            raise LocalProtocolError(
                f"can't {trigger.value} in state {self._state.value}") from None

    def _new_parser(self) -> SSEParser:
        return SSEParser(max_line_bytes=self.config.max_line_bytes,
                         max_event_bytes=self.config.max_event_bytes)

    # ------------------------------------------------------------ upstream inputs

    def _on_upstream_headers(self, event: UpstreamHeaders, now: float) -> None:
        if self._state in _ENDED:
            return
        if self._upstream_status is not None or self._retry_at is not None:
            raise LocalProtocolError("UpstreamHeaders twice for one upstream attempt")
        self._upstream_status = event.status
        self._headers_deadline_at = None
        self._upstream_seen_at = now
        sse = is_event_stream(event.headers)
        if self._state is not StreamState.WAITING:
            # Committed by the deadline before the upstream answered: its
            # status can no longer reach the client except in-band.
            if not 200 <= event.status < 300:
                # Its body is the engine's own word on what went wrong (often an
                # OpenAI error object): read it, then end in-band with it.
                self._late_error_body = bytearray()
                self._late_error_status = event.status
            elif not sse or is_compressed(event.headers):
                self._fail(SSEProtocolError("upstream did not answer with an uncompressed "
                                            "event stream"), EndReason.UPSTREAM_ERROR, now)
            return
        # 503 is the upstream saying it did not take the request on (RFC 9110 15.6.4).
        if event.status in RETRYABLE_STATUSES and self._schedule_retry(
                now, EndReason.UPSTREAM_ERROR, unprocessed=event.status == 503):
            return
        if sse and 200 <= event.status < 300:
            if is_compressed(event.headers):
                self._fail(SSEProtocolError("upstream compressed the event stream; "
                                            "tokenwire asks for identity"),
                           EndReason.UPSTREAM_ERROR, now)
                return
            self._held_headers = event.headers
            if self._commit_at is None:
                self._commit_at = now + self.config.commit_deadline_s
            return
        # Anything else (JSON, an error status with its own body) goes through
        # unchanged: the upstream's own answer is the best error message.
        self._passthrough = True
        headers = passthrough_headers(event.headers)
        if self.retries and event.status >= 500:
            headers = (*headers, NO_CLIENT_RETRY)
        self._commit(event.status, headers, streaming=False, now=now)

    def _on_upstream_data(self, event: UpstreamData, now: float) -> None:
        if self._state in _ENDED or self._retry_at is not None:
            return
        if self._upstream_status is None:
            raise LocalProtocolError("UpstreamData before UpstreamHeaders")
        self._upstream_seen_at = now
        late = self._late_error_body
        if late is not None:
            late += event.data[:max(_LATE_ERROR_BODY_BYTES - len(late), 0)]
            return
        if self._passthrough:
            self._pending.add_bytes(event.data)
            self._after_queue(now)
            return
        if (self._state is StreamState.STREAMING and not self._pending and not self._paused
                and not self._write_in_flight and self._parser.at_boundary):
            count = _plain_event_count(event.data, self._plain_limit_bytes, self._marker_bytes)
            if count:
                # The client keeps up and these are ordinary text chunks: they
                # go out as they came, with nothing to merge them with, so
                # parsing and re-encoding them would only cost time.
                if self.meter.awaiting_token:
                    self.meter.queued(event.data)
                self._pending.add_bytes(self._number_plain(event.data) if self.config.resume
                                        else event.data, count)
                self.events_in += count
                self._after_queue(now)
                return
        try:
            events = self._parser.feed(event.data)
        except SSEProtocolError as error:
            self._upstream_failure(error, EndReason.UPSTREAM_ERROR, now)
            return
        on_sse_event = self._on_sse_event
        for sse_event in events:
            on_sse_event(sse_event, now)
            if self._state in _ENDED or self._retry_at is not None:
                return

    def _on_upstream_event(self, event: UpstreamEvent, now: float) -> None:
        if self._state in _ENDED or self._retry_at is not None:
            return
        if self._upstream_status is None or self._passthrough:
            raise LocalProtocolError("UpstreamEvent needs an event-stream UpstreamHeaders first")
        self._upstream_seen_at = now
        if self._late_error_body is not None:
            return  # the events of an error answer are not the answer
        self._on_sse_event(event.event, now)

    def _on_sse_event(self, event: SSEEvent, now: float) -> None:
        if event.comment is not None:
            # Upstream keepalives are replaced by our own downstream heartbeats.
            self.upstream_comments += 1
            return
        self.events_in += 1
        data = event.data
        error = _error_object(data) if data is not None and '"error"' in data else None
        if error is not None and self._state is StreamState.WAITING:
            # An error as the first event is the engine refusing this request
            # (a bad prompt, too many tokens): the response is that error, with
            # the status it carries, and another attempt would only be refused
            # again, so it is never retried.
            self._fail(UpstreamErrorEvent(error), EndReason.UPSTREAM_ERROR, now)
            return
        if self._state is StreamState.WAITING:
            self._commit_sse(now)
        if error is not None:
            self.meter.terminal_queued()
            self._queue_event(SSEEvent(data=UpstreamErrorEvent(error).sse_data()), droppable=False)
            self._end(EndReason.UPSTREAM_ERROR, ErrorCode.UPSTREAM_FAILED, abrupt=True,
                      trigger=_Trigger.ABORT)
            self._enforce_cap(now)
            return
        marker = self.config.terminal_marker
        if marker is not None and data == marker:
            self.meter.terminal_queued()
            self._queue_event(event, droppable=False)
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=_Trigger.FINISH)
            self._enforce_cap(now)
            return
        if data is not None and '"usage"' in data:
            self._capture_usage(data)
        if data is not None and self.meter.awaiting_token:
            self.meter.queued(data)
        self._queue_event(event)
        if self._state is StreamState.COMMITTED:
            self._transition(_Trigger.SEND)
        self._after_queue(now)

    def _on_upstream_ended(self, event: UpstreamEnded, now: float) -> None:
        self._upstream_open = False
        if self._state in _ENDED or self._retry_at is not None:
            return
        if self._upstream_status is None:
            raise LocalProtocolError("UpstreamEnded before UpstreamHeaders")
        if self._late_error_body is not None:
            self._fail_late_error(now)
            return
        if self._passthrough:
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=_Trigger.FINISH)
            return
        self._parser.close()
        truncated = self._parser.discarded_bytes > 0
        if self._state is StreamState.WAITING and self._replaying:
            # A reconnect after the last event of a finished stream: 204 is how
            # an EventSource is told to stop reconnecting.
            self._commit(204, (), streaming=False, now=now)
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=_Trigger.FINISH)
        elif self._state is StreamState.WAITING:
            self._upstream_failure(UpstreamError("upstream closed the stream before any event",
                                                 ErrorCode.UPSTREAM_FAILED),
                                   EndReason.UPSTREAM_ERROR, now)
        elif self.config.terminal_marker is None and not truncated:
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=_Trigger.FINISH)
        else:
            why = ("a truncated final event" if truncated
                   else f"no {self.config.terminal_marker}")
            self._fail(UpstreamError(f"upstream ended the stream early ({why})",
                                     ErrorCode.UPSTREAM_FAILED), EndReason.UPSTREAM_ERROR, now)

    def _on_upstream_failed(self, event: UpstreamFailed, now: float) -> None:
        self._upstream_open = False
        if self._state in _ENDED or self._retry_at is not None:
            return
        if self._late_error_body is not None:
            self._fail_late_error(now)  # with as much of its body as came
            return
        kind = event.kind
        error: WireError
        reason = EndReason.UPSTREAM_ERROR
        if kind is FailureKind.CONNECT:
            error = UpstreamError(f"upstream unavailable: {event.message}",
                                  ErrorCode.UPSTREAM_UNAVAILABLE, retry_after_s=1)
        elif kind is FailureKind.TIMEOUT:
            error = UpstreamError(f"upstream timed out: {event.message}",
                                  ErrorCode.UPSTREAM_TIMEOUT, http_status=504)
            reason = EndReason.UPSTREAM_TIMEOUT
        elif kind is FailureKind.INVALID_STREAM:
            error = SSEProtocolError(event.message)
        else:
            error = UpstreamError(f"upstream failed: {event.message}", ErrorCode.UPSTREAM_FAILED)
        # No connection: nothing of the request reached an upstream.
        self._upstream_failure(error, reason, now, unprocessed=kind is FailureKind.CONNECT)

    # ------------------------------------------------------------ downstream inputs

    def _on_paused(self, event: SocketPaused, now: float) -> None:
        self._paused = True

    def _on_resumed(self, event: SocketResumed, now: float) -> None:
        if self._paused:
            self._paused = False
            self._last_progress_at = now

    def _on_write_completed(self, event: WriteCompleted, now: float) -> None:
        if not self._write_in_flight:
            raise LocalProtocolError("WriteCompleted without a write in flight")
        self._write_in_flight = False
        self._last_progress_at = now
        if self._upstream_paused and not self._pending and self._state not in _ENDED:
            self._upstream_paused = False
            self._upstream_seen_at = now  # its silence while paused was ours
            self._actions.append(ResumeUpstream())

    def _on_client_gone(self, event: ClientGone, now: float) -> None:
        if self._hold_until is not None:
            return  # already held for a reconnect (e.g. the reset of a slow client we cut)
        self._client_gone = True
        self._pending.clear()
        self._first_pending_at = None
        if self._hold_for_resume(now, EndReason.CLIENT_GONE, ErrorCode.CANCELLED):
            return
        if self._state is StreamState.DONE or self._state not in _ENDED:
            # A complete answer the client did not get all of is still lost.
            self._end_reason = None
            self._end(EndReason.CLIENT_GONE, ErrorCode.CANCELLED, abrupt=True,
                      trigger=_Trigger.ABORT)

    def _on_stop(self, event: StopRequested, now: float) -> None:
        if self._state in _ENDED:
            return
        if event.reason is EndReason.SHUTDOWN:
            error = LocalError("the server is shutting down", ErrorCode.SHUTDOWN,
                               http_status=503, retry_after_s=1)
        else:
            error = LocalError("the stream was cancelled by an operator", ErrorCode.CANCELLED,
                               http_status=503)
        self._fail(error, event.reason, now)

    def _on_rejected(self, event: Rejected, now: float) -> None:
        # The driver stopped its source itself: no abort goes anywhere.
        self._upstream_open = False
        if self._state not in _ENDED:
            self._fail(event.error, EndReason.REFUSED, now)

    def _on_replay_source(self, event: ReplaySource, now: float) -> None:
        if not self.config.resume:
            raise LocalProtocolError("ReplaySource needs config.resume")
        if self._state is not StreamState.WAITING or self._upstream_status is not None:
            raise LocalProtocolError("ReplaySource must come before the upstream's headers")
        self._stream_id = event.stream_id
        self._seq = event.after_seq
        self._replaying = True
        self._recording = False
        # A replay arrives in batches, not because the reader is slow: merging
        # would renumber what the client asked for event by event. The store
        # can simply be read more slowly instead (block policy, below).
        self._pending.merge = False
        self._pending.drop = False

    def _on_reader_attached(self, event: ReaderAttached, now: float) -> None:
        if self._hold_until is not None:
            self._hold_until = None
            self._reader_attached = True

    def _on_tick(self, event: Tick, now: float) -> None:
        pass  # timers fire after every input; see _fire_timers

    # ------------------------------------------------------------ timers

    def _stalled(self) -> bool:
        # A write the socket has not taken is data pending too: without it, a
        # client that stops reading during the last write (or a silent spell)
        # would hold the stream forever.
        return not self._client_gone and (
            self._write_in_flight or (self._paused and self._state is not StreamState.WAITING))

    def _heartbeat_eligible(self) -> bool:
        return (self.config.heartbeat_s > 0 and not self._passthrough and not self._client_gone
                and self._state in (StreamState.COMMITTED, StreamState.STREAMING)
                and not self._pending and not self._write_in_flight and not self._paused)

    def _idle_watched(self) -> bool:
        """The upstream answered and owes us bytes: its silence is timed.
        Not while the core paused it (block policy), and not for a replay,
        whose source is the store, not an upstream."""
        return (self.config.upstream_idle_timeout_s > 0 and self._upstream_status is not None
                and self._upstream_open and not self._upstream_paused and self._retry_at is None
                and not self._replaying and self._state not in _ENDED)

    def _fire_timers(self, now: float) -> None:
        if self._finished:
            return
        config = self.config
        # Time first, as below: the cheap test, false on almost every input.
        if (config.max_stream_duration_s and now >= self.started_at + config.max_stream_duration_s
                and self._state not in _ENDED):
            self._retry_at = None
            self._fail(UpstreamError(f"the stream ran for its limit of {config.max_stream_duration_s:g} s",
                                     ErrorCode.UPSTREAM_TIMEOUT, http_status=504),
                       EndReason.UPSTREAM_TIMEOUT, now)
        idle_s = config.upstream_idle_timeout_s
        if idle_s and now >= self._upstream_seen_at + idle_s and self._idle_watched():
            # A hung engine: heartbeats would otherwise hide it from the client forever.
            self._upstream_failure(
                UpstreamError(f"no data from upstream for {config.upstream_idle_timeout_s:g} s",
                              ErrorCode.UPSTREAM_TIMEOUT, http_status=504),
                EndReason.UPSTREAM_TIMEOUT, now)
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            self._upstream_index = self._attempt % len(self._upstreams)
            self._upstream_open = True
            self._headers_deadline_at = now + config.upstream_headers_timeout_s
            self._actions.append(RetryUpstream(self._attempt, self._upstream_index))
        if (self._headers_deadline_at is not None and now >= self._headers_deadline_at
                and self._state not in _ENDED):
            self._headers_deadline_at = None
            # The attempt is still open (the engine may be working on it): the
            # retry or the end below aborts it, saying which.
            self._upstream_failure(
                UpstreamError(f"no response from upstream within "
                              f"{config.upstream_headers_timeout_s:g} s",
                              ErrorCode.UPSTREAM_TIMEOUT, http_status=504),
                EndReason.UPSTREAM_TIMEOUT, now)
        if (self._commit_at is not None and now >= self._commit_at and self._retry_at is None
                and self._state is StreamState.WAITING):
            self._commit_sse(now)
        # Time first: it is the cheap test, and the two conditions exclude each other.
        if now >= self._last_progress_at + config.write_deadline_s and self._stalled():
            self._slow_client(ErrorCode.SEND_TIMEOUT, now)
        elif now >= self._last_write_at + config.heartbeat_s and self._heartbeat_eligible():
            self._pending.add_bytes(HEARTBEAT)
            self.heartbeats += 1
        if self._hold_until is not None and now >= self._hold_until:
            # Nobody came back for it: what the grace delayed happens now.
            reason, code = self._hold_reason
            self._end(reason, code, abrupt=True, trigger=_Trigger.ABORT)

    # ------------------------------------------------------------ decisions

    def _commit(self, status: int, headers: tuple[tuple[bytes, bytes], ...], *,
                streaming: bool, now: float) -> None:
        self._transition(_Trigger.COMMIT)
        self._status = status
        self._commit_at = None
        self._last_write_at = now
        self._actions.append(CommitHeaders(status, headers, streaming))

    def _commit_sse(self, now: float) -> None:
        headers = sse_response_headers(self._held_headers)
        if self.config.resume:
            headers = (*headers, (STREAM_ID_HEADER, self._stream_id.encode()))
        self._commit(200, headers, streaming=True, now=now)
        self._sse_committed = True
        # On the first numbered event, so an EventSource knows how soon to come back.
        self._retry_field_due = self.config.resume

    def _fail_late_error(self, now: float) -> None:
        """End in-band with an error status that arrived after the commit: the
        engine's error object forwarded as it came if the body is one, else
        the status and the start of the body in words."""
        body = bytes(self._late_error_body or b"")
        self._late_error_body = None
        error: WireError | None = None
        if body[:1] == b"{":
            payload = _error_object(body.decode("utf-8", "replace"))
            if payload is not None:
                error = UpstreamErrorEvent(payload)
        if error is None:
            text = " ".join(body.decode("utf-8", "replace").split())[:200]
            message = f"upstream answered {self._late_error_status}" + (f": {text}" if text else "")
            error = UpstreamError(message, ErrorCode.UPSTREAM_FAILED)
        self._fail(error, EndReason.UPSTREAM_ERROR, now)

    def _schedule_retry(self, now: float, reason: EndReason, *, unprocessed: bool = False) -> bool:
        """Arrange a retry of the upstream if allowed; True if one is coming.

        ``unprocessed``: the failure proves the upstream did not process the
        request (no connection was made; it answered 503). Otherwise the
        upstream may have read it, and a request that may not be repeated
        (a POST without ``Idempotency-Key``: one more generation) is not sent
        again; nginx's rule for non-idempotent requests.

        The failed attempt's connection is aborted here if it is still open (a
        502 body, an error event): it must never be read again or reused."""
        if (self._state is not StreamState.WAITING or self._attempt >= self.config.retry_attempts
                or self._replaying or not (self._may_repeat or unprocessed)):
            return False
        if self._budget is not None and not self._budget.try_acquire(now):
            self.refused_retries += 1
            return False
        if self._upstream_open:
            self._actions.append(AbortUpstream(reason, final=False))
            self._upstream_open = False
        self._attempt += 1
        self.retries += 1
        config = self.config
        delay_s = min(config.retry_backoff_s * 2 ** (self._attempt - 1), config.retry_backoff_max_s)
        self._retry_at = now + delay_s
        self._parser = self._new_parser()
        self._upstream_status = None
        self._held_headers = ()
        self._headers_deadline_at = None
        return True

    def _upstream_failure(self, error: WireError, reason: EndReason, now: float, *,
                          unprocessed: bool = False) -> None:
        """The upstream failed: retry while WAITING if allowed, else fail."""
        if self._schedule_retry(now, reason, unprocessed=unprocessed):
            return
        self._fail(error, reason, now)

    def _fail(self, error: WireError, reason: EndReason, now: float) -> None:
        """End the stream with ``error``: a real status before the first byte,
        in-band after it, a bare abrupt close for a passthrough body."""
        if self._state is StreamState.WAITING:
            body = error.body()
            headers = (*error.response_headers(), (b"content-length", str(len(body)).encode()))
            if self.retries and NO_CLIENT_RETRY not in headers:
                # We already retried: a client's retries on top would multiply the load.
                headers = (*headers, NO_CLIENT_RETRY)
            self._commit(error.http_status, headers, streaming=False, now=now)
            self._pending.add_bytes(body)
            self._end(reason, error.code, abrupt=False, trigger=_Trigger.ABORT)
        elif self._passthrough:
            self._end(reason, error.code, abrupt=True, trigger=_Trigger.ABORT)
        else:
            # A reader's own ending (shutdown, cancel, the store lost the rest)
            # is not an event of the stream: numbering it would shadow the
            # stored event of that number on the next reconnect.
            self.meter.terminal_queued()
            self._queue_event(SSEEvent(data=error.sse_data()), droppable=False,
                              numbered=not self._replaying)
            self._end(reason, error.code, abrupt=True, trigger=_Trigger.ABORT)
            self._enforce_cap(now)

    def _end(self, reason: EndReason, code: ErrorCode | None, *, abrupt: bool,
             trigger: _Trigger) -> None:
        self._transition(trigger)
        if self._recording and self._record_end is None:
            self._record_stream_end(reason)
        if self._end_reason is None:
            # The record says a complete answer went to a resuming reader, not to its client.
            detached = reason is EndReason.COMPLETE and self._reader_attached
            self._end_reason = EndReason.DETACHED if detached else reason
            self._error_code = code
        self._close_abrupt = abrupt
        self._commit_at = None
        self._retry_at = None
        self._headers_deadline_at = None
        self._hold_until = None  # whatever ended a held stream, its grace is over
        if self._upstream_open and reason is not EndReason.COMPLETE:
            self._upstream_open = False
            # A reader's upstream is the replay store: it generates nothing, so
            # there is no generation to tell the engine to stop.
            self._actions.append(AbortUpstream(reason, final=not self._replaying))

    def _slow_client(self, code: ErrorCode, now: float) -> None:
        self._pending.clear()
        self._first_pending_at = None
        if self._hold_for_resume(now, EndReason.SLOW_CLIENT, code):
            self._actions.append(CloseClient(abrupt=True, reset=True))
            return
        if self._state is not StreamState.ABORTED:
            # A stream already ending with an error keeps that root cause.
            self._end_reason = None
            self._end(EndReason.SLOW_CLIENT, code, abrupt=True, trigger=_Trigger.ABORT)
        self._actions.append(CloseClient(abrupt=True, reset=True))
        self._client_gone = True

    def _after_queue(self, now: float) -> None:
        """Bookkeeping after content was queued: window, cap, block policy."""
        pending = self._pending.pending_bytes
        if self._first_pending_at is None and pending:
            self._first_pending_at = now
        if self._enforce_cap(now):
            return
        block = (self._passthrough or self._replaying
                 or self.config.slow_client_policy is SlowClientPolicy.BLOCK)
        if block and not self._upstream_paused and pending >= self.config.max_pending_bytes // 2 and (
                self._paused or self._write_in_flight):
            self._upstream_paused = True
            self._actions.append(PauseUpstream())

    def _enforce_cap(self, now: float) -> bool:
        """Track the high-water mark and hold the cap, for terminal events too
        (``[DONE]``, an error event): a client that cannot take them is as gone
        as one that cannot take text. True if the client was cut off."""
        pending = self._pending.pending_bytes
        if pending > self.pending_high_water_bytes:
            self.pending_high_water_bytes = pending
        if pending > self.config.max_pending_bytes:
            self._slow_client(ErrorCode.BACKPRESSURE_EXCEEDED, now)
            return True
        return False

    def _maybe_finish(self, now: float) -> None:
        if self._finished or self._state not in _ENDED:
            return
        if not self._client_gone and (self._pending or self._write_in_flight):
            return
        self._finished = True
        if not self._client_gone:
            self._actions.append(CloseClient(abrupt=self._close_abrupt))
        self._actions.append(Finished(self.record(now)))

    # ------------------------------------------------------------ resume

    def _queue_event(self, event: SSEEvent, *, droppable: bool = True, numbered: bool = True) -> None:
        """Queue one event for the client: numbered and recorded under resume."""
        if self.config.resume and numbered:
            self._seq += 1
            if self._recording:
                bare = event if event.id is None else SSEEvent(
                    data=event.data, event=event.event, retry=event.retry)
                self._record(encode(bare))
            retry = event.retry
            if self._retry_field_due:
                self._retry_field_due = False
                retry = self.config.resume_retry_ms
            event = SSEEvent(data=event.data, event=event.event, retry=retry,
                             id=f"{self._stream_id}.{self._seq}")
        if not self._client_gone:
            self._pending.add_event(event, droppable=droppable)

    def _number_plain(self, data: bytes) -> bytes:
        """Fast-path bytes (whole single-line ``data:`` events) with ids added.
        (The fast path runs only once STREAMING: the first event, which carries
        ``retry:``, has always taken ``_queue_event``.)"""
        prefix = b"\nid: " + self._stream_id.encode() + b"."
        out: list[bytes] = []
        for frame in data.split(b"\n\n")[:-1]:
            self._seq += 1
            if self._recording:
                self._record(frame + b"\n\n")
            out.append(frame + prefix + str(self._seq).encode() + b"\n\n")
        return b"".join(out)

    def _record(self, frame: bytes) -> None:
        if self._recorded_bytes + len(frame) > self.config.resume_max_bytes:
            # Past the per-stream cap: the store keeps what it has, readers
            # that get that far are told the rest is gone.
            self._record_overflow = True
            self._flush_record()
            self._recording = False
            return
        self._recorded_bytes += len(frame)
        self._record_frames.append(frame)

    def _record_stream_end(self, reason: EndReason) -> None:
        # Before the event stream was committed nobody saw anything: nothing to
        # resume, and the idempotency key is released so a retry generates.
        committed = self._sse_committed
        if committed and reason in (EndReason.CLIENT_GONE, EndReason.SLOW_CLIENT):
            # What a later reader learns instead of the rest of the answer.
            error = LocalError("the answer was stopped when its client left", ErrorCode.CANCELLED)
            self._seq += 1
            self._record(encode(SSEEvent(data=error.sse_data())))
        self._record_end = reason
        if not committed:
            self._record_frames.clear()
        self._flush_record(discard=not committed)
        self._recording = False

    def _flush_record(self, *, discard: bool = False) -> None:
        frames = self._record_frames
        if not frames and self._record_end is None and not self._record_overflow:
            return
        self._actions.append(ReplayAppend(
            self._stream_id, self._record_first_seq, tuple(frames), end=self._record_end,
            overflow=self._record_overflow, discard=discard))
        self._record_first_seq += len(frames)
        self._record_frames = []

    def _hold_for_resume(self, now: float, reason: EndReason, code: ErrorCode) -> bool:
        """On a client's departure: keep the stream for a reconnect if the
        grace allows; True if it is now held (not ended). ``reason``/``code``
        are what the stream ends with if nobody comes back."""
        grace_s = self.config.resume_grace_s
        if (not self._recording or grace_s <= 0 or self._hold_until is not None
                or self._state not in (StreamState.COMMITTED, StreamState.STREAMING)):
            return False
        self._client_gone = True
        self._hold_until = now + grace_s
        self._hold_reason = (reason, code)
        self._actions.append(AwaitReader(self._stream_id, self._hold_until))
        return True

    # ------------------------------------------------------------ accounting

    def _count_content_write(self, events: int, now: float) -> None:
        self.events_out += events
        if self._ttfb_s is None:
            self._ttfb_s = now - self.started_at
        self.meter.wrote(events, now)

    def _capture_usage(self, data: str) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]
