"""The bookkeeping of departed clients, run once their burst is over.

When a client leaves, its exchange closes the upstream socket at once and
hands the rest (the stream's record, metrics, log line, the pod's release,
the attempt task's cancellation) to :class:`Departures`. Many clients often
leave together (a load balancer drops its connections, a front end crashes),
and their resets reach the sidecar over a few loop turns, not one: were each
turn's bookkeeping run on the next turn, the resets read on that turn would
wait behind it. So the bookkeeping waits until a loop turn brings no new
departure, and then runs in the order the clients left, in slices of at most
:data:`SLICE_S` of loop time: a reset read meanwhile (its client's process was
descheduled halfway through the burst, say) waits for one slice, not for all
of them. It never waits longer than :data:`MAX_WAIT_TURNS` turns or past
:data:`MAX_HELD` departures, so a steady trickle of departures cannot
postpone it for ever.

Before each slice it leaves the loop free for :data:`PAUSE_S` (unless
:data:`MAX_HELD` departures wait, when it catches up at full speed): with nothing
else to do the loop sleeps, and the processes the cuts woke get the CPU. A
sidecar often shares its node's cores with the upstream it fronts (the
engine's own API server); run back to back, 50 departures' bookkeeping keeps
a core busy for several milliseconds, and on a busy machine the upstream
would see its sockets closed only once the scheduler preempted the sidecar
(measured on 2 cores: 0.1-7 ms after the FIN, against ~1 ms behind nginx,
whose closes end its work).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("tokenwire.sidecar")

MAX_WAIT_TURNS = 8
"""Loop turns the bookkeeping may wait for a burst of departures to end."""

MAX_HELD = 1024
"""Departures whose bookkeeping may wait at once; past it, it runs without waiting."""

SLICE_S = 0.0005
"""Loop time the bookkeeping may take before the loop reads its sockets again."""

PAUSE_S = 0.001
"""Loop time left free before each slice (the loop may sleep meanwhile: a
loop's timers have millisecond resolution, so one millisecond is the least
that lets it)."""


class Departures:
    """Deferred bookkeeping of departed clients (see the module docstring)."""

    __slots__ = ("_added", "_pause_s", "_paused", "_queue", "_scheduled", "_seen", "_waited")

    def __init__(self, pause_s: float = PAUSE_S) -> None:
        """``pause_s``: loop time left free before each slice (0: none, the
        next slice on the next turn)."""
        self._queue: deque[Callable[[], None]] = deque()
        self._added = 0
        self._seen = -1
        self._waited = 0
        self._scheduled = False
        self._pause_s = pause_s
        self._paused = False

    def __len__(self) -> int:
        return len(self._queue)

    def defer(self, bookkeeping: Callable[[], None]) -> None:
        """Run ``bookkeeping`` once the current burst of departures is over."""
        self._queue.append(bookkeeping)
        self._added += 1
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._check)

    def run_all(self) -> None:
        """Run every held bookkeeping now (shutdown: before the log closes)."""
        queue = self._queue
        while queue:
            self._run(queue.popleft())

    def _check(self) -> None:
        # A turn's new resets are read after this turn's callbacks were queued,
        # so a departure since the last look means another turn may bring more.
        if (self._added != self._seen and self._waited < MAX_WAIT_TURNS
                and len(self._queue) < MAX_HELD):
            self._seen = self._added
            self._waited += 1
            asyncio.get_running_loop().call_soon(self._check)
            return
        loop = asyncio.get_running_loop()
        if self._pause_s and not self._paused and len(self._queue) < MAX_HELD:
            # A departure read during the pause makes the next look wait again
            # (bounded as above). Past MAX_HELD no pause: the bookkeeping
            # must keep up with departures, at up to a core's worth.
            self._paused = True
            self._seen = self._added
            loop.call_later(self._pause_s, self._check)
            return
        self._paused = False
        deadline = loop.time() + SLICE_S
        queue = self._queue
        while queue:
            self._run(queue.popleft())
            if queue and loop.time() >= deadline:
                # The rest on a later turn; a departure read before then goes first.
                self._seen = self._added
                loop.call_soon(self._check)
                return
        self._scheduled = False
        self._seen = -1
        self._waited = 0
        self._paused = False

    @staticmethod
    def _run(bookkeeping: Callable[[], None]) -> None:
        try:
            bookkeeping()
        except Exception:
            logger.exception("a departed client's bookkeeping failed")
