"""Writer leases: whether the process writing a live Redis-stored stream is still there.

Theory of operation
-------------------
A live stream has one writer, the process generating it. A reader on another
replica, or an idempotent repeat there, sees only the store: without a sign of
life from the writer, a stream whose writer was SIGKILLed looks live until its
keys expire (``resume_ttl_s``), and its readers get heartbeats until then.

So the writer holds a short lease per live stream, ``tw:{S}:w`` (the hash tag
of the stream's other keys: one cluster slot), set with ``PX`` in the pipeline
that opens the stream, before its hash (a reader that finds the hash finds the
lease), and deleted in the pipeline that stores the stream's end (a stream
whose end is stored needs none; one whose end was lost in an outage keeps its
lease until the end is marked). One task per process (:class:`RedisLeases`)
renews all of its streams' leases in one pipeline every :data:`RENEW_S`; a
lease lasts :data:`LEASE_MS`, so two renewals in a row may be late or fail.
Each round writes a new value (this process's token and the round's number),
so a renewal can be seen. The stream's hash says it has a lease (``lease``):
a stream written by a version without leases is read as before.

A writer that dies stops renewing, and its lease lapses within ``LEASE_MS``.
A reader that has read everything, finds no end and no lease, and still none
:data:`CONFIRM_S` later, stops with ``WriterGone`` (the in-band ``writer_gone``
error): what was stored, then that, instead of a TTL-long wait. The second look
is for a Redis restarted from its AOF, or failed over, after an outage longer
than a lease: the leases lapsed while the writers could not renew them, and a
live writer re-sets them at its next try (every :data:`_RETRY_S` while Redis
fails); and for a lease lost out of its writer's sight (a restart between two
renewals that lost the last ones, an eviction: give the store
``maxmemory-policy noeviction``, Redis's default, as ``volatile-ttl`` evicts
the shortest-lived keys, the leases, first), which its next renewal sets
again. Readers look only at the end of a round that brought nothing
(:class:`LeaseWatch`), and time that round to end just after the lease would
lapse unrenewed, so a dead writer is known ``LEASE_MS`` + ``CONFIRM_S``
(1.7 s) after it died at most, and a live one costs readers nothing more per
event.

An idempotent repeat of a live stream asks :meth:`RedisLeases.lapsed` before
it replays: a renewal (a new value) within one round says the writer lives,
and the stream is replayed; a lapsed lease, confirmed, gives the key to the
repeat, which generates afresh (the old stream's readers get ``writer_gone``).

Why so short: a client that resumes on another replica right after its own
died is to be answered within 2 s of its request (issue 35), and the lease
that may still run then, plus the confirming look, must fit in that; a 3 s
lease could not. The price: a writer whose event loop stops for longer than
``LEASE_MS - RENEW_S`` (0.8 s), or that cannot reach Redis while the others
can, is taken for dead by the other processes: their readers of its streams
end with ``writer_gone`` and an idempotent repeat elsewhere generates again.
Its own clients are not affected. The cost in Redis: one ``SET`` per live
stream per process every ``RENEW_S``, in one pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tokenwire.resume")

RENEW_S = 0.4
"""How often a process renews its writers' leases (one pipeline for all)."""
LEASE_MS = 1200
"""How long a lease lasts unrenewed: three renewals, so two may miss."""
CONFIRM_S = 0.5
"""How long a lease must stay gone before its writer is taken for dead: more
than a renewal, so a lease lost out of its writer's sight is set again first."""
# While Redis fails, a renewal is tried this often, so leases that lapsed in an
# outage are back well within CONFIRM_S of Redis answering again.
_RETRY_S = 0.1
# An idempotent repeat's look at a live stream's lease, this often.
_POLL_S = 0.05
# A reader's round ends this long after the lease would lapse unrenewed.
_WAKE_AFTER_MS = 20


def lease_key(stream_id: str) -> str:
    """The lease of ``stream_id``'s writer: the hash tag of its other keys."""
    return "tw:{" + stream_id + "}:w"


class LeaseWatch:
    """One reader's view of its stream's lease, looked at after each round of
    ``XREAD`` that brought nothing new (see the module docstring)."""

    __slots__ = ("_gone_at",)

    def __init__(self) -> None:
        self._gone_at: float | None = None

    def wrote(self) -> None:
        """Events came: the writer writes, whatever the lease said."""
        self._gone_at = None

    def next_block_ms(self, pttl: int, now: float, longest_ms: int) -> int | None:
        """The next round's ``XREAD`` block, given the lease's ``PTTL`` (-2: no
        lease; -1: no expiry) at ``now``; None once the writer is gone."""
        if pttl != -2:
            self._gone_at = None
            if pttl < 0:
                return longest_ms
            # Wake just after the lease would lapse unrenewed: a dead writer is known at once.
            return max(1, min(longest_ms, pttl + _WAKE_AFTER_MS))
        if self._gone_at is None:
            self._gone_at = now
            return max(1, round(CONFIRM_S * 1000))
        left_s = CONFIRM_S - (now - self._gone_at)
        if left_s <= 0:
            return None
        return max(1, round(left_s * 1000))


class RedisLeases:
    """One process's writer leases: taken as its streams open, renewed by one
    task, released as their ends are stored."""

    def __init__(self, redis: Any, outages: tuple[type[BaseException], ...], *, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``redis``: the store's client; ``ttl_s``: its ``resume_ttl_s`` (a stream
        that showed no life for that long has no keys left to lease)."""
        self._redis = redis
        self._outages = outages
        self._ttl_s = ttl_s
        self._clock = clock
        self._token = secrets.token_hex(4)  # which process holds a lease, in its value
        self._round = 0
        self._held: dict[str, float] = {}  # stream -> when it last showed life here
        self._renewer: asyncio.Task[None] | None = None

    def _value(self) -> str:
        return f"{self._token}.{self._round}"

    def holds(self, stream_id: str) -> bool:
        """Whether this process writes ``stream_id`` (its end not stored yet)."""
        return stream_id in self._held

    def take(self, pipe: Any, stream_id: str) -> None:
        """Queue on ``pipe`` the lease of a stream this process is opening
        (before its hash: a reader that finds the hash finds the lease)."""
        pipe.set(lease_key(stream_id), self._value(), px=LEASE_MS)

    def hold(self, stream_id: str) -> None:
        """The lease :meth:`take` queued is stored: renew it from now on."""
        self._held[stream_id] = self._clock()
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew())

    def wrote(self, stream_id: str) -> None:
        """An append of ``stream_id`` was stored: it lives on (and so do its keys)."""
        if stream_id in self._held:
            self._held[stream_id] = self._clock()

    def release(self, pipe: Any, stream_id: str) -> None:
        """Queue on ``pipe``, after its end, the deletion of ``stream_id``'s lease."""
        pipe.delete(lease_key(stream_id))

    def released(self, stream_ids: list[str]) -> None:
        """The pipeline with these streams' ends and releases was stored: stop
        renewing them. (A renewal already on its way may set a lease again for
        ``LEASE_MS``: harmless, a reader looks at the end first.)"""
        for stream_id in stream_ids:
            self._held.pop(stream_id, None)

    async def lapsed(self, stream_id: str, meta: str) -> bool:
        """Whether the writer of ``stream_id`` (hash key ``meta``) is gone before
        storing its end: its lease absent for ``CONFIRM_S``. False as soon as the
        lease is renewed (the writer lives), the end is stored, or the stream
        has no lease (an older writer's). Takes up to one renewal for a live
        writer, ``LEASE_MS`` + ``CONFIRM_S`` for a dead one. Raises the store's
        outages."""
        if stream_id in self._held:
            return False
        key = lease_key(stream_id)
        loop = asyncio.get_running_loop()
        # A lease that neither changes nor lapses in this long (no expiry) is not for us to judge.
        deadline = loop.time() + LEASE_MS / 1000 + CONFIRM_S + RENEW_S
        seen: bytes | None = None
        gone_at: float | None = None
        while True:
            async with self._redis.pipeline(transaction=False) as pipe:
                # The lease first: an end stored (and the lease deleted) in between shows in the HMGET.
                pipe.get(key)
                pipe.hmget(meta, "end", "lease")
                value, (end, flag) = await pipe.execute()
            if end is not None or not flag:
                return False
            now = loop.time()
            if value is None:
                if gone_at is None:
                    gone_at = now
                elif now - gone_at >= CONFIRM_S:
                    return True
            elif gone_at is not None or (seen is not None and value != seen):
                return False  # renewed
            else:
                seen = value
            if now >= deadline:
                return False
            await asyncio.sleep(_POLL_S)

    async def _renew(self) -> None:
        failing = False
        while self._held:
            await asyncio.sleep(_RETRY_S if failing else RENEW_S)
            now = self._clock()
            for stream_id in [s for s, at in self._held.items() if now - at > self._ttl_s]:
                del self._held[stream_id]  # its keys expired: never ended here (a driver's crash)
            if not self._held:
                break
            self._round += 1
            value = self._value()
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for stream_id in self._held:
                        pipe.set(lease_key(stream_id), value, px=LEASE_MS)
                    await pipe.execute()
            except Exception as error:  # an outage must not end the renewals
                if not failing:  # said once an outage, not every retry
                    logger.warning("resume store: cannot renew the writer leases of %d streams (other "
                                   "processes will take them for gone): %s", len(self._held), error)
                failing = True
            else:
                failing = False

    async def aclose(self) -> None:
        """Stop renewing; the leases still held go now (this process writes no
        more), so other processes' readers of those streams learn it at once."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        held, self._held = list(self._held), {}
        if held:
            with contextlib.suppress(*self._outages):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for stream_id in held:  # one key a command: a cluster keeps them on many shards
                        pipe.delete(lease_key(stream_id))
                    await pipe.execute()
