"""The Redis Streams replay store: a reconnect can land on any replica.

Theory of operation
-------------------
Per stream ``S`` (keys share the hash tag ``{S}`` so a cluster keeps them on
one shard):

* ``tw:{S}:e`` — a Redis Stream whose entry ids are ``0-<seq>``, so the event
  id a client sends back maps straight onto ``XREAD ... 0-<seq>``; field ``f``
  holds the frame;
* ``tw:{S}:m`` — a hash: ``end`` (the end reason) and ``last`` (the number of
  the last event), ``overflow``, ``key``, ``owner`` (the caller's hash, see
  ``resume.py``), ``gap`` (the first event an append failed to store),
  ``lease`` (its writer keeps ``tw:{S}:w``); its existence is what makes the
  stream known;
* ``tw:{S}:w`` — the writer's lease while the stream is live, a few seconds
  long and renewed by the process writing it (``redis_lease.py``);
* ``tw:{S}:a`` — a list a reader pushes to when it attaches, which the
  replica holding a detached stream waits on with ``BLPOP``;
* ``tw:k:<key>`` — ``<stream> <body digest>`` for an idempotency key,
  claimed with ``SET NX``.
* ``tw:r:<scoped alias>`` — the stream an alias names (a Responses
  ``response.id``) within its owner's streams (``scoped_key``), expiring with it.

Every key gets ``EXPIRE ttl`` on each append, so a stream lives ``resume_ttl_s``
after its last event. :meth:`append` only queues: one writer task sends the
queue as one pipeline per round, in order, so frames and the end marker reach
Redis in the order the core produced them (a reader that sees ``end`` has every
frame before it).

A resume never serves a gap. Each event is stored under its own number and a
reader checks the numbers it gets run on from where it asked; a batch that
fails (Redis down, failing over) or is refused (an error reply to any of its
commands: READONLY from a master turned replica, OOM past ``maxmemory``)
marks each of its streams with ``gap`` (the first number lost), and with the
end if the end was lost too, at the next round that reaches Redis (tried every
``_GAP_RETRY_S`` until one does), since the frames after it may well be
stored. A reader that meets a missing number, has read all there is of a
stream so marked short of that number, or reaches the end short of ``last``,
stops with :class:`ReplayGap` (the in-band ``replay_gap`` error): a restart
that kept its data, or one that lost its last writes, is told, never
renumbered into a clean answer.

A writer that is gone is known at once. The process writing a live stream
renews its lease every 0.4 s (``redis_lease.py``: one task and one pipeline for
all its streams) and deletes it with the stored end. A reader that has read
all there is, finds no end and no lease, and none half a second later
(``LeaseWatch``, at the end of a block round: no cost per event), stops with
:class:`WriterGone` (the in-band ``writer_gone`` error) at most 1.7 s after
the writer died, instead of heartbeats until the TTL. An idempotency key
held by such a stream is taken over by the next repeat (``_claim``, a
compare-and-set on the key), which generates afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..core.events import ReplayAppend
from ..core.record import EndReason
from ..core.resume import scoped_key
from .redis_cancel import RedisCancelRelay
from .redis_client import open_client, redacted
from .redis_lease import LeaseWatch, RedisLeases, lease_key
from .replay_store import (
    KeyReused,
    ReplayGap,
    ReplayUnavailable,
    StoreUnavailable,
    StreamNotFound,
    WriterGone,
)

logger = logging.getLogger("tokenwire.resume")

_BLOCK_MS = 1000
# A blocking command's reply must come within redis-py's socket timeout (5 s by
# default; open_client leaves it so, and a read that long from a live server is
# a dead connection), or the client raises TimeoutError: a longer wait for a
# reader goes in BLPOPs this long. (XREAD blocks _BLOCK_MS at most.)
_BLOCK_SLICE_S = 4.0
_ALIAS = "tw:r:"
_ERROR_LOG_EVERY_S = 10.0
_GAP_RETRY_S = 0.5
_RECANCEL_S = 0.1
_READ_COUNT = 1024
# The first read is small: its events go out while the rest of a long backlog
# is still being fetched and decoded (the reader's time to first byte).
_FIRST_READ_COUNT = 64
_CLAIM_TRIES = 5
# Compare-and-set of one idempotency key (one key: any cluster slot): the key
# goes to the new stream only if it still names the stream found gone, so two
# repeats racing for it generate once.
_TAKE_OVER = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
              "redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return 1 end return 0")
# Delete an idempotency key only while it names the stream (ARGV[1] .. ' '): a
# key taken over by a repeat is not the old stream's to free.
_RELEASE = ("local held = redis.call('GET', KEYS[1]) "
            "if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
            "return 0")


def _keys(stream_id: str) -> tuple[str, str, str]:
    tag = "tw:{" + stream_id + "}"
    return tag + ":e", tag + ":m", tag + ":a"


@dataclass(slots=True)
class _Lost:
    """What failed appends of one stream lost: from ``first_seq`` to ``last_seq``,
    and its end, if that was among them."""

    first_seq: int
    last_seq: int = 0
    end: EndReason | None = None

    def add(self, action: ReplayAppend) -> None:
        self.last_seq = max(self.last_seq, action.first_seq + len(action.frames) - 1)
        if action.end is not None:
            self.end = action.end


def _run_on(stream_id: str, entries: list[tuple[bytes, dict[bytes, bytes]]],
            seq: int) -> tuple[tuple[bytes, ...], int]:
    """The frames of ``entries`` that run on from event ``seq`` without a missing
    number, and the last number among them (the caller stops where they end)."""
    frames: list[bytes] = []
    for entry_id, fields in entries:
        if int(entry_id.rpartition(b"-")[2]) != seq + 1:
            break
        seq += 1
        frames.append(fields[b"f"])
    return tuple(frames), seq


class RedisReplayStore:
    """A :class:`~tokenwire.middleware.shared.replay_store.ReplayStore` on Redis Streams."""

    def __init__(self, url: str, *, ttl_s: float = 300.0) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self._ttl = max(1, round(ttl_s))
        # The client the address names (one server, Sentinel or Cluster: redis_client.py),
        # and what a Redis outage looks like from here; turned into StoreUnavailable.
        self._redis: Any
        self._outages: tuple[type[BaseException], ...]
        self._redis, self._outages = open_client(url)
        self._queue: asyncio.Queue[ReplayAppend] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._writing = False  # a round is on its way to Redis (aclose waits for it)
        self._claims: dict[str, str] = {}  # stream -> its idempotency key, while it is written here
        self._aliases: dict[str, str] = {}  # stream -> its alias's key, while it is written here
        self._owners: dict[str, str] = {}  # stream -> its owner, while it is written here (its alias's scope)
        self._gaps: dict[str, _Lost] = {}  # stream -> what failed batches lost, until marked
        self.write_errors = 0
        self._error_logged_at = -_ERROR_LOG_EVERY_S
        self._cancels = RedisCancelRelay(self._redis, self._outages, self.end_reason)
        self._leases = RedisLeases(self._redis, self._outages, ttl_s=ttl_s)

    async def open(self, stream_id: str, idempotency: tuple[str, str] | None = None, *,
                   owner: str = "") -> str | None:
        try:
            return await self._open(stream_id, idempotency, owner)
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error

    async def owner(self, stream_id: str) -> str | None:
        try:
            value = await self._redis.hget(_keys(stream_id)[1], "owner")
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error
        return None if value is None else bytes(value).decode("ascii", "replace")

    async def resolve(self, alias: str, owner: str) -> str | None:
        try:
            value = await self._redis.get(_ALIAS + scoped_key(owner, alias))
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error
        return None if value is None else bytes(value).decode("ascii", "replace")

    async def end_reason(self, stream_id: str) -> EndReason | None:
        try:
            value = await self._redis.hget(_keys(stream_id)[1], "end")
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error
        if value is None:
            return None
        try:
            return EndReason(bytes(value).decode("ascii", "replace"))
        except ValueError:  # written by a newer version: ended, somehow
            return EndReason.UPSTREAM_ERROR

    async def discard(self, stream_id: str) -> None:
        # Only an ended stream is discarded (a cancel of one): no append of it is
        # still queued, so the keys go now, its idempotency claim with them.
        events, meta, attach = _keys(stream_id)
        try:
            key = await self._redis.hget(meta, "key")
            await self._redis.delete(events, meta, attach, lease_key(stream_id))
            if key:
                await self._release_claim("tw:k:" + bytes(key).decode(), stream_id)
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error

    async def read(self, stream_id: str, after_seq: int) -> AsyncIterator[tuple[bytes, ...]]:
        try:
            async for frames in self._read(stream_id, after_seq):
                yield frames
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error

    async def ping(self) -> bool:
        """Whether Redis answers a PING now: the sidecar's ``/readyz`` asks every
        ``health_interval_s`` (no request pays for it); the caller bounds the wait."""
        try:
            return bool(await self._redis.ping())
        except self._outages:
            return False

    def serve_cancels(self, stop_writer: Callable[[str], bool]) -> None:
        self._cancels.serve(stop_writer)

    async def relay_cancel(self, stream_id: str) -> bool:
        try:
            return await self._cancels.relay(stream_id)
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error

    async def writer_lapsed(self, stream_id: str) -> bool:
        try:
            return await self._leases.lapsed(stream_id, _keys(stream_id)[1])
        except self._outages as error:
            raise StoreUnavailable(f"redis: {error}") from error

    async def wait_reader(self, stream_id: str, timeout_s: float) -> bool:
        try:
            return await self._wait_reader(stream_id, timeout_s)
        except self._outages:
            return False  # no reader can be known: the grace ends as if none came

    async def _open(self, stream_id: str, idempotency: tuple[str, str] | None,
                    owner: str) -> str | None:
        meta = _keys(stream_id)[1]
        if idempotency is not None:
            held = await self._claim(stream_id, *idempotency)
            if held is not None:
                return held
            self._claims[stream_id] = "tw:k:" + idempotency[0]
        self._owners[stream_id] = owner
        mapping = {"key": idempotency[0] if idempotency is not None else "", "owner": owner, "lease": "1"}
        async with self._redis.pipeline(transaction=False) as pipe:
            self._leases.take(pipe, stream_id)  # before the hash that says it has one
            pipe.hset(meta, mapping=mapping)
            pipe.expire(meta, self._ttl)
            await pipe.execute()
        self._leases.hold(stream_id)
        return None

    async def _claim(self, stream_id: str, key: str, digest: str) -> str | None:
        """Claim idempotency ``key`` for ``stream_id``: None once it is ours, or the
        live or ended stream holding it. A holder that expired, or whose writer
        is gone before its end was stored, gives the key up."""
        claim, mine = "tw:k:" + key, f"{stream_id} {digest}"
        for _ in range(_CLAIM_TRIES):
            if await self._redis.set(claim, mine, nx=True, ex=self._ttl):
                return None
            held = await self._redis.get(claim)
            if held is None:
                continue  # expired since: claim it again
            held_stream, _, held_digest = bytes(held).decode().partition(" ")
            if held_digest != digest:
                raise KeyReused(key)
            held_meta = _keys(held_stream)[1]
            if await self._redis.exists(held_meta) and not await self._leases.lapsed(held_stream, held_meta):
                return held_stream
            # Gone, or its writer is: take the key over, unless another repeat just did.
            if await self._redis.eval(_TAKE_OVER, 1, claim, held, mine, self._ttl):
                return None
        raise StoreUnavailable(f"idempotency key {key[:64]!r} changed hands {_CLAIM_TRIES} times")

    async def _release_claim(self, claim: str, stream_id: str) -> None:
        await self._redis.eval(_RELEASE, 1, claim, stream_id + " ")

    def append(self, action: ReplayAppend) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(self._queue))
        self._queue.put_nowait(action)

    async def _write_loop(self, queue: asyncio.Queue[ReplayAppend]) -> None:
        while True:
            if self._gaps:
                # Marks owed from a failed round: tried again even if no append
                # comes (a stream that ended in the outage has none to come).
                try:
                    # asyncio.timeout, not wait_for: 3.11's wait_for can return an item
                    # that came as it was cancelled, and swallow the cancel.
                    async with asyncio.timeout(_GAP_RETRY_S):
                        batch = [await queue.get()]
                except TimeoutError:
                    batch = []
            else:
                batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            self._writing = True
            try:
                await self._write(batch)
            except Exception as error:  # a store outage must not take the streams down
                # A discarded stream is forgotten here either way: its lease is let go
                # (it lapses, and a repeat of its key takes the key over).
                self._leases.released([action.stream_id for action in batch if action.discard])
                for action in batch:
                    if not action.discard:
                        self._gaps.setdefault(action.stream_id, _Lost(action.first_seq)).add(action)
                self.write_errors += len(batch)
                now = time.monotonic()
                if now - self._error_logged_at >= _ERROR_LOG_EVERY_S:  # once a while, not per batch
                    self._error_logged_at = now
                    logger.error("replay store %s: appends lost (%d so far): %s", redacted(self.url),
                                 self.write_errors, error)
            finally:
                self._writing = False

    async def _write(self, batch: list[ReplayAppend]) -> None:
        key_reads: list[tuple[int, str]] = []  # the HGETs of discarded streams' keys: position, stream
        ended: list[str] = []  # streams whose end (and lease's release) this round stores
        gaps, self._gaps = self._gaps, {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream_id, lost in gaps.items():
                meta = _keys(stream_id)[1]
                pipe.hsetnx(meta, "gap", lost.first_seq)  # the earliest loss stands
                if lost.end is not None:  # lost with the rest: readers must learn it ended
                    pipe.hset(meta, mapping={"end": lost.end.value, "last": lost.last_seq})
                    # Its writer was alive until now (its lease renewed): only now is it done.
                    self._leases.release(pipe, stream_id)
                    ended.append(stream_id)
                pipe.expire(meta, self._ttl)
            for action in batch:
                events, meta, attach = _keys(action.stream_id)
                if action.discard:
                    self._claims.pop(action.stream_id, None)
                    self._owners.pop(action.stream_id, None)
                    key_reads.append((len(pipe), action.stream_id))
                    pipe.hget(meta, "key")
                    pipe.delete(events, meta, attach, lease_key(action.stream_id))
                    ended.append(action.stream_id)
                    continue
                self._leases.wrote(action.stream_id)
                for offset, frame in enumerate(action.frames):
                    pipe.xadd(events, {"f": frame}, id=f"0-{action.first_seq + offset}")
                if action.overflow:
                    pipe.hset(meta, "overflow", "1")
                if action.end is not None:
                    last = action.first_seq + len(action.frames) - 1
                    pipe.hset(meta, mapping={"end": action.end.value, "last": last})
                    self._leases.release(pipe, action.stream_id)  # after the end: see redis_lease.py
                    ended.append(action.stream_id)
                if action.alias is not None:
                    owner = self._owners.get(action.stream_id, "")
                    self._aliases[action.stream_id] = _ALIAS + scoped_key(owner, action.alias)
                pipe.expire(events, self._ttl)
                pipe.expire(meta, self._ttl)
                alias = self._aliases.get(action.stream_id)
                if alias is not None:
                    # The alias lives as long as its stream, like an idempotency key.
                    pipe.set(alias, action.stream_id, ex=self._ttl)
                    if action.end is not None:
                        del self._aliases[action.stream_id]
                claim = self._claims.get(action.stream_id)
                if claim is not None:
                    # The key lives as long as its stream, however long that runs.
                    pipe.expire(claim, self._ttl)
                    if action.end is not None:
                        del self._claims[action.stream_id]
                if action.end is not None:
                    self._owners.pop(action.stream_id, None)
            try:
                results = await pipe.execute(raise_on_error=False)
                # An error reply means its command was not stored (READONLY from a
                # master turned replica, OOM past maxmemory, MISCONF): the round is
                # lost as one that never reached Redis is, and marked so. Raised as
                # Redis said it: redis-py's own raise quotes the command, frames and all.
                refused = next((result for result in results if isinstance(result, Exception)), None)
                if refused is not None:
                    raise refused
            except Exception:
                for stream_id, lost in gaps.items():  # not marked yet: the next round tries again
                    self._gaps.setdefault(stream_id, lost)
                raise  # the ended streams keep their leases: their ends are marked later
        self._leases.released(ended)
        # Discarded streams (failed before their first event) free their key.
        for position, stream_id in key_reads:
            key = results[position]
            if isinstance(key, bytes) and key:
                await self._release_claim("tw:k:" + key.decode(), stream_id)

    async def _read(self, stream_id: str, after_seq: int) -> AsyncIterator[tuple[bytes, ...]]:
        events, meta, attach = _keys(stream_id)
        if not await self._redis.exists(meta):
            raise StreamNotFound(stream_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.rpush(attach, 1)
            pipe.expire(attach, self._ttl)
            await pipe.execute()
        seq = max(after_seq, 0)  # the last event read: the next must be seq + 1
        block: int | None = None
        count = _FIRST_READ_COUNT
        watch = LeaseWatch()
        lease = lease_key(stream_id)
        while True:
            reply = await self._redis.xread({events: f"0-{seq}"}, count=count, block=block)
            count = _READ_COUNT
            entries = reply[0][1] if reply else []
            if entries:
                frames, seq = _run_on(stream_id, entries, seq)
                if frames:
                    yield frames
                if len(frames) < len(entries):
                    raise ReplayGap(stream_id, seq + 1)
                watch.wrote()
                block = None
                continue
            # Nothing new (at once, or within the block): has it ended, is it still there?
            async with self._redis.pipeline(transaction=False) as pipe:
                # The lease first: a writer stores its end, then deletes its lease, so
                # a lease found gone here means any end it stored shows in the HGETALL.
                pipe.pttl(lease)
                pipe.hgetall(meta)
                pttl, state = await pipe.execute()
            if not state:
                raise ReplayUnavailable(stream_id)  # expired while we read
            if state.get(b"overflow"):
                raise ReplayUnavailable(stream_id)
            lost = state.get(b"gap")
            if lost and int(lost) > seq:
                # All there is was read, short of the first number an append lost.
                raise ReplayGap(stream_id, seq + 1)
            if state.get(b"end"):
                # The end marker is written after the last frame, in one pipeline:
                # one more read picks up any frame that raced the check above.
                reply = await self._redis.xread({events: f"0-{seq}"}, count=_READ_COUNT)
                if reply and reply[0][1]:
                    frames, seq = _run_on(stream_id, reply[0][1], seq)
                    if frames:
                        yield frames
                    if len(frames) < len(reply[0][1]):
                        raise ReplayGap(stream_id, seq + 1)
                if seq < int(state.get(b"last") or 0):
                    raise ReplayGap(stream_id, seq + 1)  # ended, but its last events were lost
                return
            if not state.get(b"lease"):
                block = _BLOCK_MS  # written by a version without leases: live until its TTL
                continue
            next_block = watch.next_block_ms(int(pttl), time.monotonic(), _BLOCK_MS)
            if next_block is None:
                # No end, nothing new, no lease for CONFIRM_S: its writer died. One
                # more read for what it stored just before: all of it is sent first.
                reply = await self._redis.xread({events: f"0-{seq}"}, count=1)
                if not reply or not reply[0][1]:
                    raise WriterGone(stream_id)
                next_block = None  # read on (a writer that stalls, then writes, lives)
            block = next_block

    async def _wait_reader(self, stream_id: str, timeout_s: float) -> bool:
        _, _, attach = _keys(stream_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:  # in slices: see _BLOCK_SLICE_S (an attach between two is popped by the next)
            slice_s = min(deadline - loop.time(), _BLOCK_SLICE_S)
            if await self._redis.blpop([attach], timeout=max(slice_s, 0.01)) is not None:
                return True
            if loop.time() >= deadline:
                return False

    async def aclose(self) -> None:
        if self._queue is not None and self._writer is not None:
            # Let queued appends, and the round on its way, reach Redis before the connection goes.
            for _ in range(100):
                if self._queue.empty() and not self._writing:
                    break
                await asyncio.sleep(0.01)
            while not self._writer.done():
                # A cancel that lands inside a round can be swallowed on the way
                # (redis-py: the task was seen waiting on its queue again, cancelling,
                # and a shutdown hung on it): cancelled again until it ends.
                self._writer.cancel()
                await asyncio.wait({self._writer}, timeout=_RECANCEL_S)
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        await self._leases.aclose()
        await self._cancels.aclose()
        await self._redis.aclose()
