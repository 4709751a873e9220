"""One HTTP/1.1 connection to an upstream pod, spoken by the sidecar itself.

Theory of operation
-------------------
Every upstream request of the sidecar is the same shape (one request, its
body whole, a response whose body the sidecar reads itself), so a general
client is mostly work the sidecar does not need: httpcore's pooled request went
through a ``Request`` and a ``Response`` object, four ``Trace`` contexts,
anyio locks (one loop turn each), h11's state machine writing the request and
parsing the response, and a body iterator stack, ~1 M instructions a request
(``bench/README.md``), against ~60 k for the rest of the stream's set-up
on the upstream side.

An :class:`UpstreamConnection` connects on its first request (TCP or a Unix
socket: pods are ``http://`` or ``unix:``), through
:class:`~tokenwire.sidecar.upstream.transport.UpstreamBackend`.
:meth:`UpstreamConnection.send` writes the request in one ``send()``
(:func:`~tokenwire.sidecar.upstream.head.request_head`) and reads the response
head: 1xx heads are read and dropped, as h11 does, and the head
is parsed by h11's rules (:func:`~tokenwire.sidecar.upstream.head.parse_response_head`).
Whatever came after the head stays buffered in the stream, where the body
readers (:func:`~tokenwire.sidecar.upstream.attempt.run_attempt`) find it. The caller
reads the body and says, with :meth:`UpstreamConnection.finish`, whether the
connection ended its response cleanly; only then, and if the head allowed
keep-alive, may it carry another request.

A connection is the pool's to hand out (:mod:`~tokenwire.sidecar.upstream.pool`):
one request at a time, so nothing here locks. An idle connection is
:meth:`~UpstreamConnection.reusable` while it is open, within
``keepalive_expiry_s`` of its last response, and silent (a byte or a close
from the pod while idle, or a cut for a departed client, rules it out: its
next request would read them as its answer).

Errors are the client's own family (:mod:`~tokenwire.sidecar.upstream.errors`:
``ConnectFailed``, ``ReadFailed``, ``RemoteProtocolFault``...), mapped onto
the wire core's failure kinds in one place
(:func:`~tokenwire.sidecar.upstream.errors.failure_kind`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from .errors import RemoteProtocolFault
from .head import ResponseHead, head_end, parse_response_head, request_head
from .transport import UpstreamBackend, UpstreamStream

Header = tuple[bytes, bytes]

# The most a response head may take (httpcore's bound on an h11 event).
MAX_HEAD_BYTES: Final = 100 * 1024
# The most one read of a head takes.
_HEAD_READ_BYTES: Final = 64 * 1024


class Origin:
    """Where a pod's connections go."""

    __slots__ = ("host", "host_header", "port", "uds")

    def __init__(self, host: bytes, port: int, host_header: bytes, *, uds: str | None = None) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header
        """The ``Host`` of a request that names none."""
        self.uds = uds
        """A Unix socket's path: connect there instead."""


class UpstreamConnection:
    """One connection to ``origin`` (see the module docstring)."""

    __slots__ = ("_backend", "_expires_at", "_loop", "_origin", "_reusable", "answered", "closed",
                 "keepalive_expiry_s", "requests", "stream", "written")

    def __init__(self, origin: Origin, backend: UpstreamBackend, keepalive_expiry_s: float | None) -> None:
        self._origin = origin
        self._backend = backend
        self._loop = asyncio.get_running_loop()
        self.keepalive_expiry_s = keepalive_expiry_s
        self.stream: UpstreamStream | None = None
        """The network stream, once connected."""
        self.requests = 0
        """Requests sent on it (more than one: a reused keep-alive connection)."""
        self.written = False
        """The current request reached the socket (else the pod saw none of it)."""
        self.answered = False
        """A byte of the current request's response came back."""
        self.closed = False
        self._reusable = False
        self._expires_at: float | None = None

    async def send(self, method: bytes, target: bytes, headers: Sequence[Header], body: bytes, *,
                   connect_timeout_s: float | None) -> ResponseHead:
        """Send one request (connecting first if need be) and read its
        response's head; the body is left for the caller, who then calls
        :meth:`finish`."""
        data = request_head(method, target, self._origin.host_header, headers, body)
        stream = self.stream
        if stream is None:
            stream = self.stream = await self._connect(connect_timeout_s)
        self.requests += 1
        self._reusable = self.written = self.answered = False
        stream.send_request(data)
        self.written = True
        await stream.drain()
        return await self._read_head(stream, method)

    async def _read_head(self, stream: UpstreamStream, method: bytes) -> ResponseHead:
        data = await stream.read(_HEAD_READ_BYTES)
        self.answered = bool(data)
        while True:
            end = head_end(data)
            while end < 0:
                if not data:
                    raise RemoteProtocolFault("Server disconnected without sending a response.")
                if len(data) > MAX_HEAD_BYTES:
                    raise RemoteProtocolFault(
                        f"the upstream's response head is over {MAX_HEAD_BYTES} bytes")
                more = await stream.read(_HEAD_READ_BYTES)
                if not more:
                    raise RemoteProtocolFault("the upstream closed in the middle of a response head")
                searched = max(0, len(data) - 2)  # an end may straddle the reads
                data += more
                end = head_end(data, searched)
            if end > MAX_HEAD_BYTES:
                raise RemoteProtocolFault(
                    f"the upstream's response head is over {MAX_HEAD_BYTES} bytes")
            head = parse_response_head(data[:end], method)
            data = data[end:]
            if head.status >= 200:
                if data:
                    stream.unread(data)
                return head
            # A 1xx head: h11 reads it and then the real one.
            if not data:
                data = await stream.read(_HEAD_READ_BYTES)

    async def _connect(self, timeout_s: float | None) -> UpstreamStream:
        origin = self._origin
        if origin.uds is not None:
            return await self._backend.connect_unix_socket(origin.uds, timeout=timeout_s)
        return await self._backend.connect_tcp(origin.host.decode("ascii"), origin.port, timeout=timeout_s)

    def finish(self, reusable: bool) -> None:
        """The response is over: ``reusable`` if its body was read to exactly
        where its framing ended (and the head allowed keep-alive); else the
        connection is closed."""
        stream = self.stream
        if reusable and stream is not None and not stream.buffered and not stream.receive_capped:
            self._reusable = True
            expiry = self.keepalive_expiry_s
            self._expires_at = None if expiry is None else self._loop.time() + expiry
        else:
            self.close()

    def is_idle(self) -> bool:
        """Between requests, its last response ended cleanly (whether the pod
        still keeps it open is :meth:`reusable`'s question)."""
        return self._reusable and not self.closed

    def reusable(self) -> bool:
        """Idle, open, silent and not expired: it may carry the next request."""
        if not self._reusable or self.closed:
            return False
        stream = self.stream
        if stream is None or not stream.idle_and_silent():
            return False
        expires_at = self._expires_at
        return expires_at is None or self._loop.time() < expires_at

    def close(self) -> None:
        """Close it now (a pooled connection the pod closed, or one whose
        response did not end cleanly)."""
        if self.closed:
            return
        self.closed = True
        self._reusable = False
        if self.stream is not None:
            self.stream.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self.closed else "IDLE" if self._reusable else "ACTIVE"
        return f"<UpstreamConnection [{state}, Request Count: {self.requests}]>"
