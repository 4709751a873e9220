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


class Departures:
    """Deferred bookkeeping of departed clients (see the module docstring)."""

    __slots__ = ("_added", "_queue", "_scheduled", "_seen", "_waited")

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()
        self._added = 0
        self._seen = -1
        self._waited = 0
        self._scheduled = False

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

    @staticmethod
    def _run(bookkeeping: Callable[[], None]) -> None:
        try:
            bookkeeping()
        except Exception:
            logger.exception("a departed client's bookkeeping failed")
