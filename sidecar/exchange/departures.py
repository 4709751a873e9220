"""The bookkeeping of departed clients, run once their burst is over.

When a client leaves, its exchange closes the upstream socket at once and
hands the rest (the stream's record, metrics, log line, the pod's release,
the attempt task's cancellation) to :class:`Departures`. Many clients often
leave together (a load balancer drops its connections, a front end crashes),
and their resets reach the sidecar over a few milliseconds, not at once (the
process that closes them does so one by one). Every reset read before a
bookkeeping slice must be cut before that slice runs, so:

* The bookkeeping waits until the loop has gone :data:`PAUSE_S` without a new
  departure. With nothing else to do the loop sleeps meanwhile, and the
  processes the cuts woke get the CPU: a sidecar often shares its node's
  cores with the upstream it fronts (the engine's own API server), and 50
  departures' bookkeeping keeps a core busy for several milliseconds.
* It then runs in the order the clients left, in slices of at most
  :data:`SLICE_S` of loop time, each after another quiet :data:`PAUSE_S`.
* Each look is scheduled behind every callback the loop's last poll queued.
  A loop runs, on each turn, the callbacks queued before it (the timers
  first), then polls its sockets; a reset read in a poll reaches its
  connection's ``connection_lost`` (where the cut happens) by a callback
  queued then. A look queued from a timer or from the previous slice would
  otherwise run ahead of those cuts, and a reset read during a slice would
  wait for the next slice as well.
* It never waits longer than :data:`MAX_WAIT_S` for a quiet moment, so a
  steady trickle of departures cannot postpone it for ever, and past
  :data:`MAX_HELD` held departures it runs without pauses, to keep up at up
  to a core's worth.

The cancelled attempts' unwinding (their ``finally`` blocks, the connection's
close, their done-callbacks) runs in the loop turn after their slice, before
the next look; :data:`SLICE_S` is kept small for that reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("tokenwire.sidecar")

MAX_WAIT_S = 0.01
"""Loop time the bookkeeping may wait for a quiet moment after the first held departure."""

MAX_HELD = 1024
"""Departures whose bookkeeping may wait at once; past it, it runs without waiting."""

SLICE_S = 0.0005
"""Loop time the bookkeeping may take before the loop reads its sockets again."""

PAUSE_S = 0.001
"""Loop time without a new departure before each slice (the loop may sleep
meanwhile: a loop's timers have millisecond resolution, so one millisecond is
the least that lets it)."""


class Departures:
    """Deferred bookkeeping of departed clients (see the module docstring)."""

    __slots__ = ("_added", "_held_since", "_pause_s", "_queue", "_scheduled", "_seen")

    def __init__(self, pause_s: float = PAUSE_S) -> None:
        """``pause_s``: the quiet loop time before each slice (0: one loop
        turn whose poll brought no departure)."""
        self._queue: deque[Callable[[], None]] = deque()
        self._added = 0
        self._seen = 0
        self._held_since = 0.0
        self._scheduled = False
        self._pause_s = pause_s

    def __len__(self) -> int:
        return len(self._queue)

    def defer(self, bookkeeping: Callable[[], None]) -> None:
        """Run ``bookkeeping`` once the current burst of departures is over."""
        self._queue.append(bookkeeping)
        self._added += 1
        if not self._scheduled:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            self._held_since = loop.time()
            self._look_later(loop)

    def run_all(self) -> None:
        """Run every held bookkeeping now (shutdown: before the log closes)."""
        queue = self._queue
        while queue:
            self._run(queue.popleft())

    def _look_later(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look again after a quiet ``pause_s`` (past ``MAX_HELD``: none),
        behind the callbacks of every reset read by then."""
        self._seen = self._added
        if self._pause_s and len(self._queue) < MAX_HELD:
            # A timer runs before the turn's queued callbacks: one hop behind them.
            loop.call_later(self._pause_s, loop.call_soon, self._check)
        else:
            # Queued now, a look would run before what this turn's poll reads:
            # one hop to the next turn, a second behind that poll's callbacks.
            loop.call_soon(loop.call_soon, self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        if (self._added != self._seen and len(queue) < MAX_HELD
                and loop.time() - self._held_since < MAX_WAIT_S):
            self._look_later(loop)  # departures still arriving
            return
        # Not loop.time(): uvloop's clock moves in whole milliseconds.
        deadline = time.monotonic() + SLICE_S
        while queue:
            self._run(queue.popleft())
            if queue and time.monotonic() >= deadline:
                self._look_later(loop)
                return
        self._scheduled = False

    @staticmethod
    def _run(bookkeeping: Callable[[], None]) -> None:
        try:
            bookkeeping()
        except Exception:
            logger.exception("a departed client's bookkeeping failed")
