"""One proxied request: the driver loop around a :class:`WireStream`.

Theory of operation
-------------------
An :class:`Exchange` exists from the moment a client request (head and whole
body) has been read until the wire core says ``Finished``. It is the loop of
three steps the sans-IO style asks for:

1. something happened (an upstream chunk, the socket paused, a timer fired,
   the client left): turn it into a wire-core input and ``feed`` it;
2. execute the actions the core returns, in order;
3. write ``data_to_send()`` to the client and report ``WriteCompleted``.

It decides nothing: heartbeats, deadlines, retries, coalescing and errors are
all the core's. Inputs that arrive while the loop is running (``transport.write``
may call ``pause_writing`` synchronously) are queued and handled right after,
so the core never sees re-entrant calls.

The client side is reached through :class:`Downstream` (the connection), the
upstream side through the exchange's :class:`~tokenwire.sidecar.exchange.slot.AttemptSlot`:
one attempt at a time, its pod the balancer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from tokenwire.middleware import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    Finished,
    Input,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ResumeUpstream,
    RetryUpstream,
    StreamRecord,
    Tick,
    UpstreamData,
    WireStream,
    WriteCompleted,
)
from tokenwire.middleware.core import client_settings
from tokenwire.middleware.core.dialects import Dialect
from tokenwire.middleware.core.resume import new_stream_id
from tokenwire.middleware.core.retry import may_repeat
from tokenwire.middleware.process.logs import wall_clock
from tokenwire.middleware.shared.driver import (
    DeadlineTimer,
    answer_cancel,
    enter_resume,
    replay,
    wait_for_reader,
)

from ..context import SidecarContext
from ..process.metrics import REPLAY_UPSTREAM
from .forwarding import client_response_headers
from .milestones import Milestones, open_span, request_fields
from .slot import AttemptSlot

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# One instance serves every departure: no constructor call on the path to each cut.
_CLIENT_GONE: Final = ClientGone()

class Downstream(Protocol):
    """What an exchange needs from the client connection."""

    def send_headers(self, status: int, headers: Sequence[Header]) -> None: ...

    def send_body(self, data: bytes) -> None: ...

    def end_response(self, *, abrupt: bool, reset: bool) -> None: ...

    def exchange_finished(self, exchange: Exchange) -> None: ...

    def closing_probe(self) -> Callable[[], bool] | None:
        """A call that says whether the loop already saw the client go (a
        reset read, a write that failed) while its ``connection_lost`` has not
        run yet (HTTP/1.1: the transport's ``is_closing``); None where a
        departure reaches the exchange as it is read (HTTP/2)."""
        ...


class Exchange:
    """Drives one :class:`WireStream` between a client connection and the upstreams."""

    def __init__(
        self,
        context: SidecarContext,
        downstream: Downstream,
        *,
        request_id: str,
        upstream_request_id: str | None = None,
        method: bytes,
        target: bytes,
        upstream_headers: Sequence[Header],
        body: bytes,
        expect_stream: bool,
        http_version: str = "1.1",
        client_address: str = "",
        dialect: Dialect | None = None,
        hide_usage_chunk: bool = False,
        frames: frozenset[str] = frozenset(),
    ) -> None:
        self._context = context
        self._downstream = downstream
        # Looked at after each upstream read's write (feed_chunks): one call, no dispatch.
        self._client_closing = downstream.closing_probe()
        self._loop = asyncio.get_running_loop()
        # The loop's clock, bound once: read on every upstream read.
        self._now = self._loop.time
        self.request_id = request_id
        """The client's id (or one made up for it): logs, the response, the admin list."""
        self.upstream_request_id = upstream_request_id or request_id
        """The upstream's id for this request, and the key of its abort call; never the client's."""
        self.http_version = http_version
        """The client's protocol (``1.1``, ``2``): a label of the stream's metrics, in its record."""
        self.client_address = client_address
        self.method = method
        self.target = target
        self._log_fields = request_fields(method, target, client_address, http_version)
        dialect = dialect if dialect is not None else context.dialects.for_path(target.decode("latin-1"))
        wire, applied, upstream_headers, self._refusal = client_settings.for_request(
            context.config.wire, upstream_headers, body, dialect.name)
        if applied:  # the request's own settings (a refusal is fed as Rejected once started)
            self._log_fields["client_settings"] = applied
        span, traced_headers = open_span(context.tracer, request_id, self._log_fields, upstream_headers)
        self.upstream_headers = traced_headers
        """The request's headers as they go upstream (with the trace context)."""
        self.body = body
        resume = context.config.wire.resume
        self.stream_id = new_stream_id() if resume else None
        self.replaying = False
        """True when this exchange serves a stream from the replay store."""
        self.hands_off = True
        """A drain hands it off (``HandOff``): its client comes back by itself (gRPC's does not)."""
        self._reader_wait: asyncio.Task[None] | None = None
        self.stream = WireStream(
            wire, now=self._loop.time(), request_id=request_id,
            # Each attempt's pod is the balancer's pick: the record gets it at the end (record_as).
            retry_budget=context.retry_budget,
            expect_stream=expect_stream, stream_id=self.stream_id,
            may_repeat=may_repeat(method, self.upstream_headers),
            dialect=dialect, hide_usage_chunk=hide_usage_chunk, frames=frames)
        self._milestones = (Milestones(self.stream, self._log_fields, span)
                           if span is not None or Milestones.wanted() else None)
        self._write_high_water_bytes = wire.write_high_water_bytes
        self._inbox: deque[tuple[Input, float | None]] = deque()
        self._busy = False
        self._done = False
        self._response_ended = False
        self._slot = AttemptSlot(self, context, self._loop)
        # Fed as an input of its own: a Tick must not run inside another input's loop.
        self._timer = DeadlineTimer(self._loop, lambda now: self.feed(Tick(), now))
        # The client left and the upstream was cut; the rest is pending (client_departed).
        self._departed = False
        self.send_framed: Callable[[bytes, bytes], None] | None = None
        """The client connection's write of a chunk the upstream framed as the client's
        are (``send_framed(data, framed)`` writes ``framed`` where ``send_body(data)``
        would write those very bytes), set by a connection that frames its chunks so
        (HTTP/1.1); None: every read goes through ``send_body``."""

    # ------------------------------------------------------------ public

    def start(self) -> None:
        """Register the stream and send the first upstream request."""
        self._context.registry.add(self)
        if self._milestones is not None:
            self._milestones.accepted(self.stream_id)
        if self._refusal is not None:
            self.feed(Rejected(self._refusal))
            return
        if self._context.replay_store is None:
            self._slot.start()
        else:
            self._slot.task = self._loop.create_task(self._start_resumable())
        self._reschedule()

    @property
    def departed(self) -> bool:
        """The client left, the upstream was cut, and the rest of the stream's
        end waits in :class:`~tokenwire.sidecar.exchange.departures.Departures`."""
        return self._departed

    @property
    def over(self) -> bool:
        """Finished, or departed with its end pending: no new attempt may start."""
        return self._done or self._departed

    @property
    def upstream_address(self) -> str:
        """The pod of the current (or last) attempt; empty before one was given."""
        return self._slot.address

    def feed(self, event: Input, now: float | None = None) -> None:
        """Hand the core one input (queued if the loop is already running)."""
        if self._done:
            return
        self._inbox.append((event, now))
        if self._busy:
            return
        self._busy = True
        self._run_inbox()

    def _run_inbox(self) -> None:
        """Hand the core what the inbox holds, in order (``_busy`` is set)."""
        try:
            while self._inbox and not self._done:
                queued, at = self._inbox.popleft()
                at = self._loop.time() if at is None else at
                self._execute(self.stream.handle(queued, at))
                self._flush()
        except Exception:
            self._crash()
        self._busy = False
        self._reschedule()

    def client_departed(self) -> None:
        """The client left (its connection closed or reset, or its HTTP/2
        stream was reset). Where the core would abort the upstream for it
        (``WireStream.departure_aborts_upstream``), the upstream's socket is
        closed now and the rest waits in
        :class:`~tokenwire.sidecar.exchange.departures.Departures`: the core's
        ``ClientGone``, stamped with this moment, then the record, metrics,
        log, the pod's release and the attempt's cancellation. So when many
        clients leave at once, every upstream is closed before any of their
        bookkeeping runs, and each close costs the next client's close
        little. Inputs that arrive meanwhile queue behind that ``ClientGone``.
        Otherwise (a stream held for a reconnect, one already over, a core
        busy with another input) the core takes ``ClientGone`` now."""
        if self._done or self._departed:
            return
        if self._busy or self._inbox or not self.stream.departure_aborts_upstream():
            self.feed(_CLIENT_GONE)
            return
        self._departed = True
        self._busy = True  # what arrives meanwhile queues behind the departure
        self._slot.cut(watch=False)
        self._inbox.append((_CLIENT_GONE, self._loop.time()))
        self._context.departures.defer(self._run_inbox)

    def feed_chunks(self, chunks: list[bytes]) -> None:
        """The upstream body chunks of one socket read, in order. Each is one
        input of the core; while the client keeps up, the core's one-call path
        (``forward_read``) answers each with the bytes to write, and those of
        one read go to the socket in one write (flushed early past the write
        high-water mark, so the socket still pauses where it would have)."""
        batch: list[bytes] = []
        batched = 0
        high_water = self._write_high_water_bytes
        for data in chunks:
            if not self._busy and not self._done and not self._inbox and not self._response_ended:
                try:
                    out = self.stream.forward_read(data, self._now())
                except Exception:
                    self._crash()
                    return
                if out is not None:
                    batch.append(out)
                    batched += len(out)
                    if batched >= high_water:
                        self._write_batch(batch)
                        batch, batched = [], 0
                    continue
            if batch:
                self._write_batch(batch)
                batch, batched = [], 0
            self.feed(UpstreamData(data))
        if batch:
            self._write_batch(batch)
            self._look_for_departure()
        if self._milestones is not None:
            self._milestones.after((), self._loop.time())

    def _look_for_departure(self) -> None:
        """One look per read, after its write: the loop may have read this
        client's reset earlier in this turn, or the write found it gone."""
        closing = self._client_closing
        if closing is not None and not self._response_ended and closing():
            # The loop reads a turn's sockets (and so delivers the upstream
            # reads, here) before it calls any connection_lost of that turn: a
            # burst of resets read alongside upstream data would otherwise wait
            # for all of it to be forwarded to clients already gone.
            self.client_departed()

    def feed_framed_chunk(self, data: bytes, framed: bytes) -> None:
        """One upstream read that is exactly one chunk: ``data``, framed as
        ``framed`` the way the client's chunks are framed (see
        :class:`~tokenwire.sidecar.upstream.body.ChunkDelivery`). The same as
        ``feed_chunks([data])``, except that when the core's one-call path
        forwards ``data`` unchanged and the client connection can
        (``send_framed``), the read goes to the client as it came: no slice of
        the data and no new frame joined around it."""
        send_framed = self.send_framed
        if send_framed is None or self._busy or self._done or self._inbox or self._response_ended:
            self.feed_chunks([data])
            return
        try:
            out = self.stream.forward_read(data, self._now())
        except Exception:
            self._crash()
            return
        if out is None:
            self.feed(UpstreamData(data))
        else:
            if out is data:
                send_framed(data, framed)
            else:
                self._downstream.send_body(out)
            self._look_for_departure()
        if self._milestones is not None:
            self._milestones.after((), self._loop.time())

    def _write_batch(self, batch: list[bytes]) -> None:
        # A write that fills the socket calls pause_writing → SocketPaused,
        # which the core takes now, before the next chunk, as it would have.
        self._downstream.send_body(batch[0] if len(batch) == 1 else b"".join(batch))

    def live_record(self) -> tuple[StreamRecord, str]:
        """The stream's record as of now and the client's HTTP version (live metrics)."""
        return self.stream.record(self._loop.time(), self._metered_upstream()), self.http_version

    def _metered_upstream(self) -> str:
        """The pod as the metrics label it: the balancer's (the core knows none),
        or ``replay``: a replay's first token comes from the store, and its
        figures must not pass for an engine's."""
        return REPLAY_UPSTREAM if self.replaying else self.upstream_address

    def describe(self, now: float) -> dict[str, Any]:
        """The ``GET /streams`` entry for this stream."""
        stream = self.stream
        return {
            "request_id": self.request_id,
            "upstream_request_id": self.upstream_request_id,
            "upstream": self.upstream_address,
            "age_s": round(now - stream.started_at, 3),
            "state": stream.state.value,
            "pending_bytes": stream.pending_bytes,
            "events_in": stream.events_in,
            "events_out": stream.events_out,
            # Never the stream id: with the caller's credential it is the key to the answer.
            "resumable": self.stream_id is not None,
            "replay": self.replaying,
        }

    # ------------------------------------------------------------ the loop

    def _flush(self) -> None:
        """Write whatever the core has for the socket; report each write at once."""
        while not self._response_ended:
            now = self._loop.time()
            data = self.stream.data_to_send(now)
            if not data:
                return
            self._downstream.send_body(data)
            self._execute(self.stream.handle(WriteCompleted(), now))

    def _execute(self, actions: Sequence[Action]) -> None:
        tell_engine = False
        for action in actions:
            if isinstance(action, CommitHeaders):
                headers = client_response_headers(
                    action.headers, self._context.config.request_id_header.encode(), self.request_id)
                self._downstream.send_headers(action.status, headers)
            elif isinstance(action, AbortUpstream):
                self._slot.aborted(action.reason)
                tell_engine = tell_engine or action.final
            elif isinstance(action, RetryUpstream):
                self._slot.retry()
            elif isinstance(action, PauseUpstream):
                self._slot.pause()
            elif isinstance(action, ResumeUpstream):
                self._slot.resume()
            elif isinstance(action, CloseClient):
                self._response_ended = True
                self._downstream.end_response(abrupt=action.abrupt, reset=action.reset)
            elif isinstance(action, Finished):
                self._finish(action)
            elif isinstance(action, ReplayAppend):
                store = self._context.replay_store
                if store is not None:
                    store.append(action)
            elif isinstance(action, AwaitReader):
                self._reader_wait = self._loop.create_task(self._await_reader(action))
        if tell_engine:
            self._context.pools.send_abort(self.upstream_request_id, self.upstream_address)
        if self._milestones is not None:
            self._milestones.after(actions, self._loop.time())

    def _finish(self, action: Finished) -> None:
        self._done = True
        context = self._context
        context.registry.remove(self)
        self._slot.release()
        # One record, built here (not when the core emitted Finished: see
        # _abort_first), with the balancer's pod in it; a copy only for a replay.
        record = action.record_as(self.upstream_address)
        metered = record if not self.replaying else dataclasses.replace(record, upstream=REPLAY_UPSTREAM)
        context.metrics.observe_record(metered, self.http_version)
        if context.log.enabled:
            extra = {**self._log_fields, "started_at": wall_clock(record.started_at, self._loop.time())}
            if self.upstream_request_id != self.request_id:
                extra["upstream_request_id"] = self.upstream_request_id
            context.log.write(record, **extra)
        self._timer.close()
        if self._reader_wait is not None:
            self._reader_wait.cancel()
        attempt = self._slot.task
        if attempt is not None and not attempt.done():
            cutoff = self._loop.call_later(context.config.wire.upstream_tail_grace_s, attempt.cancel)
            attempt.add_done_callback(lambda _: cutoff.cancel())
        self._slot.detach()
        self._downstream.exchange_finished(self)

    def _crash(self) -> None:
        """A bug in the driver or the core: drop both sides, never hang.
        Called in the ``except`` block that caught it (the log has its traceback)."""
        logger.exception("stream %s: driver failure; resetting the client", self.request_id)
        self._slot.abort()
        if not self._done:
            self._done = True
            self._context.registry.remove(self)
            if not self._response_ended:
                self._response_ended = True
                self._downstream.end_response(abrupt=True, reset=True)
            self._slot.detach()
            self._downstream.exchange_finished(self)

    # ------------------------------------------------------------ timers

    def _reschedule(self) -> None:
        if not self._done:
            self._timer.arm(self.stream.next_deadline())

    # ------------------------------------------------------------ resume

    async def _start_resumable(self) -> None:
        """With resume on: a reconnect replays, an idempotent repeat replays,
        anything else opens its stream in the store and goes upstream."""
        store = self._context.replay_store
        caller_key = self._context.caller_key
        assert store is not None and caller_key is not None and self.stream_id is not None
        # Opened whatever the request looks like: an answer that turns out not
        # to be an event stream is discarded by the core at its end.
        path, _, query = self.target.decode("latin-1").partition("?")
        stop = functools.partial(self._context.registry.stop_writer, reason=EndReason.CANCELLED)
        store.serve_cancels(stop)  # once per process in effect: what other processes pass on
        entry = await enter_resume(
            store, caller_key, method=self.method.decode("latin-1"), path=path, query=query,
            headers=self.upstream_headers, body=self.body, stream_id=self.stream_id, open_now=True)
        if entry.refusal is not None:
            self.feed(Rejected(entry.refusal))
            return
        if entry.cancel is not None:
            await answer_cancel(store, entry.cancel, stop_writer=stop, feed=self.feed)
            return
        if entry.replay is not None:
            # A reconnect, or the same request again (the answer being made, from the start).
            self._context.metrics.replays.labels("reconnect" if entry.reconnect else "idempotent").inc()
            self.replaying = True
            slot = self._slot
            slot.readable.set()
            task = asyncio.current_task()

            def feed_from_replay(event: Input) -> None:
                if task is slot.task:
                    self.feed(event)

            await replay(store, entry.replay, readable=slot.readable, feed=feed_from_replay)
            return
        if self._slot.task is asyncio.current_task():
            self._slot.start()

    async def _await_reader(self, action: AwaitReader) -> None:
        store = self._context.replay_store
        assert store is not None
        if await wait_for_reader(store, action, self._loop.time()):
            self.feed(ReaderAttached())
