"""The replay store failing on the request path: counted, and logged once a while.

Theory of operation
-------------------
A request that needs the store while it is out is refused with 503
``resume_unavailable`` (a resume, an idempotent request, a cancel by id), or
generated without its resume (an ordinary request). Either way the client
learns it; the operator must too, or a store that fails every time (a Redis
Cluster named as one server: each idempotency key's slot answers MOVED) reads
as a run of unexplained 503s. So the places that turn a ``StoreUnavailable``
into that answer (``admit``, ``feed_replay``, ``answer_cancel``) hand it to
:data:`STORE_OUTAGES`, which counts every one and logs the first, then at most
one line per :data:`LOG_EVERY_S` with the count, as the Redis store logs its
lost appends. The drivers say which requests are answered without their resume
the same way (:meth:`StoreOutages.not_resumable`): one line a request would be
thousands a minute while the store is out, and say nothing more than the first.
Only a failure pays: the happy path never calls it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("tokenwire.resume")

LOG_EVERY_S = 10.0
"""At most one line per this long, however many requests fail."""


class StoreOutages:
    """This process's count of request-path store failures (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time a line is due by (a test passes its own)."""
        self.count = 0
        self.unresumable = 0
        """Requests answered without their resume (:meth:`not_resumable`)."""
        self.clock = clock
        self._logged_at = -LOG_EVERY_S
        self._unresumable_logged_at = -LOG_EVERY_S

    def note(self, error: BaseException) -> None:
        """One request met the store out: count it, and log it unless a line was
        logged within :data:`LOG_EVERY_S`."""
        self.count += 1
        now = self.clock()
        if now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        # The client's own exception says more than its message (redis-py's MOVED
        # reads "6091 127.0.0.1:7001"); named, not imported: any store's will do.
        cause = error.__cause__ if error.__cause__ is not None else error
        logger.error("resume store unavailable (requests so far: %d): %s (%s); resumes, idempotent "
                     "requests and cancels by id are refused with 503 resume_unavailable, other "
                     "requests are answered but cannot be resumed%s", self.count, error,
                     type(cause).__name__, _hint(type(cause).__name__, str(error)))

    def not_resumable(self, stream_id: str, error: BaseException) -> None:
        """A request is answered, but its stream ``stream_id`` could not be opened
        in the store: count it, and log it unless a line was logged within
        :data:`LOG_EVERY_S`."""
        self.unresumable += 1
        now = self.clock()
        if now - self._unresumable_logged_at < LOG_EVERY_S:
            return
        self._unresumable_logged_at = now
        logger.warning("stream %s: not resumable (requests so far: %d): %s", stream_id,
                       self.unresumable, error)


def _hint(kind: str, message: str) -> str:
    """What an error that means a misnamed store says to do about it."""
    if kind in ("MovedError", "AskError", "ClusterCrossSlotError") or "CROSSSLOT" in message:
        return " (a Redis Cluster answers: name it redis+cluster://HOST:PORT[,HOST:PORT...])"
    if "cluster support disabled" in message or "Cluster mode is not enabled" in message:
        return " (not a Redis Cluster: name it redis:// or redis+sentinel://)"
    if "unknown command 'SENTINEL'" in message:
        return " (not a sentinel: redis+sentinel:// names the sentinels' addresses, then the master's name)"
    return ""


STORE_OUTAGES = StoreOutages()
"""The process's one count."""
