"""The wire core's decisions: what an input or a timer may make the core do.

Theory of operation
-------------------
:class:`StreamDecisions` is the half of :class:`~tokenwire.middleware.core.stream.WireStream`
that acts; ``stream.py`` adds what each input means and the public API. It
owns the parts the stream composes (``attempt.py``, ``client_socket.py``,
``recording.py``, ``accounting.py``, the ``PendingBuffer``) and the lifecycle
(``lifecycle.py``), and decides, from their states:

* when the headers go out (``_commit``, ``_commit_sse``: the first event or
  ``commit_deadline_s``);
* whether a failed upstream attempt is retried (``_schedule_retry``: only
  while WAITING, attempts and budget left, not a replay, and the request may
  reach an upstream twice or provably did not), else how the failure reaches
  the client (``_fail``: a real status before the first byte, in-band after);
* how a response ends (``_end``: the end reason, the abort of the upstream,
  and whether the engine is told — never for a replay, which generates
  nothing, nor for a retry's dropped attempt);
* when a reader is too slow (``_enforce_cap``, ``_slow_client``; when the
  upstream is paused for one is ``upstream_inputs.py``'s ``_after_queue``);
* whether a departed client's stream is held for a reconnect (``_hold_for_resume``;
  a drain's hand-off holds one the same way: ``stream.py``, ``HandOff``);
* which timers are due (``_fire_timers``: duration, upstream idle, retry
  backoff, upstream headers, commit, write deadline, heartbeat, resume hold,
  whose end for a hand-off is the drain's in-band ``shutdown``).
"""

from __future__ import annotations

from typing import Final

from . import frames
from .accounting import Accounting
from .attempt import UpstreamAttempt
from .client_socket import ClientSocket
from .config import SlowClientPolicy, WireConfig
from .dialects.base import Dialect
from .dialects.chat import DONE, ChatDialect
from .dialects.routes import AUTO_MARKER
from .errors import NO_CLIENT_RETRY, ErrorCode, WireError, shutting_down, upstream_timeout
from .events import (
    AbortUpstream,
    Action,
    CloseClient,
    CommitHeaders,
    Finished,
    ReplayAppend,
)
from .headers import STREAM_ID_HEADER, sse_response_headers
from .lifecycle import ENDED, StreamState, Trigger, next_state
from .pending import PendingBuffer
from .record import EndReason, StreamRecord
from .recording import ResumeHold, ResumeRecorder
from .retry import RetryBudget
from .sse import SSEEvent

HEARTBEAT: Final = b": keepalive\n"
"""A comment line alone: no blank line, so no decoder can dispatch it as an event
(see ``recording.py``)."""

_NEVER: Final = float("inf")  # next_deadline's "no timer yet"
_LIVE: Final = (StreamState.COMMITTED, StreamState.STREAMING)  # heartbeats run; a departed client may be held


class StreamDecisions:
    """The parts of one response and the decisions over them; see the module docstring."""

    def __init__(
        self,
        config: WireConfig,
        *,
        now: float,
        request_id: str,
        upstream: str = "",
        retry_budget: RetryBudget | None = None,
        expect_stream: bool = True,
        stream_id: str | None = None,
        may_repeat: bool = True,
        dialect: Dialect | None = None,
        hide_usage_chunk: bool = False,
        frames: frozenset[str] = frozenset(),
    ) -> None:
        """``upstream``: what the record names as the stream's source (the ASGI
        driver's ``app``; the sidecar names each attempt's pod itself, through
        ``Finished.record_as``). ``expect_stream``: the request asked for a stream, so the commit
        deadline runs from now; otherwise it starts only if the upstream
        answers with an event stream (a plain JSON answer is passed through).
        ``stream_id``: the resume id of this response, required with ``config.resume``.
        ``may_repeat``: the request may reach an upstream twice
        (:func:`~tokenwire.middleware.core.retry.may_repeat`); if not, it is retried
        only after a failure that proves no upstream processed it.
        ``dialect``: the rules of the API the stream speaks, from its route
        (:class:`~tokenwire.middleware.core.dialects.DialectTable`); None (a caller
        that names no route) is Chat Completions. ``hide_usage_chunk``: the driver
        asked the engine for usage the client did not ask for
        (:meth:`~tokenwire.middleware.core.dialects.Dialect.ask_usage`): the usage-only
        chunk is read into the record and not forwarded, so the client sees what it
        would have seen directly. ``frames``: tokenwire's own events the client
        asked for (``frames.py``: ``open``, ``done``, ``summary``)."""
        if config.resume and not stream_id:
            raise ValueError("config.resume needs a stream_id")
        self.config = config
        self.request_id = request_id
        self._budget = retry_budget
        self._may_repeat = may_repeat
        if retry_budget is not None:
            retry_budget.on_request(now)
        self._state = StreamState.WAITING
        self._actions: list[Action] = []
        # The parts.
        self._upstream = upstream
        self._attempt = UpstreamAttempt(config, now)
        self._client = ClientSocket(now)
        self._resume = ResumeRecorder(config, stream_id or "", self._emit)
        self._hold = ResumeHold()
        if dialect is None:
            marker = config.terminal_marker
            dialect = ChatDialect(DONE if marker == AUTO_MARKER else marker)
        self._dialect = dialect = dialect.for_stream()
        self._dialect_confirmed = False
        self._acct = Accounting(now, dialect)
        policy = config.slow_client_policy
        # Answer text merges under coalesce and drop (``drop`` only ever replaces
        # events of the listed state types, never answer content); ``block``
        # keeps every event as it came and makes the producer wait instead.
        self._block_policy = block = policy is SlowClientPolicy.BLOCK
        drop = policy is SlowClientPolicy.DROP
        self._pending = PendingBuffer(merge=dialect.merges and not block, drop=drop,
                                      droppable_types=frozenset(config.droppable_event_types),
                                      volatile=frozenset(config.volatile_chunk_fields), dialect=dialect)
        # Config read on every input, looked up once (native floats here; the
        # config is an interpreted object, each read a generic attribute lookup).
        self._write_deadline_s = config.write_deadline_s
        self._heartbeat_s = config.heartbeat_s
        self._coalesce_s = config.coalesce_ms / 1000.0
        self._idle_timeout_s = config.upstream_idle_timeout_s
        self._max_duration_s = config.max_stream_duration_s
        self._plain_limit_bytes = min(config.max_line_bytes, config.max_event_bytes)
        self._marker = dialect.marker
        self._fast_path = dialect.fast_path
        self._max_pending_bytes = config.max_pending_bytes
        # Pending bytes at which the upstream stops being read (block; a replay, a passthrough).
        self._pause_at_bytes = min(config.block_window_bytes if block else 1 << 62,
                                   config.max_pending_bytes // 2)
        self._one_call_path = not config.resume and not config.coalesce_ms and self._fast_path
        # next_deadline() as of the last input (inf: none), None once an input
        # may have changed it: the one-call path's timer check (forward_read).
        self._deadline_bound: float | None = None
        # The response as a whole.
        self._commit_at: float | None = now + config.commit_deadline_s if expect_stream else None
        self._expect_stream = expect_stream
        self._hide_usage_chunk = hide_usage_chunk
        self._frames = frames
        self._passthrough_reason = EndReason.COMPLETE  # a passed-through answer's, at its end
        self._finished = False
        self._close_abrupt = False
        self._status = 0
        self._end_reason: EndReason | None = None
        self._error_code: ErrorCode | None = None
        self._error: WireError | None = None

    def record(self, now: float, upstream: str | None = None) -> StreamRecord:
        """The accounting record as of ``now`` (final once ``finished``);
        ``upstream`` names the pod in place of the one the stream was made with."""
        return self._acct.record(
            now, request_id=self.request_id,
            upstream=self._upstream if upstream is None else upstream, status=self._status,
            end_reason=self._end_reason or EndReason.COMPLETE, error_code=self._error_code,
            coalesced_events=self._pending.coalesced_events,
            dropped_events=self._pending.dropped_events, stream_id=self._resume.resume_id or None,
            dialect=self._dialect.name)

    # The accounting counters, read-only (they are the Accounting part's: a
    # property without a setter refuses an assignment). Plain properties, not a
    # descriptor: mypyc ignores a descriptor set in the body of a compiled class.
    @property
    def started_at(self) -> float:
        return self._acct.started_at

    @property
    def events_in(self) -> int:
        return self._acct.events_in

    @property
    def events_out(self) -> int:
        return self._acct.events_out

    @property
    def bytes_out(self) -> int:
        return self._acct.bytes_out

    @property
    def heartbeats(self) -> int:
        return self._acct.heartbeats

    @property
    def retries(self) -> int:
        return self._acct.retries

    @property
    def refused_retries(self) -> int:
        return self._acct.refused_retries

    @property
    def upstream_comments(self) -> int:
        return self._acct.upstream_comments

    @property
    def pending_high_water_bytes(self) -> int:
        return self._acct.pending_high_water_bytes

    def _transition(self, trigger: Trigger) -> None:
        self._state = next_state(self._state, trigger)

    def _emit(self, action: ReplayAppend) -> None:
        self._actions.append(action)

    # ------------------------------------------------------------ timers

    def _stalled(self) -> bool:
        return self._client.stalled(waiting=self._state is StreamState.WAITING)

    def _heartbeat_eligible(self) -> bool:
        client = self._client
        return (self._heartbeat_s > 0 and not self._attempt.passthrough and not client.gone
                and self._state in _LIVE and not self._pending and not client.write_in_flight
                and not client.paused)

    def _idle_watched(self) -> bool:
        return self._attempt.idle_watched(replaying=self._resume.reader) and self._state not in ENDED

    def next_deadline(self) -> float | None:
        """When the driver should next ``handle(Tick(), now)``; None = no timer."""
        if self._finished:
            return None
        attempt = self._attempt
        client = self._client
        # The earliest of the running timers, kept as one float (no list of
        # candidates, no min() call: this runs a few times a stream).
        at = _NEVER
        retry_at = attempt.retry_at
        if retry_at is not None:
            at = retry_at
        elif attempt.headers_deadline_at is not None:
            at = attempt.headers_deadline_at
        commit_at = self._commit_at
        if commit_at is not None and self._state is StreamState.WAITING and retry_at is None:
            at = min(at, commit_at)
        if self._stalled():
            at = min(at, client.last_progress_at + self._write_deadline_s)
        elif self._heartbeat_eligible():
            at = min(at, client.last_write_at + self._heartbeat_s)
        if self._coalesce_s and client.pending_since is not None:
            at = min(at, client.pending_since + self._coalesce_s)
        hold_until = self._hold.until
        if hold_until is not None:
            at = min(at, hold_until)
        if self._idle_watched():
            at = min(at, attempt.seen_at + self._idle_timeout_s)
        if self._max_duration_s and self._state not in ENDED:
            at = min(at, self._acct.started_at + self._max_duration_s)
        return None if at == _NEVER else at

    def _fire_timers(self, now: float) -> None:
        if self._finished:
            return
        attempt = self._attempt
        # Time first, as below: the cheap test, false on almost every input.
        limit_s = self._max_duration_s
        if limit_s and now >= self._acct.started_at + limit_s and self._state not in ENDED:
            attempt.retry_at = None
            self._fail(upstream_timeout(f"the stream ran for its limit of {limit_s:g} s"),
                       EndReason.UPSTREAM_TIMEOUT, now)
        idle_s = self._idle_timeout_s
        if idle_s and now >= attempt.seen_at + idle_s and self._idle_watched():
            # A hung engine: heartbeats would otherwise hide it from the client forever.
            # Keepalives (comments, Anthropic's pings) are not content: an engine
            # stuck in a loop that sends only those has hung all the same.
            kept = self._acct.idle_keepalives
            why = f" ({kept} keepalives only)" if kept else ""
            self._upstream_failure(upstream_timeout(f"no content from upstream for {idle_s:g} s{why}"),
                                   EndReason.UPSTREAM_TIMEOUT, now)
        if attempt.retry_at is not None and now >= attempt.retry_at:
            self._actions.append(attempt.start_retry(now))
        if (attempt.headers_deadline_at is not None and now >= attempt.headers_deadline_at
                and self._state not in ENDED):
            attempt.headers_deadline_at = None
            # The attempt is still open (the engine may be working on it): the
            # retry or the end below aborts it, saying which.
            self._upstream_failure(upstream_timeout(
                f"no response from upstream within {self.config.upstream_headers_timeout_s:g} s"),
                EndReason.UPSTREAM_TIMEOUT, now)
        if (self._commit_at is not None and now >= self._commit_at and attempt.retry_at is None
                and self._state is StreamState.WAITING):
            self._commit_sse(now)
        client = self._client
        # Time first: it is the cheap test, and the two conditions exclude each other.
        if now >= client.last_progress_at + self._write_deadline_s and self._stalled():
            self._slow_client(ErrorCode.SEND_TIMEOUT, now)
        elif now >= client.last_write_at + self._heartbeat_s and self._heartbeat_eligible():
            self._pending.add_bytes(HEARTBEAT)
            self._acct.heartbeats += 1
        hold = self._hold
        if hold.until is not None and now >= hold.until:
            # Nobody came back for it: what the grace delayed happens now. A
            # hand-off's end is the drain's: readers elsewhere get it in-band.
            if hold.reason is EndReason.SHUTDOWN:
                self._fail(shutting_down(), EndReason.SHUTDOWN, now)
            else:
                self._end(hold.reason, hold.code, abrupt=True, trigger=Trigger.ABORT)

    # ------------------------------------------------------------ decisions

    def _commit(self, status: int, headers: tuple[tuple[bytes, bytes], ...], *,
                streaming: bool, now: float) -> None:
        self._transition(Trigger.COMMIT)
        self._status = status
        self._commit_at = None
        self._client.last_write_at = now
        self._actions.append(CommitHeaders(status, headers, streaming))

    def _commit_sse(self, now: float) -> None:
        headers = sse_response_headers(self._attempt.held_headers)
        if self.config.resume:
            headers = (*headers, (STREAM_ID_HEADER, self._resume.resume_id.encode()))
        self._commit(200, headers, streaming=True, now=now)
        # On the first numbered event, so an EventSource knows how soon to come back.
        self._resume.sse_committed()
        if frames.OPEN in self._frames:
            resume = self._resume
            self._queue_event(frames.open_event(resume.resume_id or None, resume.reader, resume.start_seq,
                                                self.config), droppable=False, numbered=False)

    def _queue_done(self, reason: EndReason, now: float) -> None:
        """``event: tokenwire.done`` before the last event, for a client that asked."""
        if frames.DONE in self._frames:
            self._acct.meter.terminal_queued()  # no token: off the count its write adds
            self._queue_event(frames.done_event(self.record(now), delivered_from=self._resume.start_seq,
                                                reason=reason), droppable=False, numbered=False)

    def _schedule_retry(self, now: float, reason: EndReason, *, unprocessed: bool = False,
                        at_least_s: float = 0.0) -> bool:
        """Arrange a retry if allowed, not before ``at_least_s`` (``Retry-After``); True if one is coming.

        ``unprocessed``: the failure proves the upstream did not process the
        request (no connection was made; it answered 503). Otherwise the
        upstream may have read it, and a request that may not be repeated
        (a POST without ``Idempotency-Key``: one more generation) is not sent
        again; nginx's rule for non-idempotent requests.

        The failed attempt's connection is aborted here if it is still open (a
        502 body, an error event): it must never be read again or reused."""
        attempt = self._attempt
        if (self._state is not StreamState.WAITING or attempt.number >= self.config.retry_attempts
                or self._resume.reader or not (self._may_repeat or unprocessed)):
            return False
        if self._budget is not None and not self._budget.try_acquire(now):
            self._acct.refused_retries += 1
            return False
        if attempt.backoff(now, at_least_s):
            self._actions.append(AbortUpstream(reason, final=False))
        self._acct.retries += 1
        return True

    def _upstream_failure(self, error: WireError, reason: EndReason, now: float, *,
                          unprocessed: bool = False) -> None:
        """The upstream failed: retry while WAITING if allowed, else fail."""
        if self._schedule_retry(now, reason, unprocessed=unprocessed):
            return
        self._fail(error, reason, now)

    def _fail(self, error: WireError, reason: EndReason, now: float) -> None:
        """End the response with ``error``: a real status before the first byte,
        in-band after it, a bare abrupt close for a passthrough body."""
        if self._end_reason is None:
            self._error = error
        if self._state is StreamState.WAITING:
            body = error.body()
            headers = (*error.response_headers(), (b"content-length", str(len(body)).encode()))
            if self._acct.retries and NO_CLIENT_RETRY not in headers:
                # We already retried: a client's retries on top would multiply the load.
                headers = (*headers, NO_CLIENT_RETRY)
            self._commit(error.http_status, headers, streaming=False, now=now)
            self._pending.add_bytes(body)
            self._end(reason, error.code, abrupt=False, trigger=Trigger.ABORT)
        elif self._attempt.passthrough:
            self._end(reason, error.code, abrupt=True, trigger=Trigger.ABORT)
        else:
            # A reader's own ending (shutdown, cancel, the store lost the rest)
            # is not an event of the stream: numbering it would shadow the
            # stored event of that number on the next reconnect.
            self._queue_done(reason, now)
            self._acct.meter.terminal_queued()
            self._queue_event(self._dialect.own_error_event(error, self._pending.coalesced_events),
                              droppable=False, numbered=not self._resume.reader)
            self._end(reason, error.code, abrupt=True, trigger=Trigger.ABORT)
            self._enforce_cap(now)

    def _end(self, reason: EndReason, code: ErrorCode | None, *, abrupt: bool,
             trigger: Trigger, delivery_cut: bool = False) -> None:
        """End for ``reason``. Precedence: the first ending recorded stands (the
        root cause), but a ``delivery_cut`` (the client left, or could not keep
        up) replaces a clean end the client had not all taken: it was lost."""
        supersedes = delivery_cut and self._state is StreamState.DONE
        self._transition(trigger)
        resume = self._resume
        if resume.recording and resume.end is None:
            resume.record_end(reason)
        if self._end_reason is None or supersedes:
            # The record says a complete answer went to a resuming reader, not to its
            # client; or, held with nobody come back yet, to neither.
            recorded = reason
            if reason is EndReason.COMPLETE and self._hold.reader_attached:
                recorded = EndReason.DETACHED
            elif reason is EndReason.COMPLETE and self._hold.until is not None:
                recorded = EndReason.DEPARTED
            self._end_reason = recorded
            self._error_code = code
        self._close_abrupt = abrupt
        self._commit_at = None
        attempt = self._attempt
        attempt.stop_timers()
        self._hold.release()
        if attempt.open and reason is not EndReason.COMPLETE:
            attempt.open = False
            # A reader's upstream is the replay store: it generates nothing, so
            # there is no generation to tell the engine to stop.
            self._actions.append(AbortUpstream(reason, final=not resume.reader))

    def _slow_client(self, code: ErrorCode, now: float) -> None:
        self._pending.clear()
        self._client.pending_since = None
        if self._hold_for_resume(now, EndReason.SLOW_CLIENT, code):
            self._actions.append(CloseClient(abrupt=True, reset=True))
            return
        if self._state is not StreamState.ABORTED:
            # A response already ending with an error keeps that root cause.
            self._end(EndReason.SLOW_CLIENT, code, abrupt=True, trigger=Trigger.ABORT, delivery_cut=True)
        self._actions.append(CloseClient(abrupt=True, reset=True))
        self._client.gone = True

    def _enforce_cap(self, now: float) -> bool:
        """Track the high-water mark and hold the cap, for terminal events too
        (``[DONE]``, an error event): a client that cannot take them is as gone
        as one that cannot take text. True if the client was cut off."""
        pending = self._pending.pending_bytes
        acct = self._acct
        if pending > acct.pending_high_water_bytes:
            acct.pending_high_water_bytes = pending
        if pending > self._max_pending_bytes:
            self._slow_client(ErrorCode.BACKPRESSURE_EXCEEDED, now)
            return True
        return False

    def _maybe_finish(self, now: float) -> None:
        if self._finished or self._state not in ENDED:
            return
        client = self._client
        if not client.gone and (self._pending or client.write_in_flight):
            return
        self._finished = True
        self._resume.detach()  # nothing is recorded past the end
        if not client.gone:
            self._actions.append(CloseClient(abrupt=self._close_abrupt))
        # Built when the driver reads it: after it acted on what precedes it
        # (a departed client's upstream is closed first).
        self._actions.append(Finished(build=self.record, at=now))

    def _queue_event(self, event: SSEEvent, *, droppable: bool = True, numbered: bool = True,
                     upstream: bool = False) -> None:
        """Queue one event for the client: numbered and recorded under resume.
        ``upstream``: the event is the upstream's, whose own numbering (a
        Responses ``sequence_number``) the client gets renumbered once events
        before it merged; the replay store keeps the upstream's."""
        if numbered and self.config.resume:
            event = self._resume.number(event)
        if not self._client.gone:
            dialect = self._dialect
            if upstream and dialect.renumbers:
                event = dialect.renumber(event, self._pending.coalesced_events)
            self._pending.add_event(event, droppable=droppable)

    def _hold_for_resume(self, now: float, reason: EndReason, code: ErrorCode) -> bool:
        """On a client's departure: keep the response for a reconnect if the
        grace allows; True if it is now held (not ended). ``reason``/``code``
        are what it ends with if nobody comes back."""
        if not self._may_hold():
            return False
        self._client.gone = True
        self._actions.append(self._hold.hold(self._resume.resume_id, now, self.config.resume_grace_s,
                                             reason, code))
        return True

    def _may_hold(self) -> bool:
        """A departure now would be held for a reconnect (resume on, a grace,
        not held already, the response still live)."""
        return (self._resume.recording and self.config.resume_grace_s > 0
                and self._hold.until is None and self._state in _LIVE)
