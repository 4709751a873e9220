"""An exchange's one upstream attempt at a time: the pod's grant, the attempt's launch, cut and end.

Theory of operation
-------------------
The wire core numbers attempts (``RetryUpstream``); which pod each goes to is
the balancer's pick. An :class:`AttemptSlot` holds what the exchange knows of
the current one:

* **grant**: :meth:`AttemptSlot.start` asks the pools for a pod other than
  those this request already failed on; the answer may come at once or later,
  from the wait queue, and a refusal is the core's ``Rejected``. The grant is
  handed back (:meth:`release`) when the attempt ends, is replaced, or the
  exchange finishes.
* **launch**: the attempt runs as a task
  (:func:`~tokenwire.sidecar.upstream.attempt.run_attempt`); its reports and
  body reads reach the exchange only while it is the current one (a dropped
  attempt's late reads must not reach the core).
* **pod reports**: how the attempt went before its first byte is told to the
  balancer once, by the balancer's own rule of what counts as a pod's failure
  (:mod:`tokenwire.sidecar.balance.verdicts`).
* **cut and abort**: a cut drops the attempt and closes the upstream socket at
  once (a departed client: every upstream is closed before any bookkeeping);
  the abort ends what the cut left (the transport's close, the task's
  cancellation), and times how long the attempt took to end after its cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenwire.middleware import (
    EndReason,
    ErrorCode,
    Input,
    Rejected,
    SlowClientPolicy,
    UpstreamError,
    UpstreamFailed,
    UpstreamHeaders,
)

from ..balance import Refusal, verdicts
from ..context import SidecarContext
from ..upstream.attempt import run_attempt
from ..upstream.body import ChunkDelivery
from ..upstream.pools import Grant
from ..upstream.transport import UpstreamStream

if TYPE_CHECKING:
    from .loop import Exchange


class AttemptSlot:
    """The current upstream attempt of one exchange (or the replay task in its place)."""

    def __init__(self, exchange: Exchange, context: SidecarContext, loop: asyncio.AbstractEventLoop) -> None:
        self.exchange: Exchange | None = exchange
        """The exchange the attempt's reads and reports go to; None once it
        finished (:meth:`detach`: the two must not hold each other past the
        end, or every stream would wait for the cyclic collector)."""
        self._context = context
        self._loop = loop
        self.task: asyncio.Task[None] | None = None
        """The attempt's task (or the resumable start's); None between attempts."""
        self.readable = asyncio.Event()
        """Cleared while the core wants the upstream paused."""
        self.address = ""
        """The pod of the current (or last) attempt; empty before one was given."""
        self._connection: object | None = None
        self._grant: Grant | None = None
        self._reported = False
        self._tried: set[str] = set()
        self._waiting_for_pod = False
        # An attempt cut() dropped, and its connection, for abort() to end.
        self._cut: tuple[asyncio.Task[None] | None, object | None] = (None, None)
        self._cut_at = 0.0
        # A departed client's cut attempt, not yet timed (cut()'s watch).
        self._unwatched: asyncio.Task[None] | None = None

    def detach(self) -> None:
        """The exchange finished: nothing more reaches it from here."""
        self.exchange = None

    def exchange_for(self, attempt: asyncio.Task[None]) -> Exchange | None:
        """The exchange, while ``attempt`` is the current one (not dropped, not
        replaced) and the exchange has not finished; else None."""
        return self.exchange if attempt is self.task else None

    # ------------------------------------------------------------ grant

    def start(self) -> None:
        """Ask the balancer for a pod for the next attempt; meanwhile the
        core's deadlines run as for a slow upstream (its commit, then heartbeats)."""
        self.release()
        exchange = self.exchange
        if exchange is None:
            return
        answer = self._context.pools.request(self, body=exchange.body, exclude=frozenset(self._tried),
                                             on_answer=self._pod_answer)
        if answer is None:
            self._waiting_for_pod = True
        else:
            self._pod_answer(answer)

    def _pod_answer(self, answer: Grant | Refusal) -> None:
        self._waiting_for_pod = False
        exchange = self.exchange
        if isinstance(answer, Refusal):
            if exchange is not None:
                exchange.feed(Rejected(UpstreamError(answer.message, ErrorCode.UPSTREAM_UNAVAILABLE,
                                                     http_status=503, retry_after_s=answer.retry_after_s)))
            return
        if exchange is None or exchange.over:
            self._context.pools.release(answer)
            return
        self._grant = answer
        self._reported = False
        self._tried.add(answer.address)
        self.address = answer.address
        self._launch(answer)

    def release(self) -> None:
        """Hand the pod back (or leave the wait queue)."""
        if self._waiting_for_pod:
            self._waiting_for_pod = False
            self._context.pools.cancel(self)
        grant, self._grant = self._grant, None
        if grant is not None:
            self._context.pools.release(grant)

    def report(self, *, ok: bool) -> None:
        """Tell the balancer how the attempt went before its first byte (once)."""
        if self._grant is not None and not self._reported:
            self._reported = True
            self._context.pools.report(self._grant, ok)

    def aborted(self, reason: EndReason) -> None:
        """The core aborted the attempt: a failure of the pod's where the balancer says so."""
        if verdicts.abort_is_pod_failure(reason):
            self.report(ok=False)
        self.abort()

    def retry(self) -> None:
        """The core asked for another attempt: this one failed on its pod."""
        self.report(ok=False)
        self.abort()
        self.start()

    # ------------------------------------------------------------ launch

    def _launch(self, grant: Grant) -> None:
        exchange = self.exchange
        assert exchange is not None  # _pod_answer launches only for one
        self.readable.set()
        callbacks = _AttemptBody(self)
        self._connection = None
        attempt = self._loop.create_task(run_attempt(
            grant.upstream, method=exchange.method, target=exchange.target,
            headers=exchange.upstream_headers, body=exchange.body, timeouts=self._context.pools.timeouts,
            readable=self.readable, feed=callbacks.feed, on_connection=callbacks.connected,
            feed_body=callbacks))
        self.task = callbacks.attempt = attempt
        attempt.add_done_callback(callbacks.release)

    def attempt_feed(self, attempt: asyncio.Task[None], event: Input) -> None:
        """An attempt's report: to the balancer before its first byte, then to the core."""
        if attempt is self.task:
            if not self._reported:
                if isinstance(event, UpstreamHeaders):
                    self.report(ok=verdicts.head_is_pod_success(event.status))
                elif isinstance(event, UpstreamFailed):
                    self.report(ok=False)
            exchange = self.exchange
            if exchange is not None:
                exchange.feed(event)

    def attempt_connected(self, attempt: asyncio.Task[None], stream: object) -> None:
        if attempt is self.task:
            self._connection = stream
            exchange = self.exchange
            if isinstance(stream, UpstreamStream) and exchange is not None:
                config = exchange.stream.config  # the request's own (Tokenwire-Slow-Client-Policy)
                if config.slow_client_policy is SlowClientPolicy.BLOCK:
                    stream.cap_receive_buffer(config.block_window_bytes)

    def pause(self) -> None:
        self.readable.clear()
        if isinstance(self._connection, UpstreamStream):
            self._connection.pause_delivery()

    def resume(self) -> None:
        self.readable.set()
        if isinstance(self._connection, UpstreamStream):
            self._connection.resume_delivery()

    # ------------------------------------------------------------ cut and abort

    def abort(self) -> None:
        """End the attempt: its pod handed back, its socket closed, its task cancelled."""
        self.release()
        self.cut()
        attempt, connection = self._cut
        self._cut = (None, None)
        unwatched, self._unwatched = self._unwatched, None
        if unwatched is not None:
            # Cut for a departed client, its reading paused: it seldom ends before
            # this runs (if it did, its end is timed when its callback runs).
            self._watch(unwatched)
        if isinstance(connection, UpstreamStream):
            connection.abort()
        # The attempt may be the task running this very code (the input that
        # made the core abort came from it): cancel() still works then, at its
        # next await.
        if attempt is not None and not attempt.done():
            attempt.cancel()

    def cut(self, watch: bool = True) -> None:
        """Drop the current attempt: its reports no longer reach the core, and
        the upstream sees its socket closed now (``UpstreamStream.cut``); the
        transport's close and the task's cancellation are left to
        :meth:`abort`. ``watch``: time the attempt's end for the
        ``abort_propagation`` metric now; else :meth:`abort` does
        (a departed client's cut does nothing it can leave for later)."""
        attempt, self.task = self.task, None
        connection, self._connection = self._connection, None
        if attempt is None:
            return
        if attempt.done():
            self._cut = (attempt, None)
            return
        self._cut = (attempt, connection)
        if isinstance(connection, UpstreamStream):
            connection.cut()
        else:
            # Still connecting (or not started): cancelled now, before it can
            # reach the upstream (a stream reset in the read that opened it).
            attempt.cancel()
            watch = True  # it may end before the bookkeeping: timed from now
        self._cut_at = self._loop.time()
        if watch:
            self._watch(attempt)
        else:
            self._unwatched = attempt

    def _watch(self, attempt: asyncio.Task[None]) -> None:
        """Observe, when ``attempt`` ends, how long it took since its cut."""
        started_at = self._cut_at
        histogram = self._context.metrics.abort_propagation
        clock: Callable[[], float] = self._loop.time

        def closed(task: asyncio.Task[None]) -> None:
            histogram.observe(clock() - started_at)

        attempt.add_done_callback(closed)


class _AttemptBody(ChunkDelivery):
    """An attempt's reports (``feed``, ``connected``) and body reads, for its
    slot while the attempt is the current one.

    Released once the attempt's task is done: a task that ended in an
    exception (a cancelled one) keeps its traceback, whose frames keep their
    arguments, these callbacks among them; holding the exchange and the task
    past that would be a reference cycle, and every aborted stream's objects
    would wait for the cyclic collector instead of being freed at once."""

    def __init__(self, slot: AttemptSlot) -> None:
        self.slot: AttemptSlot | None = slot
        self.attempt: asyncio.Task[None] | None = None

    def release(self, task: asyncio.Task[None]) -> None:
        self.slot = None
        self.attempt = None

    def feed(self, event: Input) -> None:
        slot, attempt = self.slot, self.attempt
        if slot is not None and attempt is not None:
            slot.attempt_feed(attempt, event)

    def connected(self, stream: object) -> None:
        slot, attempt = self.slot, self.attempt
        if slot is not None and attempt is not None:
            slot.attempt_connected(attempt, stream)

    def __call__(self, chunks: list[bytes]) -> None:
        slot, attempt = self.slot, self.attempt
        exchange = slot.exchange_for(attempt) if slot is not None and attempt is not None else None
        if exchange is not None:
            exchange.feed_chunks(chunks)

    def framed_chunk(self, data: bytes, framed: bytes) -> None:
        slot, attempt = self.slot, self.attempt
        exchange = slot.exchange_for(attempt) if slot is not None and attempt is not None else None
        if exchange is not None:
            exchange.feed_framed_chunk(data, framed)
