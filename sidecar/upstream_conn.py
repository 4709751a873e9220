"""httpcore's plain-HTTP/1.1 connection, with less work around it.

Theory of operation
-------------------
httpcore's stock connection, ``AsyncHTTPConnection``, is a wrapper that
connects on the first request and then hands every request to an
``AsyncHTTP11Connection`` (or HTTP/2); it holds an anyio lock around each
request, and the HTTP/1.1 connection holds another one twice per request (its
state change at the start and at the end). anyio's ``Lock.acquire`` yields to
the event loop every time, even uncontended (a ``sleep(0)`` inside a shielded
cancel scope): three extra loop turns, each resuming the request's whole
coroutine stack, per upstream request. None of those locks is ever contended
here: the pool (:mod:`~tokenwire.sidecar.upstream_pool`) gives a connection
to one request at a time, so the wrapper's lock only orders a connect that
nobody else waits for, and the state lock is taken by one request's start
and, later, its end.

For a plain ``http://`` or ``unix:`` pod, :func:`open_connection` makes an
:class:`UpstreamConnection` instead: the same connect (the pool's network
backend, the request's ``connect`` timeout, no retries: the sidecar's pools
have none) and then httpcore's own ``AsyncHTTP11Connection`` (the request head
through h11, the response head through h11, keep-alive and expiry as httpcore
keeps them), whose state lock is an ``asyncio.Lock``: uncontended, it is taken
and released without a loop turn. Two more things change there: the request's
headers are checked by h11's rules in one pass
(:mod:`~tokenwire.sidecar.header_fields`), and a chunked body the sidecar read
itself is ended by handing h11 its last chunk directly
(:data:`CHUNKED_BODY_READ`). ``https://`` pods keep httpcore's own connection
(TLS, ALPN).

The connection answers the pool's questions (``is_available``, ``is_idle``...)
as httpcore's wrapper does.
"""

from __future__ import annotations

import asyncio
import ssl

import h11
import httpcore

from .header_fields import fields_valid

CHUNKED_BODY_READ = "tokenwire.chunked_body_read"
"""The response extension (a no-argument callable) a plain HTTP/1.1 connection
adds: the sidecar read the chunked body to its last chunk itself
(:mod:`~tokenwire.sidecar.upstream_body`); h11 is told the response ended
there, without reading it through httpcore's body iterators."""

# What h11 reads in place of the chunked body the sidecar read itself.
_LAST_CHUNK = b"0\r\n\r\n"


def open_connection(origin: httpcore.Origin, backend: httpcore.AsyncNetworkBackend, *, uds: str | None,
                    keepalive_expiry_s: float | None,
                    ssl_context: ssl.SSLContext | None = None) -> httpcore.AsyncConnectionInterface:
    """A new, unconnected connection to ``origin`` for the pool: an
    :class:`UpstreamConnection` for plain HTTP, httpcore's own otherwise."""
    if origin.scheme == b"http":
        return UpstreamConnection(origin, backend, uds=uds, keepalive_expiry=keepalive_expiry_s)
    return httpcore.AsyncHTTPConnection(origin=origin, ssl_context=ssl_context,
                                        keepalive_expiry=keepalive_expiry_s, uds=uds, network_backend=backend)


class _LeanHTTP11Connection(httpcore.AsyncHTTP11Connection):
    """httpcore's HTTP/1.1 connection with an ``asyncio.Lock`` as its state lock
    (see the module docstring: uncontended, it never yields), the request's
    headers checked in one pass, and the end of a chunked body the sidecar
    read itself handed to h11 directly."""

    def __init__(self, origin: httpcore.Origin, stream: httpcore.AsyncNetworkStream,
                 keepalive_expiry: float | None) -> None:
        super().__init__(origin=origin, stream=stream, keepalive_expiry=keepalive_expiry)
        self._state_lock = asyncio.Lock()  # type: ignore[assignment]

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        response = await super().handle_async_request(request)
        response.extensions[CHUNKED_BODY_READ] = self._chunked_body_read
        return response

    async def _send_request_headers(self, request: httpcore.Request) -> None:
        # httpcore's, with the headers checked in two matches (header_fields)
        # where h11 would check each one twice; h11 still checks the method,
        # the target, Host and the framing headers, and writes the head.
        timeout = request.extensions.get("timeout", {}).get("write", None)
        try:
            event = h11.Request(method=request.method, target=request.url.target, headers=request.headers,
                                _parsed=fields_valid(request.headers))
        except h11.LocalProtocolError as error:
            raise httpcore.LocalProtocolError(error) from error
        await self._send_event(event, timeout=timeout)

    def _chunked_body_read(self) -> None:
        # What httpcore's body iteration would do with the bare last chunk
        # (upstream_io's end_body) through four nested async generators:
        # h11 reads it and ends the response, so closing it pools the connection.
        self._h11_state.receive_data(_LAST_CHUNK)
        self._h11_state.next_event()


class UpstreamConnection(httpcore.AsyncConnectionInterface):
    """One plain HTTP/1.1 upstream connection: connects on its first request,
    then serves the pool's requests one at a time through httpcore's
    ``AsyncHTTP11Connection``."""

    def __init__(self, origin: httpcore.Origin, backend: httpcore.AsyncNetworkBackend, *,
                 uds: str | None, keepalive_expiry: float | None) -> None:
        self._origin = origin
        self._backend = backend
        self._uds = uds
        self._keepalive_expiry = keepalive_expiry
        self._connection: httpcore.AsyncHTTP11Connection | None = None
        self._connect_failed = False

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        if request.url.origin != self._origin:
            raise RuntimeError(f"Attempted to send request to {request.url.origin} "
                               f"on connection to {self._origin}")
        connection = self._connection
        if connection is None:
            try:
                stream = await self._connect(request)
            except BaseException:
                self._connect_failed = True
                raise
            connection = self._connection = _LeanHTTP11Connection(self._origin, stream,
                                                                         self._keepalive_expiry)
        return await connection.handle_async_request(request)

    async def _connect(self, request: httpcore.Request) -> httpcore.AsyncNetworkStream:
        timeouts = request.extensions.get("timeout", {})
        timeout = timeouts.get("connect", None)
        if self._uds is not None:
            return await self._backend.connect_unix_socket(self._uds, timeout=timeout)
        return await self._backend.connect_tcp(self._origin.host.decode("ascii"), self._origin.port,
                                               timeout=timeout)

    def can_handle_request(self, origin: httpcore.Origin) -> bool:
        return origin == self._origin

    async def aclose(self) -> None:
        if self._connection is not None:
            await self._connection.aclose()

    def is_available(self) -> bool:
        # Connecting, or failed: no other request may have it (HTTP/1.1 only).
        return self._connection is not None and self._connection.is_available()

    def has_expired(self) -> bool:
        return self._connect_failed if self._connection is None else self._connection.has_expired()

    def is_idle(self) -> bool:
        return self._connect_failed if self._connection is None else self._connection.is_idle()

    def is_closed(self) -> bool:
        return self._connect_failed if self._connection is None else self._connection.is_closed()

    def info(self) -> str:
        if self._connection is None:
            return "CONNECTION FAILED" if self._connect_failed else "CONNECTING"
        return self._connection.info()

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} [{self.info()}]>"
