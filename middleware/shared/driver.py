"""What every driver of the wire core does alike, written once.

Theory of operation
-------------------
A driver (the ASGI middleware, ``middleware/asgi/exchange.py``; the sidecar,
``sidecar/exchange/loop.py``; and the next ones: HTTP/2, gRPC) turns its
protocol's happenings into core inputs and the core's actions into its
protocol's writes. Some of what lies around that loop is the same whatever
the protocol, and lives here so that a rule is never written twice:

* :class:`DeadlineTimer`: the one timer a driver keeps, armed at the core's
  ``next_deadline()`` and fed to it as ``Tick``. It only ever moves earlier
  (heartbeat deadlines shift on every write; a timer that fires early finds
  nothing due and is re-armed), and it reports the deadline itself when the
  loop wakes a hair early, so the due timer fires instead of spinning.
* :func:`enter_resume`: before any upstream is called, what the resume rules
  say of a request: replay a stored stream (a reconnect, or a repeated
  idempotency key), refuse it (404, 422, 503: the core puts the error on the
  wire, fed ``Rejected``), or generate (with its stream opened in the store,
  or not resumable because the store is down).
* :func:`replay`: serve a stored stream through a fresh core: ``ReplaySource``
  first, then the store read as if it were an upstream.
* :func:`wait_for_reader`: the ``AwaitReader`` action, as a wait on the store.
* :func:`answer_cancel`: a cancel by stream id (``CancelStream``), answered
  through a fresh core as if the store were an upstream, once the driver has
  stopped the stream's writer.

What the drivers must *not* decide is decided by the core: whether the
engine is told of an abort is ``AbortUpstream.final`` (never for a replay,
which generates nothing, nor for a retry's dropped attempt); how long an
upstream may keep its body open after a complete answer and how long a cut
body may take to flush are ``WireConfig`` keys (``upstream_tail_grace_s``,
``close_flush_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ..core.errors import WireError
from ..core.events import (
    AwaitReader,
    Input,
    Rejected,
    ReplaySource,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
)
from ..core.headers import Header
from ..core.record import EndReason
from ..core.resume import (
    CallerKey,
    CancelStream,
    Idempotent,
    ResumeFrom,
    classify,
    store_unavailable,
    stream_elsewhere,
)
from .replay_store import ReplayStore, StoreUnavailable, admit, feed_replay
from .store_outages import STORE_OUTAGES


def _no_tick(now: float) -> None:
    """A closed timer's ``on_tick``."""


class DeadlineTimer:
    """One event-loop timer at the core's next deadline. See the module docstring."""

    __slots__ = ("_at", "_handle", "_loop", "_on_tick")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_tick: Callable[[float], None]) -> None:
        """``on_tick(now)`` feeds the core ``Tick()`` at ``now`` (never before the deadline)."""
        self._loop = loop
        self._on_tick = on_tick
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def arm(self, deadline: float | None) -> None:
        """Make sure the timer fires by ``deadline`` (None: nothing to time)."""
        if deadline is None:
            return
        if self._handle is not None:
            if self._at <= deadline:
                return  # it fires early, ticks harmlessly and is re-armed
            self._handle.cancel()
        self._at = deadline
        self._handle = self._loop.call_at(deadline, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        """Cancel, and let go of ``on_tick`` for good: it usually refers to the
        owner of this timer (a reference cycle, which only the cyclic
        collector would free), and a finished stream has no deadline left."""
        self.cancel()
        self._on_tick = _no_tick

    def _fire(self) -> None:
        self._handle = None
        # call_at may run a hair before its time; the core must see the deadline reached.
        self._on_tick(max(self._loop.time(), self._at))


@dataclass(frozen=True, slots=True)
class ResumeEntry:
    """What the resume rules say of one request (:func:`enter_resume`)."""

    owner: str
    """The caller's hash: the owner of the stream this request opens."""
    replay: ResumeFrom | None = None
    """Serve this stored stream instead of calling an upstream."""
    reconnect: bool = False
    """The replay is a reconnect (``Last-Event-ID``, ``GET /v1/streams/…``), not an idempotent repeat."""
    refusal: WireError | None = None
    """Answer with this error (feed the core ``Rejected``)."""
    opened: bool = False
    """This request's stream is open in the store already."""
    cancel: CancelStream | None = None
    """Stop this (caller's own) stream and answer so (:func:`answer_cancel`)."""


def needs_body(method: str, headers: Sequence[Header]) -> bool:
    """Whether :func:`enter_resume` needs the request body (an idempotency key is bound to it)."""
    return method == "POST" and any(name.lower() == b"idempotency-key" for name, _ in headers)


async def enter_resume(store: ReplayStore, caller_key: CallerKey, *, method: str, path: str,
                       headers: Sequence[Header], body: bytes, stream_id: str,
                       open_now: bool, query: str = "") -> ResumeEntry:
    """Classify a request for resume and admit it against the store.

    ``path``: the target without its query (``query``); ``body``: the whole body when
    :func:`needs_body` says so; ``stream_id``: the id this request's own
    stream gets if it generates; ``open_now``: open that stream in the store
    now whatever the request is (else only for an idempotent request, and the
    driver opens it once the answer turns out to be an event stream).
    """
    owner = caller_key.owner(headers)
    try:
        route = classify(method, path, headers, body, query)
        source = await admit(store, route, stream_id=stream_id, owner=owner, open_now=open_now)
    except WireError as error:
        return ResumeEntry(owner, refusal=error)
    except StoreUnavailable as outage:  # its own name: compiled, one name keeps one type
        # An ordinary request still gets its answer; only its resume is lost
        # (said once a while, not once a request: store_outages.py).
        STORE_OUTAGES.not_resumable(stream_id, outage)
        return ResumeEntry(owner)
    if isinstance(source, CancelStream):
        return ResumeEntry(owner, cancel=source)
    if source is not None:
        return ResumeEntry(owner, replay=source, reconnect=isinstance(route, ResumeFrom))
    return ResumeEntry(owner, opened=open_now or isinstance(route, Idempotent))


async def replay(store: ReplayStore, source: ResumeFrom, *, readable: asyncio.Event,
                 feed: Callable[[Input], None]) -> None:
    """Serve ``source`` from the store through a fresh core: ``ReplaySource``
    first, then the stored frames and the live tail as its upstream. Waits
    while ``readable`` is clear (the core's ``PauseUpstream``)."""
    feed(ReplaySource(source.stream_id, source.after_seq))
    await feed_replay(store, source.stream_id, source.after_seq, readable=readable, feed=feed)


# A Responses cancel answers with the response's status (OpenAI's object shape).
_RESPONSE_STATUS: Final = {EndReason.COMPLETE: "completed", EndReason.CANCELLED: "cancelled"}


async def answer_cancel(store: ReplayStore, cancel: CancelStream, *, stop_writer: Callable[[str], bool],
                        feed: Callable[[Input], None]) -> None:
    """Stop the caller's stream ``cancel.stream_id`` and feed a fresh core the answer.

    ``stop_writer(stream_id)`` feeds ``StopRequested(CANCELLED)`` to this
    process's writer of the stream and says whether there was one: its
    upstream is aborted at once (in the resume grace too) and its core ends
    the stored stream with the in-band ``cancelled`` error, which every reader
    of it reads next; the stored part stays until ``resume_ttl_s``, so a
    reconnect learns of the cancel. A stream that had already ended is
    forgotten now (there is nothing to stop; the caller is done with it). A
    live stream written by another process sharing the store is stopped there
    (``store.relay_cancel``); one whose writer died (``store.writer_lapsed``) is over, and forgotten as
    an ended one; one that no live process stopped is refused with 409
    (``stream_elsewhere``): only its writer can stop its upstream."""
    stream_id = cancel.stream_id
    try:
        stopped, reason = (True, None) if stop_writer(stream_id) else await _stop_elsewhere(store, stream_id)
        if stopped:
            status = "cancelled"
        elif reason is not None:
            await store.discard(stream_id)
            status = _RESPONSE_STATUS.get(reason, "failed") if cancel.alias else "ended"
        else:
            feed(Rejected(stream_elsewhere(stream_id)))
            return
    except StoreUnavailable as error:
        STORE_OUTAGES.note(error)
        feed(Rejected(store_unavailable()))
        return
    body = ({"id": cancel.alias, "object": "response", "status": status} if cancel.alias
            else {"id": stream_id, "object": "stream", "status": status})
    data = json.dumps(body).encode()
    feed(UpstreamHeaders(200, ((b"content-type", b"application/json"),
                               (b"content-length", str(len(data)).encode()))))
    feed(UpstreamData(data))
    feed(UpstreamEnded())


async def _stop_elsewhere(store: ReplayStore, stream_id: str) -> tuple[bool, EndReason | None]:
    """A stream this process does not write: (stopped by the process that does,
    how it ended if it had ended). Its end is read once, and again only after a
    relay no process answered (it may have ended meanwhile); then a writer that
    died counts as the stream's end (``WORKER_LOST``: it never goes on)."""
    reason = await store.end_reason(stream_id)
    if reason is not None:
        return False, reason
    if await store.relay_cancel(stream_id):
        return True, None
    reason = await store.end_reason(stream_id)
    if reason is None:
        if await store.writer_lapsed(stream_id):
            return False, EndReason.WORKER_LOST
        reason = await store.end_reason(stream_id)  # it may have ended while the lease was looked at
    return False, reason


async def wait_for_reader(store: ReplayStore, action: AwaitReader, now: float) -> bool:
    """``AwaitReader``: True if a reader attached before ``action.until``
    (then feed the core ``ReaderAttached``)."""
    return await store.wait_reader(action.stream_id, max(action.until - now, 0.0))
