"""The connections to one upstream pod: httpcore's connections, O(1) work per request.

Theory of operation
-------------------
httpcore's ``AsyncConnectionPool`` serves any origin, so whenever a request
starts or a response is closed it re-examines every connection it holds (and,
for each idle one, counts them all again): with 200 streams open, a cProfile
of a burst put ~40 % of the sidecar's per-stream time in that bookkeeping
(``bench/README.md``, "The upstream pool"). A pod is one origin, and the sidecar
needs less:

- idle connections on a stack, the most recently used on top (warm, and the
  least likely to have been closed by the pod meanwhile); the bottom, the
  oldest, is checked for expiry whenever the stack is touched, so connections
  left idle are dropped without a scan;
- a count of connections (open or being opened) bounded by
  ``max_connections``; a request beyond it waits, first come first served, at
  most its ``pool`` timeout (``httpcore.PoolTimeout``, as httpcore's pool);
- a request takes the top idle connection that is still usable (expired or
  closed ones are closed and dropped), else opens one, else waits. When its
  response is closed, the connection goes back on the stack if it is idle again
  (read to its end, kept alive), or is dropped; either way the first waiting
  request is handed what was freed: the connection itself, or its place.

Everything per connection stays httpcore's: its HTTP/1.1 connection (for a
plain ``http://`` pod in the leaner wrapper of
:mod:`~tokenwire.sidecar.upstream_conn`, else ``httpcore.AsyncHTTPConnection``)
connects (through :class:`~tokenwire.sidecar.upstream_io.UpstreamBackend`),
speaks TLS and HTTP/1.1, decides keep-alive and expiry; the pool only keeps
them. The interface is the part of ``AsyncConnectionPool`` the sidecar uses:
:meth:`handle_async_request`, :meth:`aclose`, :attr:`connections`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import typing

import httpcore

from .tasks import spawn
from .upstream_conn import open_connection

# httpcore's connection interface: what the pool keeps (upstream_conn.open_connection).
Connection = httpcore.AsyncConnectionInterface

# A closed pool refuses requests the way httpcore's network layer refuses a closed socket.
_POOL_CLOSED = "the upstream pool is closed"


class UpstreamPool:
    """Connections to one origin, at most ``max_connections`` (see the module docstring)."""

    def __init__(self, *, max_connections: int, keepalive_expiry_s: float | None,
                 network_backend: httpcore.AsyncNetworkBackend, uds: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._max_connections = max_connections
        self._keepalive_expiry_s = keepalive_expiry_s
        self._backend = network_backend
        self._uds = uds
        self._ssl_context = ssl_context
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._count = 0  # connections open, being opened, or promised to a waiting request
        # A waiting request is handed an idle connection, or None: a place to open one.
        self._waiters: collections.deque[asyncio.Future[Connection | None]] = (
            collections.deque())
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def connections(self) -> list[Connection]:
        """Every connection, busy ones first (httpcore's pool has the same property)."""
        return [*self._busy, *self._idle]

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        """Send ``request`` on a pooled or new connection; the response's close
        gives the connection back."""
        timeouts = request.extensions.get("timeout", {})
        while True:
            connection = await self._acquire(request.url.origin, timeouts.get("pool"))
            try:
                response = await connection.handle_async_request(request)
            except httpcore.ConnectionNotAvailable:
                self._give_back(connection)  # it closed before it could take the request: another
                continue
            except BaseException:
                self._give_back(connection)
                raise
            assert isinstance(response.stream, typing.AsyncIterable)  # an async connection's
            return httpcore.Response(status=response.status, headers=response.headers,
                                     content=_PooledStream(response.stream, self, connection),
                                     extensions=response.extensions)

    async def aclose(self) -> None:
        """Close every connection; waiting and later requests fail with ``ConnectError``."""
        self._closed = True
        connections = self.connections
        self._idle.clear()
        self._busy.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(httpcore.ConnectError(_POOL_CLOSED))
        self._waiters.clear()
        for connection in connections:
            await connection.aclose()

    def __repr__(self) -> str:
        queued = sum(not waiter.done() for waiter in self._waiters)
        return (f"<UpstreamPool [Requests: {len(self._busy)} active, {queued} queued | "
                f"Connections: {len(self._busy)} active, {len(self._idle)} idle]>")

    async def _acquire(self, origin: httpcore.Origin, timeout_s: float | None,
                       ) -> Connection:
        if self._closed:
            raise httpcore.ConnectError(_POOL_CLOSED)
        self._drop_expired_bottom()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.is_closed() or connection.has_expired():
                self._count -= 1
                await connection.aclose()
                continue
            self._busy.add(connection)
            return connection
        if self._count < self._max_connections and not self._waiting():
            self._count += 1
            return self._open(origin)
        handed = await self._wait(timeout_s)
        if handed is None:
            return self._open(origin)  # a place, counted by whoever freed it
        self._busy.add(handed)
        return handed

    def _open(self, origin: httpcore.Origin) -> Connection:
        connection = open_connection(origin, self._backend, uds=self._uds,
                                     keepalive_expiry_s=self._keepalive_expiry_s,
                                     ssl_context=self._ssl_context)
        self._busy.add(connection)
        return connection

    def _waiting(self) -> bool:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        return bool(self._waiters)

    async def _wait(self, timeout_s: float | None) -> Connection | None:
        waiter: asyncio.Future[Connection | None] = (
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
                raise httpcore.PoolTimeout(
                    f"no upstream connection free within {timeout_s:g} s "
                    f"({self._max_connections} in use)") from None
            raise

    def _give_back(self, connection: Connection) -> None:
        """``connection``'s request is over: keep it if it is idle again, else free its place."""
        self._busy.discard(connection)
        if self._closed:
            return
        if connection.is_closed():
            self._pass_on(None)  # httpcore closed it: not kept alive, or it failed
        elif connection.is_idle() and not connection.has_expired():
            self._pass_on(connection)
        else:
            self._close_soon(connection)
            self._pass_on(None)
        self._drop_expired_bottom()

    def _pass_on(self, freed: Connection | None) -> None:
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
        they are closed or expired: O(1) per call, amortised."""
        idle = self._idle
        while idle and (idle[0].is_closed() or idle[0].has_expired()):
            self._count -= 1
            self._close_soon(idle.pop(0))

    def _close_soon(self, connection: Connection) -> None:
        # Closing an HTTP/1.1 connection closes its socket, no I/O to wait for,
        # but httpcore's aclose is a coroutine: a task, kept until done (the
        # loop holds only weak references to tasks).
        spawn(self._closing, connection.aclose())


class _PooledStream:
    """A response body that gives its connection back to the pool when closed."""

    def __init__(self, stream: typing.AsyncIterable[bytes], pool: UpstreamPool,
                 connection: Connection) -> None:
        self._stream = stream
        self._pool = pool
        self._connection: Connection | None = connection

    def __aiter__(self) -> typing.AsyncIterator[bytes]:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        connection = self._connection
        if connection is None:
            return
        self._connection = None
        try:
            close = getattr(self._stream, "aclose", None)
            if close is not None:
                await close()
        finally:
            self._pool._give_back(connection)
