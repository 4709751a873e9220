"""What the upstream's inputs do to a response: its head, its body, its end or failure.

Theory of operation
-------------------
:class:`UpstreamInputs` is the half of :class:`~tokenwire.middleware.core.stream.WireStream`
that takes the upstream side's inputs (``UpstreamHeaders``, ``UpstreamData``,
``UpstreamEvent``, ``UpstreamEnded``, ``UpstreamFailed``); the stream module
keeps the public API and the client side's inputs. A head decides what the
answer is (an event stream to commit, an error to retry or pass through, a
non-stream answer on a stream route); a read goes either the keeps-up way
(plain ``data:`` events that go out as they came: :meth:`UpstreamInputs._plain_count`,
the one test both ways in of a read share, the driver's one-call
``forward_read`` included) or through the parser, event by event, to the
dialect's rules (content, terminal, error, keep-alive); what was queued may
pause the upstream for a reader that is behind (``_after_queue``: the
``block`` policy, a replay, a passthrough); an end without the
dialect's terminal event is a truncation, and a failure is retried while
nothing went to the client.
"""

from __future__ import annotations

from typing import Final

from . import frames
from .attempt import RETRYABLE_STATUSES, failure_error, retry_after_s
from .chunks import plain_event_count
from .config import NonStreamAnswer
from .decisions import StreamDecisions
from .dialects.base import ERROR, FAILED, GENERIC, KEEPALIVE, TERMINAL, Dialect
from .dialects.routes import AUTO_MARKER, detect
from .errors import (
    NO_CLIENT_RETRY,
    ErrorCode,
    LocalProtocolError,
    SSEProtocolError,
    UpstreamError,
    UpstreamErrorEvent,
)
from .events import (
    PauseUpstream,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
)
from .headers import header_value, is_compressed, is_event_stream, passthrough_headers
from .lifecycle import ENDED as _ENDED
from .lifecycle import StreamState, Trigger
from .record import EndReason
from .sse import SSEEvent

# Final: compiled, a final module name is a C static, not a lookup in the module's dict.
W: Final = StreamState.WAITING
C: Final = StreamState.COMMITTED
S: Final = StreamState.STREAMING


class UpstreamInputs(StreamDecisions):
    """The upstream side's input handlers of a :class:`WireStream` (see the module docstring)."""

    def _plain_count(self, data: bytes) -> int:
        """How many plain ``data:`` events the read ``data`` is, where the
        keeps-up shortcut applies to it (streaming, the dialect's fast path,
        nothing pending, the client's socket free, the parser between events);
        0: it goes through the parser. Both ways in of an upstream read ask it
        (``_on_upstream_data`` and :meth:`forward_read`)."""
        client = self._client
        if (self._state is not S or not self._fast_path or self._pending or client.paused
                or client.write_in_flight or not self._attempt.parser.at_boundary):
            return 0
        return plain_event_count(data, self._plain_limit_bytes, self._marker)

    def _took_plain(self, data: bytes, count: int, now: float) -> None:
        """What a read of ``count`` plain events changes, whichever way it came in."""
        self._attempt.seen_at = now
        acct = self._acct
        acct.idle_keepalives = 0
        acct.events_in += count
        # Plain chunks count one piece each (a scan for the text here would cost a
        # third of this path; a finish chunk that came this way counts one too).
        acct.tokens_in += count
        meter = acct.meter
        if meter.awaiting_token:
            meter.queued(data)


    # ------------------------------------------------------------ upstream inputs

    def _after_queue(self, now: float) -> None:
        """Bookkeeping after content was queued: window, cap, block policy."""
        pending = self._pending.pending_bytes
        client = self._client
        if client.pending_since is None and pending:
            client.pending_since = now
        if self._enforce_cap(now):
            return
        attempt = self._attempt
        if ((client.paused or client.write_in_flight) and not attempt.paused
                and pending >= self._pause_at_bytes
                and (attempt.passthrough or self._resume.reader or self._block_policy)):
            attempt.paused = True
            self._acct.upstream_paused(now)
            self._actions.append(PauseUpstream())

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
        if event.status in RETRYABLE_STATUSES and self._retry_answer(event, now):
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
        count = self._plain_count(event.data)
        if count:
            # The client keeps up and these are ordinary text chunks: they go
            # out as they came, with nothing to merge them with, so parsing and
            # re-encoding them would only cost time.
            self._took_plain(event.data, count, now)
            self._pending.add_bytes(self._resume.number_plain(event.data) if self.config.resume
                                    else event.data, count)
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
            if self._state is W and dialect.first_error_is_status and not self._resume.reader:
                # An error as the first event is the engine refusing this request
                # (a bad prompt, too many tokens): the response is that error, with
                # the status it carries, and another attempt would only be refused
                # again, so it is never retried. Not for a resume reader: its first
                # event is the stream's end (a cancel, a failure) after events the
                # client already has, which an EventSource can read only in-band.
                self._fail(UpstreamErrorEvent(payload), EndReason.UPSTREAM_ERROR, now)
                return
            if self._state is W:
                self._commit_sse(now)
            if self._end_reason is None:
                self._error = UpstreamErrorEvent(payload if "error" in payload else {"error": payload})
            self._queue_done(EndReason.UPSTREAM_ERROR, now)
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
            if kind == TERMINAL and frames.SUMMARY in self._frames:
                acct.meter.terminal_queued()  # no token: off the count its write adds
                summary = frames.summary_event(self.record(now), acct.meter.first_token_at, now)
                self._queue_event(summary, droppable=False, numbered=False)
            self._queue_done(EndReason.COMPLETE if kind == TERMINAL else EndReason.UPSTREAM_ERROR, now)
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

    def _retry_answer(self, event: UpstreamHeaders, now: float) -> bool:
        """Retry a 502/503/504 if allowed, not sooner than its ``Retry-After``;
        one asking for longer than ``retry_after_max_s`` is the client's to wait."""
        limit_s = self.config.retry_after_max_s
        wait_s = retry_after_s(event.headers) if limit_s > 0 else None
        if wait_s is not None and wait_s > limit_s:
            return False
        return self._schedule_retry(now, EndReason.UPSTREAM_ERROR, unprocessed=event.status == 503,
                                    at_least_s=wait_s or 0.0)

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
