"""An HTTP/1.1 client connection's phases, their timers, and how it ends.

Theory of operation
-------------------
:class:`ConnectionPhases` is the half of the client connection
(``http1.ClientConnection``) that knows nothing of requests: which
:class:`Phase` it is in, the one timer that guards each phase
(``keepalive_timeout_s`` closes an idle connection silently;
``header_read_timeout_s`` and ``body_read_timeout_s`` answer 408), and its
three endings: a plain close, an abort (shutdown's last resort), and a
refusal. A refusal answers with a small JSON error and ``Connection: close``
and then closes lingeringly: half-close, drain what the client is still
sending, then close, so that the client reads the status instead of a reset.

The phase timer is one deadline and one loop timer
(``shared.driver.DeadlineTimer``): a phase that moves the deadline later (a
request's head read, then its body, then keep-alive) only writes it down,
and the loop timer, when it fires early, is set again for what is left; a
phase with no timer only forgets the deadline. So a request costs one loop
timer, not a ``call_later`` and a cancel a phase (about 3 k instructions
each, docs/perf/stream-cost.md).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

import h11
from tokenwire.middleware.shared.driver import DeadlineTimer

from ..context import SidecarContext
from ..exchange.loop import Exchange
from .connection import LINGER_S, BodyReservation, refusal
from .framing import request_line_end, request_line_problem
from .h11_layout import refusal_head
from .http1_faults import h11_fault


class Phase(enum.Enum):
    """Where a connection is between and within requests (see ``http1.py``)."""

    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    RESPONSE = "response"
    CLOSING = "closing"


class ConnectionPhases(asyncio.Protocol):
    """The phases, timers and endings of one client connection."""

    def __init__(self, context: SidecarContext) -> None:
        self._context = context
        self._config = context.config
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._phase = Phase.IDLE
        # The phase's deadline (None: none) and what runs at it (None: _on_timer;
        # not the bound method itself, which would be a reference cycle). See the
        # module docstring; connection_lost closes the timer (another cycle).
        self._timer = DeadlineTimer(self._loop, self._tick)
        self._timer_at: float | None = None
        self._timer_callback: Callable[[], object] | None = None
        self._reading_paused = False
        self._lost = False
        self._exchange: Exchange | None = None
        # What arrived since the current request head began, for _framing_problem.
        # One buffer, not a list of reads: a client sending a byte per packet
        # would otherwise cost an object per byte.
        self._head_received = bytearray()
        # The current head's request line was complete and found servable.
        self._line_checked = False
        # This request's body, counted in context.buffered_body_bytes.
        self._body_reserved = BodyReservation(context)

    @property
    def idle(self) -> bool:
        """Between requests, nothing of a new one received: safe to close on shutdown."""
        return self._phase is Phase.IDLE and self._exchange is None

    def close_if_idle(self) -> None:
        if self.idle:
            self._close()

    def abort(self) -> None:
        """Drop the connection at once (shutdown's last resort)."""
        if self._transport is not None:
            self._transport.abort()

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._lost and data:
            self._transport.write(data)

    def _close(self) -> None:
        self._phase = Phase.CLOSING
        self._cancel_timer()
        if self._transport is not None:
            self._transport.close()

    def _refuse_malformed(self, error: h11.RemoteProtocolError) -> None:
        # h11 hints 501 for a Transfer-Encoding it does not implement (RFC 9110
        # says SHOULD); here such a framing is a malformed or smuggling request,
        # the client's fault, which must not count as a server error (5xx is
        # what load balancers eject backends for and what clients retry).
        status = error.error_status_hint
        self._refuse(400 if status == 501 else status, h11_fault(error))

    def _request_line_refused(self) -> bool:
        """Refuse a request line h11 would wait on or accept wrongly, as soon as
        it is complete (see framing.py); True if refused."""
        received = self._head_received
        problem = request_line_problem(received)
        if problem is None:
            self._line_checked = request_line_end(received) != -1
            return False
        self._refuse(*problem)
        return True

    def _refuse(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        """Answer with an error status, nothing forwarded, then close lingeringly."""
        if self._phase is Phase.CLOSING or self._transport is None or self._lost:
            return
        self._release_body()
        headers, body = refusal(self._context, status, message, retry_after_s=retry_after_s)
        self._transport.write(refusal_head(status, headers) + body)
        self._phase = Phase.CLOSING
        transport = self._transport
        if self._reading_paused:
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._arm_timer(LINGER_S, transport.abort)
        else:
            # TLS cannot half-close; close_notify after the response is the best there is.
            transport.close()

    def _arm_timer(self, delay_s: float, callback: Callable[[], object] | None = None) -> None:
        at = self._timer_at = self._loop.time() + delay_s
        self._timer_callback = callback
        self._timer.arm(at)

    def _cancel_timer(self) -> None:
        self._timer_at = None  # the loop timer, if set, ticks once for nothing

    def _tick(self, now: float) -> None:
        at = self._timer_at
        if at is None:
            return
        if now < at:  # it was set for an earlier phase's deadline
            self._timer.arm(at)
            return
        self._timer_at = None
        callback = self._timer_callback
        if callback is None:
            self._on_timer()
        else:
            callback()

    def _on_timer(self) -> None:
        if self._phase is Phase.IDLE:
            self._close()
        elif self._phase in (Phase.HEAD, Phase.BODY):
            self._refuse(408, "the request was not received in time")

    def _release_body(self) -> None:
        self._body_reserved.release()
