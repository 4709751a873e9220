"""The client's socket as the wire core sees it: can it take bytes now?

Theory of operation
-------------------
:class:`ClientSocket` is the downstream-writability part of the core. Its
phases (:class:`SocketPhase`, derived from its flags)::

    WRITABLE ──data_to_send()──▶ WRITING ──WriteCompleted──▶ WRITABLE
    WRITABLE │ WRITING ──SocketPaused──▶ PAUSED ──SocketResumed──▶ (back)
    (any) ──ClientGone, or cut off as a slow reader──▶ GONE

* WRITABLE: bytes may go out now; anything pending leaves in one write.
* WRITING: a write is outstanding (the driver has not reported
  ``WriteCompleted``); for the ASGI driver this *is* backpressure, since ASGI
  has no pause signal. PAUSED: the transport said ``pause_writing``.
  Meanwhile events wait in the ``PendingBuffer``, where they merge.
* GONE: the client left (or was cut off); nothing is written any more.

It keeps the times the core's client-side timers run from: ``last_write_at``
(heartbeats: downstream silence), ``last_progress_at`` (``write_deadline_s``:
a stalled reader) and ``pending_since`` (the ``coalesce_ms`` window).
"""

from __future__ import annotations

from enum import StrEnum

from .errors import LocalProtocolError


class SocketPhase(StrEnum):
    """The socket's phases; see the module docstring."""

    WRITABLE = "writable"
    WRITING = "writing"
    PAUSED = "paused"
    GONE = "gone"


class ClientSocket:
    """The client side's flags and times. See the module docstring."""

    __slots__ = ("gone", "last_progress_at", "last_write_at", "paused", "pending_since",
                 "write_in_flight")

    def __init__(self, now: float) -> None:
        self.paused = False
        self.write_in_flight = False
        self.gone = False
        self.last_write_at = now  # the last bytes handed out: heartbeats count from here
        self.last_progress_at = now  # the socket last took bytes (or resumed)
        self.pending_since: float | None = None  # the oldest byte waiting, for coalesce_ms

    @property
    def phase(self) -> SocketPhase:
        """Where the socket stands (for tests and diagnostics; the core reads the flags)."""
        if self.gone:
            return SocketPhase.GONE
        if self.paused:
            return SocketPhase.PAUSED
        return SocketPhase.WRITING if self.write_in_flight else SocketPhase.WRITABLE

    def started_write(self, now: float) -> None:
        """WRITABLE → WRITING: bytes were handed to the driver."""
        self.pending_since = None
        self.write_in_flight = True
        self.last_write_at = now
        self.last_progress_at = now

    def wrote_at_once(self, now: float) -> None:
        """Bytes were handed out and taken in the same call (``forward_read``)."""
        self.last_write_at = now
        self.last_progress_at = now

    def completed_write(self, now: float) -> None:
        """WRITING → WRITABLE."""
        if not self.write_in_flight:
            raise LocalProtocolError("WriteCompleted without a write in flight")
        self.write_in_flight = False
        self.last_progress_at = now

    def pause(self) -> None:
        self.paused = True

    def resume(self, now: float) -> None:
        if self.paused:
            self.paused = False
            self.last_progress_at = now

    def left(self) -> None:
        """→ GONE: whatever was waiting for it is forgotten by the caller."""
        self.gone = True
        self.pending_since = None

    def stalled(self, *, waiting: bool) -> bool:
        """The reader owes us progress, so ``write_deadline_s`` runs. A write the
        socket has not taken is data pending too: without it, a client that stops
        reading during the last write (or a silent spell) would hold the stream
        forever. ``waiting``: nothing was committed yet, so a pause holds nothing."""
        return not self.gone and (self.write_in_flight or (self.paused and not waiting))
