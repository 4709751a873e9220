"""Replay stores: where a resumable stream's events wait for a reconnect.

Theory of operation
-------------------
The wire core numbers a resumable stream's events and hands them out in
``ReplayAppend`` actions; the driver passes each one to :meth:`append`, which
never blocks. A reconnecting client is served by :meth:`read`: every stored
frame after its last event id, then the live tail as it is appended, until the
stream's end. A driver feeds those frames to a fresh wire core (after a
``ReplaySource`` input), so heartbeats, slow-reader handling and ids on the
resumed connection follow the same rules as on the first.

A stream is kept until ``resume_ttl_s`` after its last append (its end is its
last append). :class:`MemoryReplayStore` also holds ``resume_total_bytes`` in
all, dropping the oldest streams first; :mod:`.replay_redis` keeps them in
Redis Streams so any replica can serve the reconnect.

Idempotency keys live beside the streams: :meth:`open` claims a key for a new
stream, or says which stream already holds it. Each stream also keeps its
owner's hash (see ``resume.py``); :func:`admit` is where every driver decides
(through ``driver.py``'s ``enter_resume``), before any upstream is called,
whether a request replays, generates, or is refused, so the ownership rule is
applied in one place.

A live stream has one writer, the process generating it. A
:class:`MemoryReplayStore` lives in that process, so its readers go with their
writer; a store that processes share (Redis) keeps a lease for each writer
(``redis_lease.py``), ends a reader of a stream whose writer died with
:class:`WriterGone` (the in-band ``writer_gone`` error) and gives that
stream's idempotency key to the next repeat, which generates afresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..core.config import WireConfig
from ..core.events import (
    Input,
    Rejected,
    ReplayAppend,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
)
from ..core.headers import SSE_HEADERS
from ..core.record import EndReason
from ..core.resume import (
    CancelStream,
    Idempotent,
    ResumeAlias,
    ResumeFrom,
    key_reused,
    replay_gap,
    replay_unavailable,
    same_caller,
    scoped_key,
    store_unavailable,
    stream_not_found,
    writer_gone,
)
from .store_outages import STORE_OUTAGES

# Per-frame bookkeeping counted against resume_total_bytes besides the frame
# itself (a bytes object's header and its list slot, measured in bench/).
FRAME_OVERHEAD_BYTES = 41
_SWEEP_EVERY_S = 1.0
# A long backlog is fed in slices, so the core can pause the read (it reads a
# replay under the block policy) before its pending cap is near.
_FRAMES_PER_FEED = 64


class StreamNotFound(LookupError):
    """The stream never existed here, or expired."""


class ReplayUnavailable(LookupError):
    """The reader has everything the store kept, but the stream went on past
    ``resume_max_bytes`` or was evicted: the rest cannot be replayed."""


class ReplayGap(ReplayUnavailable):
    """The store lost event ``seq`` of the stream (and maybe more) while keeping
    some after it: a replay stops there instead of skipping them."""

    def __init__(self, stream_id: str, seq: int) -> None:
        super().__init__(stream_id)
        self.seq = seq


class WriterGone(ReplayUnavailable):
    """The process writing the live stream is gone (a store shared by processes
    keeps a lease for each writer, and this one lapsed) and its end was never
    stored: the reader has all it stored, and nothing more will come."""


class StoreUnavailable(ConnectionError):
    """The store cannot be reached (a Redis outage): nothing can be resumed now."""


class KeyReused(ValueError):
    """An idempotency key came back with a different request body."""


class ReplayStore(Protocol):
    """What a driver needs from a replay store."""

    async def open(self, stream_id: str, idempotency: tuple[str, str] | None = None, *,
                   owner: str = "") -> str | None:
        """Create ``stream_id`` for ``owner`` (a caller hash). With ``(key, body
        digest)``, claim the key first: if it is already held, return the stream
        that holds it (nothing is created) or raise :class:`KeyReused` if that
        stream's body differed. A holder that expired, or whose writer died
        before its end was stored (:class:`WriterGone`), gives the key up to
        the new stream, which then generates afresh."""
        ...

    async def owner(self, stream_id: str) -> str | None:
        """The owner hash ``stream_id`` was opened with; None for an unknown stream."""
        ...

    async def resolve(self, alias: str, owner: str) -> str | None:
        """The stream of ``owner``'s that an ``alias`` (``ReplayAppend.alias``)
        names; None if none does. Aliases are the engine's names, chosen by no
        one here, so they count within their owner's streams only (as
        idempotency keys do): another caller's stream of that name is not found."""
        ...

    async def end_reason(self, stream_id: str) -> EndReason | None:
        """How ``stream_id`` ended, once its end is stored (None: live or unknown)."""
        ...

    async def discard(self, stream_id: str) -> None:
        """Forget ``stream_id`` (an ended stream) now, its idempotency key with it
        (an alias may outlive it until its TTL, naming no stream then)."""
        ...

    def append(self, action: ReplayAppend) -> None:
        """Store what the core handed out (never blocks; writes may be queued)."""
        ...

    def read(self, stream_id: str, after_seq: int) -> AsyncIterator[tuple[bytes, ...]]:
        """Frames after ``after_seq``, then the live tail; ends with the stream.

        Raises :class:`StreamNotFound` before the first batch for an unknown
        stream and :class:`ReplayUnavailable` where the stored part ends early
        (:class:`WriterGone` where its writer died; a store of one process
        never raises it, its writers die with it). Starting a read counts as a
        reader attaching (see :meth:`wait_reader`)."""
        ...

    async def wait_reader(self, stream_id: str, timeout_s: float) -> bool:
        """True as soon as a reader attaches to ``stream_id``; False after ``timeout_s``."""
        ...

    def serve_cancels(self, stop_writer: Callable[[str], bool]) -> None:
        """Let other processes sharing the store stop this one's writers:
        ``stop_writer(stream_id)`` is called for each cancel they pass on
        (``redis_cancel.py``; a store of one process has none). Idempotent."""
        ...

    async def relay_cancel(self, stream_id: str) -> bool:
        """Pass a cancel of ``stream_id`` on to the process writing it; True once it
        stopped (its end is stored), False if none did (or none can be asked)."""
        ...

    async def writer_lapsed(self, stream_id: str) -> bool:
        """Whether the process writing ``stream_id`` died before storing its end
        (its lease lapsed): the stream will never go on. A store of one process
        says False, its writers die with it."""
        ...

    async def aclose(self) -> None:
        ...


@dataclass(slots=True)
class _Stored:
    frames: list[bytes] = field(default_factory=list)
    bytes: int = 0
    end: EndReason | None = None
    overflow: bool = False
    key: str | None = None
    alias: str | None = None
    owner: str = ""
    touched_at: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    attached: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        # One event per change: every reader waiting on the old one wakes.
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class MemoryReplayStore:
    """The default store: in this process, bounded in time and bytes."""

    def __init__(self, *, ttl_s: float = 300.0, total_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.total_bytes = total_bytes
        self._clock = clock
        self._streams: dict[str, _Stored] = {}  # oldest first
        self._keys: dict[str, tuple[str, str]] = {}  # key -> (stream, digest)
        self._aliases: dict[str, str] = {}  # alias -> stream
        self.stored_bytes = 0
        self.evicted_streams = 0
        self._swept_at = clock()

    @classmethod
    def from_config(cls, config: WireConfig) -> MemoryReplayStore:
        return cls(ttl_s=config.resume_ttl_s, total_bytes=config.resume_total_bytes)

    def __len__(self) -> int:
        return len(self._streams)

    async def open(self, stream_id: str, idempotency: tuple[str, str] | None = None, *,
                   owner: str = "") -> str | None:
        self._sweep()
        if idempotency is not None:
            key, digest = idempotency
            held = self._keys.get(key)
            if held is not None and held[0] in self._streams:
                if held[1] != digest:
                    raise KeyReused(key)
                return held[0]
            self._keys[key] = (stream_id, digest)
        stored = _Stored(owner=owner, touched_at=self._clock())
        stored.key = idempotency[0] if idempotency is not None else None
        self._streams[stream_id] = stored
        return None

    async def owner(self, stream_id: str) -> str | None:
        self._sweep()
        stored = self._streams.get(stream_id)
        return None if stored is None else stored.owner

    async def resolve(self, alias: str, owner: str) -> str | None:
        self._sweep()
        stream_id = self._aliases.get(scoped_key(owner, alias))
        return stream_id if stream_id is not None and stream_id in self._streams else None

    async def end_reason(self, stream_id: str) -> EndReason | None:
        stored = self._streams.get(stream_id)
        return None if stored is None else stored.end

    async def discard(self, stream_id: str) -> None:
        stored = self._streams.get(stream_id)
        if stored is not None:
            self._drop(stream_id, stored)

    def append(self, action: ReplayAppend) -> None:
        stored = self._streams.get(action.stream_id)
        if stored is None:
            return  # expired or evicted while live: readers were told
        if action.discard:
            self._drop(action.stream_id, stored)
            return
        stored.frames.extend(action.frames)
        added = sum(len(frame) + FRAME_OVERHEAD_BYTES for frame in action.frames)
        stored.bytes += added
        self.stored_bytes += added
        stored.overflow = stored.overflow or action.overflow
        if action.alias is not None:
            stored.alias = scoped_key(stored.owner, action.alias)
            self._aliases[stored.alias] = action.stream_id
        if action.end is not None:
            stored.end = action.end
        stored.touched_at = self._clock()
        stored.notify()
        if self.stored_bytes > self.total_bytes:
            self._evict()
        self._sweep()

    async def read(self, stream_id: str, after_seq: int) -> AsyncIterator[tuple[bytes, ...]]:
        self._sweep()
        stored = self._streams.get(stream_id)
        if stored is None:
            raise StreamNotFound(stream_id)
        stored.attached.set()
        sent = max(after_seq, 0)
        while True:
            changed = stored.changed
            if len(stored.frames) > sent:
                batch = tuple(stored.frames[sent:])
                sent = len(stored.frames)
                yield batch
                continue
            if stored.overflow:
                raise ReplayUnavailable(stream_id)
            if stored.end is not None:
                return
            if self._streams.get(stream_id) is not stored:
                raise ReplayUnavailable(stream_id)  # evicted or expired while live
            await changed.wait()

    async def wait_reader(self, stream_id: str, timeout_s: float) -> bool:
        stored = self._streams.get(stream_id)
        if stored is None:
            return False
        try:
            await asyncio.wait_for(stored.attached.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def serve_cancels(self, stop_writer: Callable[[str], bool]) -> None:
        pass  # one process: its writers are all stopped here

    async def relay_cancel(self, stream_id: str) -> bool:
        return False

    async def writer_lapsed(self, stream_id: str) -> bool:
        return False

    async def aclose(self) -> None:
        for stream_id, stored in list(self._streams.items()):
            self._drop(stream_id, stored)

    # ------------------------------------------------------------ bounds

    def _drop(self, stream_id: str, stored: _Stored) -> None:
        if self._streams.get(stream_id) is stored:
            del self._streams[stream_id]
            self.stored_bytes -= stored.bytes
        if stored.key is not None and self._keys.get(stored.key, ("",))[0] == stream_id:
            del self._keys[stored.key]
        if stored.alias is not None and self._aliases.get(stored.alias) == stream_id:
            del self._aliases[stored.alias]
        stored.notify()  # readers see it gone

    def _evict(self) -> None:
        """Oldest finished streams first, then the oldest live ones."""
        for finished_only in (True, False):
            for stream_id, stored in list(self._streams.items()):
                if self.stored_bytes <= self.total_bytes:
                    return
                if finished_only and stored.end is None:
                    continue
                self._drop(stream_id, stored)
                self.evicted_streams += 1

    def _sweep(self) -> None:
        now = self._clock()
        if now - self._swept_at < _SWEEP_EVERY_S:
            return
        self._swept_at = now
        for stream_id, stored in list(self._streams.items()):
            if now - stored.touched_at >= self.ttl_s:
                self._drop(stream_id, stored)


async def admit(store: ReplayStore, route: ResumeFrom | ResumeAlias | Idempotent | CancelStream | None, *,
                stream_id: str, owner: str, open_now: bool) -> ResumeFrom | CancelStream | None:
    """Where a request's answer comes from: the stream to replay, the stream to
    cancel (by its id), or None to generate (as ``stream_id``, opened in the
    store for ``owner`` when the request is idempotent or ``open_now``).

    ``route`` is what :func:`~tokenwire.middleware.core.resume.classify` said.
    Raises the :class:`~tokenwire.middleware.core.errors.WireError` to answer with
    (the same 404 for another caller's stream as for an unknown one; 422 for
    a key reused with another body; 503 if the store is down for a request
    that needs it), or :class:`StoreUnavailable` for an ordinary request,
    which may still be generated, just not resumed.
    """
    try:
        if isinstance(route, CancelStream):
            named = await store.resolve(route.alias, owner) if route.alias else route.stream_id
            if named is not None and same_caller(await store.owner(named), owner):
                return CancelStream(named, route.alias)
            if not route.alias:
                raise stream_not_found(route.stream_id)
            # As for a resume by alias: a name this store does not hold for
            # this caller is the engine's to answer.
            route = None
        if isinstance(route, ResumeAlias):
            # A name this store does not know, or another caller's, is the
            # engine's to answer (it may keep responses of its own): generated
            # as an ordinary request, which reads nothing of the stored stream.
            named = await store.resolve(route.alias, owner)
            if named is not None and same_caller(await store.owner(named), owner):
                return ResumeFrom(named, route.after_seq)
            route = None
        if isinstance(route, ResumeFrom):
            if not same_caller(await store.owner(route.stream_id), owner):
                raise stream_not_found(route.stream_id)
            return route
        if isinstance(route, Idempotent):
            holder = await store.open(stream_id, (scoped_key(owner, route.key), route.digest),
                                      owner=owner)
            # The key is scoped by its owner: a holder is always this caller's stream.
            return None if holder is None else ResumeFrom(holder, 0)
        if open_now:
            await store.open(stream_id, owner=owner)
        return None
    except KeyReused:
        raise key_reused() from None
    except StoreUnavailable as error:
        if route is None:
            raise  # the caller answers without the resume, and says so (not_resumable)
        STORE_OUTAGES.note(error)
        # A reconnect cannot be served, and generating an idempotent request
        # without its key could answer it twice: the client retries later.
        raise store_unavailable() from None


async def feed_replay(store: ReplayStore, stream_id: str, after_seq: int, *,
                      readable: asyncio.Event, feed: Callable[[Input], None]) -> None:
    """Read a stored stream as if it were an upstream: feed the wire core (which
    was fed ``ReplaySource`` first) headers, the frames after ``after_seq``, the
    live tail and the end, or ``Rejected`` for an unknown or incomplete stream.
    Waits while ``readable`` is clear (the core's ``PauseUpstream``)."""
    feed(UpstreamHeaders(200, SSE_HEADERS))
    try:
        async for frames in store.read(stream_id, after_seq):
            for start in range(0, len(frames), _FRAMES_PER_FEED):
                if not readable.is_set():
                    await readable.wait()
                feed(UpstreamData(b"".join(frames[start:start + _FRAMES_PER_FEED])))
    except StreamNotFound:
        feed(Rejected(stream_not_found(stream_id)))
        return
    except ReplayGap as gap:
        feed(Rejected(replay_gap(stream_id, gap.seq)))
        return
    except WriterGone:
        feed(Rejected(writer_gone(stream_id)))
        return
    except ReplayUnavailable:
        feed(Rejected(replay_unavailable(stream_id)))
        return
    except StoreUnavailable as error:
        STORE_OUTAGES.note(error)
        feed(Rejected(store_unavailable()))
        return
    feed(UpstreamEnded())
