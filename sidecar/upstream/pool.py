"""The connections to one upstream pod: O(1) work per request.

Theory of operation
-------------------
A general pool (httpcore's ``AsyncConnectionPool``) serves any origin, so
whenever a request starts or a response is closed it re-examines every
connection it holds: with many streams open that bookkeeping was a large
share of the sidecar's per-stream time (docs/perf/sidecar-http1.md, "The
upstream pool and the collector"). A pod is one origin, and the sidecar needs less:

- idle connections on a stack, the most recently used on top (warm, and the
  least likely to have been closed by the pod meanwhile); the bottom, the
  oldest, is checked whenever the stack is touched, so connections left idle
  past their keep-alive expiry are dropped without a scan;
- a count of connections (open or being opened) bounded by
  ``max_connections``; a request beyond it waits, first come first served, at
  most its pool timeout (``PoolTimedOut``);
- :meth:`UpstreamPool.acquire` takes the top idle connection that is still
  :meth:`~tokenwire.sidecar.upstream.conn.UpstreamConnection.reusable`
  (others are closed and dropped), else makes one (it connects on its first
  request), else waits. :meth:`UpstreamPool.release`, once the request is
  over, keeps the connection if it is reusable, or closes it; either way the
  first waiting request is handed what was freed: the connection itself, or
  its place.

Each connection (:mod:`~tokenwire.sidecar.upstream.conn`) connects, speaks
HTTP/1.1 and TLS, and knows whether it may be reused; the pool only keeps them.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Final

from .conn import Origin, UpstreamConnection
from .errors import ConnectFailed, PoolTimedOut
from .transport import UpstreamBackend

# A closed pool refuses requests the way a refused connect fails.
_POOL_CLOSED: Final = "the upstream pool is closed"


class UpstreamPool:
    """Connections to one pod, at most ``max_connections`` (see the module docstring)."""

    def __init__(self, origin: Origin, *, max_connections: int, keepalive_expiry_s: float | None,
                 backend: UpstreamBackend | None = None) -> None:
        self.origin = origin
        self._max_connections = max_connections
        self._keepalive_expiry_s = keepalive_expiry_s
        self._backend = UpstreamBackend() if backend is None else backend
        self._idle: list[UpstreamConnection] = []
        self._busy: set[UpstreamConnection] = set()
        self._count = 0  # connections open, being opened, or promised to a waiting request
        # A waiting request is handed an idle connection, or None: a place to open one.
        self._waiters: collections.deque[asyncio.Future[UpstreamConnection | None]] = (
            collections.deque())
        self._closed = False

    @property
    def connections(self) -> list[UpstreamConnection]:
        """Every connection, busy ones first."""
        return [*self._busy, *self._idle]

    async def acquire(self, timeout_s: float | None) -> UpstreamConnection:
        """A connection for one request: hand it back with :meth:`release`
        once the request is over, whatever happened."""
        if self._closed:
            raise ConnectFailed(_POOL_CLOSED)
        self._drop_expired_bottom()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.reusable():
                self._count -= 1
                connection.close()
                continue
            self._busy.add(connection)
            return connection
        if self._count < self._max_connections and not self._waiting():
            self._count += 1
            return self._open()
        handed = await self._wait(timeout_s)
        if handed is not None and not handed.reusable():
            handed.close()  # the pod closed it meanwhile: its place is this request's
            handed = None
        if handed is None:
            return self._open()  # a place, counted by whoever freed it
        self._busy.add(handed)
        return handed

    def release(self, connection: UpstreamConnection) -> None:
        """``connection``'s request is over (its :meth:`~UpstreamConnection.finish`
        said whether cleanly): keep it if it may be reused, else close it and
        free its place."""
        self._busy.discard(connection)
        if self._closed:
            connection.close()
            return
        if connection.reusable():
            self._pass_on(connection)
        else:
            connection.close()
            self._pass_on(None)
        self._drop_expired_bottom()

    async def aclose(self) -> None:
        """Close every connection; waiting and later requests fail with ``ConnectError``."""
        self._closed = True
        connections = self.connections
        self._idle.clear()
        self._busy.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ConnectFailed(_POOL_CLOSED))
        self._waiters.clear()
        for connection in connections:
            connection.close()

    def __repr__(self) -> str:
        queued = sum(not waiter.done() for waiter in self._waiters)
        return (f"<UpstreamPool [Requests: {len(self._busy)} active, {queued} queued | "
                f"Connections: {len(self._busy)} active, {len(self._idle)} idle]>")

    def _open(self) -> UpstreamConnection:
        connection = UpstreamConnection(self.origin, self._backend, self._keepalive_expiry_s)
        self._busy.add(connection)
        return connection

    def _waiting(self) -> bool:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        return bool(self._waiters)

    async def _wait(self, timeout_s: float | None) -> UpstreamConnection | None:
        waiter: asyncio.Future[UpstreamConnection | None] = (
            asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except BaseException as error:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a connection or a place just as this request gave up: pass it on.
                self._pass_on(waiter.result())
            else:
                waiter.cancel()
            if isinstance(error, TimeoutError):
                raise PoolTimedOut(
                    f"no upstream connection free within {timeout_s:g} s "
                    f"({self._max_connections} in use)") from None
            raise

    def _pass_on(self, freed: UpstreamConnection | None) -> None:
        """Hand what was freed (an idle connection, or None: a place) to the
        first request still waiting; else keep the connection or free the place."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(freed)
                return
        if freed is None:
            self._count -= 1
        else:
            self._idle.append(freed)

    def _drop_expired_bottom(self) -> None:
        """Drop idle connections from the bottom of the stack (the oldest) while
        they may not be reused: O(1) per call, amortised."""
        idle = self._idle
        while idle and not idle[0].reusable():
            self._count -= 1
            idle.pop(0).close()
