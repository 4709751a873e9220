"""The upstream attempt: one request to one upstream, and the backoff between them.

Theory of operation
-------------------
A response may take several *attempts* (retries before the first downstream
byte); :class:`UpstreamAttempt` is the wire core's view of the current one.
Its phases (:class:`AttemptPhase`, derived from its fields)::

    CONNECTING ──headers──▶ EVENT_STREAM │ PASSTHROUGH │ LATE_ERROR
        │                        │               │            │
        └───── failure while the lifecycle is WAITING and a retry is allowed ─────▶ BACKOFF
    BACKOFF ──retry_at──▶ CONNECTING (the next upstream in turn; a fresh parser)
    (any) ──ended, failed, or aborted by the core──▶ CLOSED

* CONNECTING: the request is out, no status line yet; ``headers_deadline_at``
  (``upstream_headers_timeout_s``) runs.
* EVENT_STREAM: a 2xx ``text/event-stream``; its body goes through ``parser``.
* PASSTHROUGH: any other answer before the commit (JSON, an error status with
  its own body): forwarded unchanged.
* LATE_ERROR: an error status that came after the commit (the commit
  deadline passed first); up to ``LATE_ERROR_BODY_BYTES`` of its body are
  kept, to tell the client in-band what the engine said (:meth:`late_error`).
* BACKOFF: waiting ``retry_at`` (exponential, ``retry_backoff_s`` doubling up
  to ``retry_backoff_max_s``) before the next attempt.
* CLOSED: the connection is done; nothing more is read from it.

``paused`` (the ``block`` policy asked the driver to stop reading) is a flag
beside the phase, and ``seen_at`` (the upstream's last event of content or
state: comments and keepalive events do not count) times
``upstream_idle_timeout_s``. *Whether* to retry is the stream's decision (it
depends on the lifecycle and the budget); this part keeps the mechanics.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from .chunks import error_object
from .config import WireConfig
from .errors import (
    ErrorCode,
    LocalProtocolError,
    SSEProtocolError,
    UpstreamError,
    UpstreamErrorEvent,
    WireError,
    upstream_timeout,
)
from .events import FailureKind, Headers, RetryUpstream, UpstreamFailed
from .headers import header_value
from .record import EndReason
from .sse import SSEParser

RETRYABLE_STATUSES: Final = frozenset({502, 503, 504})


def retry_after_s(headers: Headers) -> float | None:
    """An answer's ``Retry-After`` in seconds, when it gives delta-seconds (RFC
    9110 10.2.3). The HTTP-date form is not read: the core's clock is the
    loop's, not the wall's; a retry then waits its usual backoff."""
    value = header_value(headers, b"retry-after")
    if value is None:
        return None
    text = value.strip()
    # Ten digits are three centuries: anything longer is garbage, not a wait.
    return float(int(text)) if text.isdigit() and len(text) <= 10 else None

LATE_ERROR_BODY_BYTES: Final = 16 * 1024
"""How much of an error answer that arrives after the commit is read for its message."""


class AttemptPhase(StrEnum):
    """The attempt's phases; see the module docstring."""

    CONNECTING = "connecting"
    EVENT_STREAM = "event_stream"
    PASSTHROUGH = "passthrough"
    LATE_ERROR = "late_error"
    BACKOFF = "backoff"
    CLOSED = "closed"


class UpstreamAttempt:
    """The current upstream attempt of one response. See the module docstring."""

    __slots__ = ("_config", "headers_deadline_at", "held_headers", "late_error_body",
                 "late_error_status", "number", "open", "parser", "passthrough", "paused",
                 "retry_at", "seen_at", "status")

    def __init__(self, config: WireConfig, now: float) -> None:
        self._config = config
        self.number = 0  # 0 for the first attempt, n for the n-th retry
        self.retry_at: float | None = None
        self.headers_deadline_at: float | None = now + config.upstream_headers_timeout_s
        self.status: int | None = None
        self.held_headers: Headers = ()  # an event stream's headers, until the commit
        self.open = True
        self.paused = False
        self.seen_at = now
        self.passthrough = False
        self.late_error_body: bytearray | None = None
        self.late_error_status = 0
        self.parser = self.new_parser()

    @property
    def phase(self) -> AttemptPhase:
        """Where the attempt stands (for tests and diagnostics; the core reads the fields)."""
        if self.retry_at is not None:
            return AttemptPhase.BACKOFF
        if not self.open:
            return AttemptPhase.CLOSED
        if self.status is None:
            return AttemptPhase.CONNECTING
        if self.late_error_body is not None:
            return AttemptPhase.LATE_ERROR
        return AttemptPhase.PASSTHROUGH if self.passthrough else AttemptPhase.EVENT_STREAM

    def new_parser(self) -> SSEParser:
        return SSEParser(max_line_bytes=self._config.max_line_bytes,
                         max_event_bytes=self._config.max_event_bytes)

    def answered(self, status: int, now: float) -> None:
        """The status line came: CONNECTING is over."""
        if self.status is not None or self.retry_at is not None:
            raise LocalProtocolError("UpstreamHeaders twice for one upstream attempt")
        self.status = status
        self.headers_deadline_at = None
        self.seen_at = now

    def start_late_error(self, status: int) -> None:
        """An error status after the commit: keep its body for :meth:`late_error`."""
        self.late_error_body = bytearray()
        self.late_error_status = status

    def read_late_error(self, data: bytes) -> None:
        late = self.late_error_body
        if late is not None:
            late += data[:max(LATE_ERROR_BODY_BYTES - len(late), 0)]

    def late_error(self) -> WireError:
        """The error a late error status stands for: the engine's error object
        forwarded as it came if the body is one, else the status and the start
        of the body in words."""
        body = bytes(self.late_error_body or b"")
        self.late_error_body = None
        if body[:1] == b"{":
            payload = error_object(body.decode("utf-8", "replace"))
            if payload is not None:
                return UpstreamErrorEvent(payload)
        text = " ".join(body.decode("utf-8", "replace").split())[:200]
        message = f"upstream answered {self.late_error_status}" + (f": {text}" if text else "")
        return UpstreamError(message, ErrorCode.UPSTREAM_FAILED)

    def backoff(self, now: float, at_least_s: float = 0.0) -> bool:
        """Into BACKOFF before the next attempt, for the doubling backoff or
        ``at_least_s`` (the upstream's ``Retry-After``), whichever is longer;
        True if this attempt's connection was still open (the caller aborts it:
        it must never be read again or reused)."""
        was_open = self.open
        self.open = False
        self.number += 1
        config = self._config
        delay_s = max(min(config.retry_backoff_s * 2 ** (self.number - 1), config.retry_backoff_max_s),
                      at_least_s)
        self.retry_at = now + delay_s
        self.parser = self.new_parser()
        self.status = None
        self.held_headers = ()
        self.headers_deadline_at = None
        return was_open

    def start_retry(self, now: float) -> RetryUpstream:
        """BACKOFF → CONNECTING (the caller saw ``retry_at`` pass): the action that starts it."""
        self.retry_at = None
        self.open = True
        self.headers_deadline_at = now + self._config.upstream_headers_timeout_s
        return RetryUpstream(self.number)

    def stop_timers(self) -> None:
        """The response ended: no retry, no headers deadline."""
        self.retry_at = None
        self.headers_deadline_at = None

    def idle_watched(self, *, replaying: bool) -> bool:
        """The upstream answered and owes us bytes: its silence is timed. Not
        while the core paused it (block policy), and not for a replay, whose
        source is the store, not an upstream. (The caller checks the lifecycle.)"""
        return (self._config.upstream_idle_timeout_s > 0 and self.status is not None
                and self.open and not self.paused and self.retry_at is None and not replaying)


def failure_error(event: UpstreamFailed) -> tuple[WireError, EndReason, bool]:
    """What a driver-reported failure means: (error, end reason, unprocessed).

    ``unprocessed``: no connection was made, so nothing of the request reached
    an upstream (a request that may not repeat may still be retried)."""
    kind = event.kind
    if kind is FailureKind.CONNECT:
        return (UpstreamError(f"upstream unavailable: {event.message}",
                              ErrorCode.UPSTREAM_UNAVAILABLE, retry_after_s=1),
                EndReason.UPSTREAM_ERROR, True)
    if kind is FailureKind.TIMEOUT:
        return upstream_timeout(f"upstream timed out: {event.message}"), EndReason.UPSTREAM_TIMEOUT, False
    if kind is FailureKind.INVALID_STREAM:
        return SSEProtocolError(event.message), EndReason.UPSTREAM_ERROR, False
    return (UpstreamError(f"upstream failed: {event.message}", ErrorCode.UPSTREAM_FAILED),
            EndReason.UPSTREAM_ERROR, False)
