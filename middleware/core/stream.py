"""The per-response wire state machine: every rule about what goes on the wire.

Theory of operation
-------------------
One :class:`WireStream` exists per response. A driver (the ASGI middleware or
the sidecar) feeds it inputs from ``tokenwire.middleware.core.events`` with
``handle(input, now)``, executes the actions it returns in order, then writes
``data_to_send(now)`` when non-empty and reports ``WriteCompleted`` once the
socket took those bytes. It calls ``handle(Tick(), now)`` at
``next_deadline()``. The core never reads a clock: ``now`` is passed in, so its
tests never sleep.

The stream composes small parts, each with its own states and docstring:

* ``lifecycle.py``: the response as the client sees it (WAITING, COMMITTED,
  STREAMING, DONE, ABORTED), a transition table guarded by ``_transition``;
* ``attempt.py``: the current upstream attempt (connecting, answered, a late
  error, the backoff before a retry);
* ``client_socket.py``: can the client's socket take bytes now (writable,
  writing, paused, gone), and the times the client-side timers run from;
* ``recording.py``: resume — numbering, recording for the replay store, and
  the hold that keeps a departed client's stream for a reconnect;
* ``accounting.py``: the counters and the record each response ends with;
* ``pending.py``: what waits for the socket, and how it merges (the OpenAI
  chunk format itself is ``chunks.py``'s).

This module holds the *decisions* that tie them together: what each input
does in each lifecycle state, when to commit, retry, fail, end, cut off a slow
reader, or hold for a reconnect. Once DONE or ABORTED has nothing left to
write, the core emits ``CloseClient`` and ``Finished`` with the accounting
record, exactly once per response.

Flow control: bytes go out only when the socket is writable; meanwhile events
wait in a :class:`PendingBuffer`, which merges text deltas (``coalesce``),
replaces stale state (``drop``) or pauses the upstream (``block``). A stall
longer than ``write_deadline_s`` or a buffer over ``max_pending_bytes`` means
the client is treated as gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .accounting import GAP_BUCKETS_S
from .attempt import RETRYABLE_STATUSES, failure_error
from .chunks import plain_event_count
from .config import NonStreamAnswer
from .decisions import HEARTBEAT, StreamDecisions
from .dialects.base import ERROR, FAILED, GENERIC, KEEPALIVE, TERMINAL, Dialect
from .dialects.routes import AUTO_MARKER, detect
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
    Action,
    ClientGone,
    EndReason,
    Input,
    ReaderAttached,
    Rejected,
    ReplaySource,
    ResumeUpstream,
    SocketPaused,
    SocketResumed,
    StopRequested,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
    WriteCompleted,
)
from .headers import header_value, is_compressed, is_event_stream, passthrough_headers
from .lifecycle import ENDED as _ENDED
from .lifecycle import TRANSITIONS, StreamState, Trigger
from .meter import TokenMeter
from .sse import SSEEvent

__all__ = ["GAP_BUCKETS_S", "HEARTBEAT", "TRANSITIONS", "StreamState", "WireStream"]

# Final: compiled, a final module name is a C static, not a lookup in the module's dict.
W: Final = StreamState.WAITING
C: Final = StreamState.COMMITTED
S: Final = StreamState.STREAMING
_NO_DEADLINE: Final = float("inf")


class WireStream(StreamDecisions):
    """The wire core for one response. See the module docstring; the
    constructor's arguments are :class:`StreamDecisions`'s."""


    # ------------------------------------------------------------ public API

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def finished(self) -> bool:
        """True once ``Finished`` was emitted: nothing more will happen."""
        return self._finished

    def departure_aborts_upstream(self) -> bool:
        """What ``handle(ClientGone())`` would do to the upstream now, without
        doing it: True when it would end the response with ``AbortUpstream``
        (False when the stream is held for a reconnect, already over, or has
        no upstream open). Reads the state only.

        For a driver that closes the upstream's socket the moment a client
        leaves and hands the core that ``ClientGone`` later, stamped with the
        time the client left and ahead of any other input: the state is then
        the one this answer read, so the core's actions start with the abort
        the driver already began. When many clients leave at once, every
        upstream is so closed before any of their bookkeeping runs."""
        return not self._finished and self._attempt.open and self._departure_ends()

    @property
    def pending_bytes(self) -> int:
        return self._pending.pending_bytes

    @property
    def backpressured(self) -> bool:
        """True while the client is not keeping up (events are queueing)."""
        client = self._client
        return client.paused or (client.write_in_flight and bool(self._pending))

    @property
    def upstream(self) -> str:
        """The upstream of the current (or last) attempt."""
        return self._attempt.upstream

    @property
    def end_reason(self) -> EndReason | None:
        return self._end_reason

    @property
    def error_code(self) -> ErrorCode | None:
        """The code the stream ended with (None while it runs or if it completed)."""
        return self._error_code

    @property
    def error(self) -> WireError | None:
        """The error the stream ended with, as tokenwire put it on the wire (its
        code, message and HTTP status), or the engine's own error event; None
        while it runs, if it completed, or if it ended without one (a departed
        or slow client: ``error_code`` still says why). For a driver that maps
        an ending to its own protocol (the gRPC gateway's status)."""
        return self._error

    def handle(self, event: Input, now: float) -> list[Action]:
        """Feed one input; return the actions to execute, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not a wire core input: {event!r}")
        if self._finished:
            client = self._client
            if isinstance(event, WriteCompleted) and client.write_in_flight:
                client.write_in_flight = False
            return []
        self._deadline_bound = None
        handler(self, event, now)
        self._fire_timers(now)
        resume = self._resume
        if resume.recording:
            resume.flush()
        self._maybe_finish(now)
        actions, self._actions = self._actions, []
        return actions

    def data_to_send(self, now: float) -> bytes:
        """Bytes to write now, or ``b""``. After writing non-empty bytes, the
        driver must ``handle(WriteCompleted())`` once the socket took them."""
        client = self._client
        if (self._finished or client.paused or client.write_in_flight or not self._pending
                or self._state is W or client.gone):
            return b""
        window_s = self.config.coalesce_ms / 1000.0
        if (window_s and self._state not in _ENDED and client.pending_since is not None
                and now < client.pending_since + window_s):
            return b""
        data, events = self._pending.take()
        self._deadline_bound = None
        client.started_write(now)
        acct = self._acct
        acct.bytes_out += len(data)
        if events:
            acct.content_written(events, now)
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
        client = self._client
        attempt = self._attempt
        if (self._state is not S or self._pending or client.paused or client.write_in_flight
                or client.gone or attempt.paused or attempt.retry_at is not None
                or attempt.passthrough or self._finished or not self._one_call_path
                or not attempt.parser.at_boundary or len(data) > self._max_pending_bytes):
            return None
        # next_deadline() only moves later on this path (it sets the times the
        # heartbeat and idle timers run from to ``now``), so the value computed
        # after the last input is a lower bound until the next one: one float
        # comparison per read instead of walking every timer. A bound already
        # passed takes the usual way, whose input recomputes it.
        due_at = self._deadline_bound
        if due_at is None:
            deadline = self.next_deadline()
            due_at = self._deadline_bound = _NO_DEADLINE if deadline is None else deadline
        if now >= due_at:
            return None
        count = plain_event_count(data, self._plain_limit_bytes, self._marker)
        if not count:
            return None
        acct = self._acct
        acct.events_in += count
        # Plain chunks count one piece each (a scan for the text here would cost a
        # third of this path; a finish chunk that came this way counts one too).
        acct.tokens_in += count
        attempt.seen_at = now
        acct.idle_keepalives = 0
        size = len(data)
        if size > acct.pending_high_water_bytes:
            acct.pending_high_water_bytes = size
        client.wrote_at_once(now)
        acct.bytes_out += size
        meter = acct.meter
        if not meter.token_queued:
            meter.queued(data)
        acct.content_written(count, now)
        return data

    @property
    def meter(self) -> TokenMeter:
        """Time to first token and inter-token gaps (``meter.py``); drivers read it live."""
        return self._acct.meter

    # The attempt's fields under the names the core's property tests look at.

    @property
    def _upstreams(self) -> tuple[str, ...]:
        return self._attempt.upstreams

    @property
    def _retry_at(self) -> float | None:
        return self._attempt.retry_at

    @property
    def _late_error_body(self) -> bytearray | None:
        return self._attempt.late_error_body

    # ------------------------------------------------------------ upstream inputs

    def _on_upstream_headers(self, event: UpstreamHeaders, now: float) -> None:
        if self._state in _ENDED:
            return
        attempt = self._attempt
        attempt.answered(event.status, now)
        sse = is_event_stream(event.headers)
        if self._state is not W:
            # Committed by the deadline before the upstream answered: its
            # status can no longer reach the client except in-band.
            if not 200 <= event.status < 300:
                # Its body is the engine's own word on what went wrong (often an
                # OpenAI error object): read it, then end in-band with it.
                attempt.start_late_error(event.status)
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
            attempt.held_headers = event.headers
            if self._commit_at is None:
                self._commit_at = now + self.config.commit_deadline_s
            return
        if self._expect_stream and 200 <= event.status < 300:
            # A streaming request answered with something else (a wrong port's HTML
            # page, an engine that ignored "stream"): an SDK would read no event
            # and raise nothing, so on a known dialect's route it is refused.
            answer = self.config.non_event_stream_answer
            if answer is NonStreamAnswer.REJECT or (answer is NonStreamAnswer.AUTO
                                                    and self._dialect.name != GENERIC):
                kind = header_value(event.headers, b"content-type") or b"no content-type"
                self._fail(UpstreamError(
                    f"the upstream answered a streaming request with "
                    f"{kind.decode('latin-1')[:100]!r}, not text/event-stream",
                    ErrorCode.UPSTREAM_FAILED, http_status=502), EndReason.NOT_EVENT_STREAM, now)
                return
            self._passthrough_reason = EndReason.NOT_EVENT_STREAM
        if event.status >= 400:
            self._passthrough_reason = EndReason.UPSTREAM_STATUS
        # Anything else (JSON, an error status with its own body) goes through
        # unchanged: the upstream's own answer is the best error message.
        attempt.passthrough = True
        headers = passthrough_headers(event.headers)
        if self._acct.retries and event.status >= 500:
            headers = (*headers, NO_CLIENT_RETRY)
        self._commit(event.status, headers, streaming=False, now=now)

    def _on_upstream_data(self, event: UpstreamData, now: float) -> None:
        attempt = self._attempt
        if self._state in _ENDED or attempt.retry_at is not None:
            return
        if attempt.status is None:
            raise LocalProtocolError("UpstreamData before UpstreamHeaders")
        if attempt.late_error_body is not None:
            attempt.seen_at = now
            attempt.read_late_error(event.data)
            return
        if attempt.passthrough:
            attempt.seen_at = now
            self._pending.add_bytes(event.data)
            self._after_queue(now)
            return
        client = self._client
        if (self._state is S and self._fast_path and not self._pending and not client.paused
                and not client.write_in_flight and attempt.parser.at_boundary):
            count = plain_event_count(event.data, self._plain_limit_bytes, self._marker)
            if count:
                attempt.seen_at = now
                self._acct.idle_keepalives = 0
                self._acct.tokens_in += count  # one piece each, as in forward_read
                # The client keeps up and these are ordinary text chunks: they
                # go out as they came, with nothing to merge them with, so
                # parsing and re-encoding them would only cost time.
                if self._acct.meter.awaiting_token:
                    self._acct.meter.queued(event.data)
                self._pending.add_bytes(self._resume.number_plain(event.data) if self.config.resume
                                        else event.data, count)
                self._acct.events_in += count
                self._after_queue(now)
                return
        try:
            events = attempt.parser.feed(event.data)
        except SSEProtocolError as error:
            self._upstream_failure(error, EndReason.UPSTREAM_ERROR, now)
            return
        on_sse_event = self._on_sse_event
        for sse_event in events:
            on_sse_event(sse_event, now)
            if self._state in _ENDED or attempt.retry_at is not None:
                return

    def _on_upstream_event(self, event: UpstreamEvent, now: float) -> None:
        attempt = self._attempt
        if self._state in _ENDED or attempt.retry_at is not None:
            return
        if attempt.status is None or attempt.passthrough:
            raise LocalProtocolError("UpstreamEvent needs an event-stream UpstreamHeaders first")
        if attempt.late_error_body is not None:
            attempt.seen_at = now
            return  # the events of an error answer are not the answer
        self._on_sse_event(event.event, now)

    def _on_sse_event(self, event: SSEEvent, now: float) -> None:
        acct = self._acct
        if event.comment is not None:
            # Upstream keepalives are replaced by our own downstream heartbeats.
            acct.upstream_comments += 1
            acct.upstream_keepalives += 1
            acct.idle_keepalives += 1
            return
        acct.events_in += 1
        dialect = self._dialect
        if not self._dialect_confirmed and event.data is not None:
            # The first event with data says (an ``id:`` or ``retry:`` alone says nothing).
            self._dialect_confirmed = True
            if self._resume.reader:
                dialect = self._speak(detect(event, self.config.terminal_marker))
            elif not dialect.confirms(event):
                # A shape tokenwire does not know: passed exactly (no merging, no
                # error or terminal rule but the operator's marker).
                marker = self.config.terminal_marker
                dialect = self._speak(Dialect(None if marker == AUTO_MARKER else marker))
            elif self._resume.recording:
                self._resume.alias = dialect.stream_alias(event)
        kind = dialect.classify(event)
        if kind == KEEPALIVE:
            acct.upstream_keepalives += 1
            acct.idle_keepalives += 1
        else:
            # The content-inactivity clock: only events of content or state move it.
            self._attempt.seen_at = now
            acct.idle_keepalives = 0
        if kind == ERROR:
            payload = dialect.error_payload(event)
            if self._state is W and dialect.first_error_is_status:
                # An error as the first event is the engine refusing this request
                # (a bad prompt, too many tokens): the response is that error, with
                # the status it carries, and another attempt would only be refused
                # again, so it is never retried.
                self._fail(UpstreamErrorEvent(payload), EndReason.UPSTREAM_ERROR, now)
                return
            if self._state is W:
                self._commit_sse(now)
            if self._end_reason is None:
                self._error = UpstreamErrorEvent(payload if "error" in payload else {"error": payload})
            acct.meter.terminal_queued()
            self._queue_event(dialect.forwarded_error(event, payload), droppable=False, upstream=True)
            ends = dialect.error_is_terminal
            self._end(EndReason.UPSTREAM_ERROR, ErrorCode.UPSTREAM_FAILED, abrupt=not ends,
                      trigger=Trigger.FINISH if ends else Trigger.ABORT)
            self._enforce_cap(now)
            return
        if self._state is W:
            self._commit_sse(now)
        acct.usage = dialect.usage(event, acct.usage)
        if kind in (TERMINAL, FAILED):
            if kind == TERMINAL and self._summary:
                acct.meter.terminal_queued()  # no token: off the count its write adds
                self._queue_event(self._summary_event(now), droppable=False, numbered=False)
            acct.meter.terminal_queued()
            self._queue_event(event, droppable=False, upstream=True)
            if kind == TERMINAL:
                self._end(EndReason.COMPLETE, None, abrupt=False, trigger=Trigger.FINISH)
            else:
                # The engine's own report of its failure, in the dialect's terminal
                # event: the body ends as the client would have read it directly.
                self._end(EndReason.UPSTREAM_ERROR, ErrorCode.UPSTREAM_FAILED, abrupt=False,
                          trigger=Trigger.FINISH)
            self._enforce_cap(now)
            return
        if self._hide_usage_chunk and dialect.is_usage_only(event):
            return  # asked for by tokenwire, read into the record above: not the client's
        data = event.data
        if data is not None:
            acct.tokens_in += dialect.count_tokens(data)
            if acct.meter.awaiting_token:
                acct.meter.queued(data)
        self._queue_event(event, upstream=True)
        if self._state is C:
            self._transition(Trigger.SEND)
        self._after_queue(now)

    def _speak(self, dialect: Dialect) -> Dialect:
        """Apply ``dialect``'s rules from the first event on (the route's did not
        fit, or a resumed stream's path names none)."""
        self._dialect = dialect
        self._marker = dialect.marker
        self._fast_path = dialect.fast_path
        self._one_call_path = self._one_call_path and dialect.fast_path
        self._pending.use_dialect(dialect)
        return dialect

    def _on_upstream_ended(self, event: UpstreamEnded, now: float) -> None:
        attempt = self._attempt
        attempt.open = False
        if self._state in _ENDED or attempt.retry_at is not None:
            return
        if attempt.status is None:
            raise LocalProtocolError("UpstreamEnded before UpstreamHeaders")
        if attempt.late_error_body is not None:
            self._fail(attempt.late_error(), EndReason.UPSTREAM_ERROR, now)
            return
        if attempt.passthrough:
            # An error status or a body that is not the stream asked for is passed
            # through whole, but the record says what it was.
            reason = self._passthrough_reason
            self._end(reason, None if reason is EndReason.COMPLETE else ErrorCode.UPSTREAM_FAILED,
                      abrupt=False, trigger=Trigger.FINISH)
            return
        attempt.parser.close()
        truncated = attempt.parser.discarded_bytes > 0
        if self._state is W and self._resume.reader:
            # A reconnect after the last event of a finished stream: 204 is how
            # an EventSource is told to stop reconnecting.
            self._commit(204, (), streaming=False, now=now)
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=Trigger.FINISH)
        elif self._state is W:
            self._upstream_failure(UpstreamError("upstream closed the stream before any event",
                                                 ErrorCode.UPSTREAM_FAILED),
                                   EndReason.UPSTREAM_ERROR, now)
        elif not self._dialect.terminal_required and not truncated:
            self._end(EndReason.COMPLETE, None, abrupt=False, trigger=Trigger.FINISH)
        else:
            why = ("a truncated final event" if truncated
                   else f"no {self._dialect.terminal_name}")
            self._fail(UpstreamError(f"upstream ended the stream early ({why})",
                                     ErrorCode.UPSTREAM_FAILED), EndReason.UPSTREAM_ERROR, now)

    def _on_upstream_failed(self, event: UpstreamFailed, now: float) -> None:
        attempt = self._attempt
        attempt.open = False
        if self._state in _ENDED or attempt.retry_at is not None:
            return
        if attempt.late_error_body is not None:
            self._fail(attempt.late_error(), EndReason.UPSTREAM_ERROR, now)  # as much as came
            return
        error, reason, unprocessed = failure_error(event)
        self._upstream_failure(error, reason, now, unprocessed=unprocessed)

    # ------------------------------------------------------------ client and driver inputs

    def _on_paused(self, event: SocketPaused, now: float) -> None:
        self._client.pause()

    def _on_resumed(self, event: SocketResumed, now: float) -> None:
        self._client.resume(now)

    def _on_write_completed(self, event: WriteCompleted, now: float) -> None:
        self._client.completed_write(now)
        attempt = self._attempt
        if attempt.paused and not self._pending and self._state not in _ENDED:
            attempt.paused = False
            attempt.seen_at = now  # its silence while paused was ours
            self._actions.append(ResumeUpstream())

    def _on_client_gone(self, event: ClientGone, now: float) -> None:
        if self._hold.until is not None:
            return  # already held for a reconnect (e.g. the reset of a slow client we cut)
        self._client.left()
        self._pending.clear()
        if self._hold_for_resume(now, EndReason.CLIENT_GONE, ErrorCode.CANCELLED):
            return
        if self._departure_ends():
            # A complete answer the client did not get all of is still lost.
            self._end_reason = None
            self._end(EndReason.CLIENT_GONE, ErrorCode.CANCELLED, abrupt=True,
                      trigger=Trigger.ABORT)

    def _departure_ends(self) -> bool:
        """A departure now ends the response: not held for a reconnect, and
        not over already (a complete answer the client did not get all of is
        still lost)."""
        if self._hold.until is not None or self._may_hold():
            return False
        return self._state is StreamState.DONE or self._state not in _ENDED

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
        self._attempt.open = False
        if self._state not in _ENDED:
            self._fail(event.error, EndReason.REFUSED, now)

    def _on_replay_source(self, event: ReplaySource, now: float) -> None:
        if not self.config.resume:
            raise LocalProtocolError("ReplaySource needs config.resume")
        if self._state is not W or self._attempt.status is not None:
            raise LocalProtocolError("ReplaySource must come before the upstream's headers")
        self._resume.become_reader(event.stream_id, event.after_seq)
        # A replay arrives in batches, not because the reader is slow: merging
        # would renumber what the client asked for event by event. The store
        # can simply be read more slowly instead (block policy).
        self._pending.merge = False
        self._pending.drop = False

    def _on_reader_attached(self, event: ReaderAttached, now: float) -> None:
        self._hold.attach()

    def _on_tick(self, event: Tick, now: float) -> None:
        pass  # timers fire after every input; see _fire_timers


# Input type -> the method that handles it. The class's functions, not a
# stream's bound methods: a table of bound methods kept on the stream was a
# reference cycle (stream -> table -> method -> stream), so every finished
# stream's objects waited for the cyclic collector instead of being freed at once.
_HANDLERS: Final[dict[type, Callable[[WireStream, Any, float], None]]] = {
    UpstreamHeaders: WireStream._on_upstream_headers,
    UpstreamData: WireStream._on_upstream_data,
    UpstreamEvent: WireStream._on_upstream_event,
    UpstreamEnded: WireStream._on_upstream_ended,
    UpstreamFailed: WireStream._on_upstream_failed,
    SocketPaused: WireStream._on_paused,
    SocketResumed: WireStream._on_resumed,
    WriteCompleted: WireStream._on_write_completed,
    ClientGone: WireStream._on_client_gone,
    StopRequested: WireStream._on_stop,
    Rejected: WireStream._on_rejected,
    ReplaySource: WireStream._on_replay_source,
    ReaderAttached: WireStream._on_reader_attached,
    Tick: WireStream._on_tick,
}
