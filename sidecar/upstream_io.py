"""httpcore's network layer for the upstream, on plain asyncio protocols.

Theory of operation
-------------------
httpcore talks to the network through a pluggable backend (the
``network_backend`` of its connections, a documented extension point).
Its default on asyncio goes through anyio, which per read resumes the
transport's reading, waits, pauses it again (two event-loop registrations on
uvloop), runs a cancellation checkpoint and a timeout scope, and asks the
kernel with ``poll()`` whether an idle pooled connection is still open. A
streaming upstream is read once per token, so that per-read work was a large
part of the sidecar's CPU per event.

Here a connection is an :class:`asyncio.Protocol` that keeps reading into a
small buffer, and ``read()`` takes whatever is buffered (up to ``max_bytes``),
waiting on one future only when nothing is. Events that arrived while the
driver was busy are therefore read together, in one call. Flow control stays
TCP's: past ``_READ_HIGH_WATER_BYTES`` buffered the transport stops reading
until ``read()`` drains it, so an upstream the wire core paused (``block``
policy) is pushed back on exactly as before. ``is_readable`` (httpcore's "did
the server close this idle connection?") is answered from the protocol's own
state, without a system call.

Response framing: after each request is written, ``read()`` hands httpcore
the response head and nothing past it (a 1xx head and the next head are
handed one at a time), so h11 never buffers body bytes. The body is then read
by the sidecar itself (:mod:`~tokenwire.sidecar.upstream_body`, through
:meth:`UpstreamStream.read`), or, for a ``Content-Length`` body, by h11 with
reads capped at the bytes still due (:meth:`UpstreamStream.limit_reads`).
Either way a byte the upstream sends past its response's framing stays here,
where :attr:`UpstreamStream.buffered` sees it and the connection is closed
instead of pooled: otherwise the next request on it would read those bytes as
the start of its answer. When the sidecar read a chunked body itself, h11 is
handed a bare last chunk (:meth:`UpstreamStream.end_body`) so that it, and so
httpcore's pool, knows the response ended.

Timeouts and exceptions follow httpcore's contract: ``ConnectError``/
``ConnectTimeout`` when connecting, ``ReadError``/``ReadTimeout`` and
``WriteError``/``WriteTimeout`` after; ``b""`` from ``read()`` is EOF.
"""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import contextvars
import re
import socket
import ssl
import typing
from collections.abc import Callable, Iterable

import httpcore

from .upstream_body import ChunkDelivery, ChunkedBodyReader

# Bytes buffered from the upstream before its transport stops reading.
_READ_HIGH_WATER_BYTES = 256 * 1024

# Writes smaller than this are held until the next read or loop turn (see write).
_HOLD_WRITE_BYTES = 64 * 1024
# Where a response head ends (h11's own rule: a line feed, optional CR, line feed).
_HEAD_END = re.compile(rb"\n\r?\n")
# What h11 is handed, in place of the chunked body the sidecar read itself.
_LAST_CHUNK = b"0\r\n\r\n"

SocketOption = tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]


class _UpstreamProtocol(asyncio.Protocol):
    """Buffers what the upstream sends and wakes the one reader waiting for it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.buffered_bytes = 0
        self.eof = False
        self.error: Exception | None = None
        self.reading_paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        # While a body is delivered (UpstreamStream.deliver_chunked): where reads go.
        self.sink: _BodySink | None = None
        self.sink_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None and not self.sink_paused and not self.chunks:
            sink.data(data)
            return
        self.chunks.append(data)
        self.buffered_bytes += len(data)
        if self.buffered_bytes > _READ_HIGH_WATER_BYTES and not self.reading_paused:
            self.reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._wake()
        if self.sink is not None:
            self.sink.closed(None)
        return None  # close the transport: we never half-close towards the upstream

    def failure(self) -> Exception | None:
        """``error``, read through a call: after a check of ``error`` and an
        ``await``, mypy would still take it for None there, and compiled code
        then fails (TypeError) on the exception ``connection_lost`` put there meanwhile."""
        return self.error

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None:
            self.error = exc
        self._wake()
        self._wake_writer()
        if self.sink is not None:
            self.sink.closed(exc)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _wake_writer(self) -> None:
        waiter = self.drain_waiter
        if waiter is not None:
            self.drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)


class _BodySink:
    """A chunked body delivered from ``data_received`` itself: no task wakes
    per read, the reader and the driver's callback run right there."""

    def __init__(self, deliver: Callable[[list[bytes]], None]) -> None:
        self.reader = ChunkedBodyReader()
        self.deliver = deliver
        # A delivery that takes a one-chunk read whole, framing and all.
        self.framed = deliver if isinstance(deliver, ChunkDelivery) else None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Looked at on every read: bound once (a method lookup per call otherwise).
        self._ended = self.done.done

    def data(self, data: bytes) -> None:
        if self._ended():
            return
        framed = self.framed
        if framed is not None:
            # The usual read of a streaming upstream: one chunk, as the sidecar
            # would frame it itself (it cannot end the body: its size is not 0).
            start = self.reader.framed_chunk_start(data)
            if start:
                framed.framed_chunk(data[start:len(data) - 2], data)
                return
        try:
            chunks = self.reader.feed(data)
        except httpcore.RemoteProtocolError as error:
            self.done.set_exception(error)
            return
        if chunks:
            self.deliver(chunks)
        if self.reader.done and not self.done.done():
            self.done.set_result(None)

    def closed(self, error: Exception | None) -> None:
        if not self.done.done():
            if error is not None:
                self.done.set_exception(httpcore.ReadError(str(error) or type(error).__name__))
            else:
                self.done.set_exception(httpcore.RemoteProtocolError(
                    "the upstream closed before the end of its chunked body"))


class RequestProbe:
    """What the connection a request went out on knew of it, for a request
    that failed before its response: set while :func:`probing` and filled in
    by the :class:`UpstreamStream` the pool sent the request on."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream: UpstreamStream | None = None

    @property
    def reused(self) -> bool:
        """The request went out on a connection that had carried one before."""
        return self.stream is not None and self.stream.requests > 1

    @property
    def answered(self) -> bool:
        """A byte of the response came back."""
        return self.stream is not None and self.stream.answered

    @property
    def written(self) -> bool:
        """A byte of the request reached the socket (else the upstream saw none of it)."""
        return self.stream is None or self.stream.written


_PROBE: contextvars.ContextVar[RequestProbe | None] = contextvars.ContextVar(
    "tokenwire_upstream_probe", default=None)


@contextlib.contextmanager
def probing(probe: RequestProbe) -> typing.Iterator[RequestProbe]:
    """Requests this task sends meanwhile report their connection to ``probe``
    (httpcore gives no handle on the connection of a request that failed)."""
    token = _PROBE.set(probe)
    try:
        yield probe
    finally:
        _PROBE.reset(token)


class UpstreamStream(httpcore.AsyncNetworkStream):
    """One upstream connection as httpcore sees it."""

    def __init__(self, transport: asyncio.Transport, protocol: _UpstreamProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()
        # A request was written and its final response head is not read whole yet.
        self._head_pending = False
        self._head_tail = b""  # the last bytes of the head so far (an end may straddle reads)
        self._head_start = b""  # its first bytes: is it a 1xx head?
        self._read_limit: int | None = None
        self._replay = b""
        self._held: list[bytes] = []  # small writes not sent yet (see write)
        self._aborted = False
        self._cut = False
        self.requests = 0
        """Requests written on this connection so far (more than one: a reused keep-alive one)."""
        self.answered = False
        """A byte of the current request's response has come."""
        self.written = False
        """A byte of the current request has gone to the socket."""

    @property
    def buffered(self) -> bool:
        """Bytes have arrived that no read has taken (or the upstream closed)."""
        return bool(self._protocol.chunks) or self._protocol.eof

    def limit_reads(self, remaining_bytes: int | None) -> None:
        """Hand out at most ``remaining_bytes`` more (the rest of a
        ``Content-Length`` body); None lifts the cap."""
        self._read_limit = remaining_bytes

    def unread(self, data: bytes) -> None:
        """Put bytes back in front of the buffer (read past a body's end)."""
        protocol = self._protocol
        protocol.chunks.insert(0, data)
        protocol.buffered_bytes += len(data)

    async def deliver_chunked(self, deliver: Callable[[list[bytes]], None]) -> None:
        """Read a chunked body to its last chunk, handing each read's chunks
        to ``deliver`` as they arrive (see :class:`_BodySink`); returns
        once the body ended, with anything after it left buffered."""
        protocol = self._protocol
        sink = _BodySink(deliver)
        protocol.sink = sink
        try:
            self._drain_into_sink()
            if protocol.eof and not sink.done.done():
                sink.closed(protocol.error)
            await sink.done
        finally:
            protocol.sink = None
            protocol.sink_paused = False
            if not sink.done.done():
                sink.done.cancel()
        if sink.reader.leftover:
            self.unread(sink.reader.leftover)

    def pause_delivery(self) -> None:
        """Stop handing body reads over (the wire core paused the upstream):
        they buffer, and past the high-water mark TCP pushes back."""
        self._protocol.sink_paused = True

    def resume_delivery(self) -> None:
        protocol = self._protocol
        if protocol.sink_paused:
            protocol.sink_paused = False
            if protocol.chunks:
                # Not from inside the driver's own action loop.
                self._loop.call_soon(self._drain_into_sink)

    def _drain_into_sink(self) -> None:
        protocol = self._protocol
        sink = protocol.sink
        if sink is None or protocol.sink_paused or not protocol.chunks:
            return
        chunks = protocol.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        protocol.chunks = []
        protocol.buffered_bytes = 0
        if protocol.reading_paused:
            protocol.reading_paused = False
            self._transport.resume_reading()
        sink.data(data)

    def end_body(self) -> None:
        """The sidecar read a chunked body to its end itself: the next read
        gives httpcore's h11 a bare last chunk, so it sees the response end."""
        self._replay = _LAST_CHUNK

    def _send_held(self) -> None:
        held = self._held
        if held:
            data = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            if not self._transport.is_closing():
                self.written = True
                self._transport.write(data)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            self._send_held()
        if self._replay:
            data, self._replay = self._replay, b""
            return data
        if self._read_limit is not None:
            if self._read_limit <= 0:
                return b""
            max_bytes = min(max_bytes, self._read_limit)
        data = await self._read(max_bytes, timeout)
        if self._head_pending and data:
            self.answered = True
            data = self._cut_at_head_end(data)
        if self._read_limit is not None:
            self._read_limit -= len(data)
        return data

    def _cut_at_head_end(self, data: bytes) -> bytes:
        """``data`` up to the end of the response head; the rest is put back."""
        if len(self._head_start) < 12:
            self._head_start += data[:12 - len(self._head_start)]
        tail = self._head_tail
        match = _HEAD_END.search(tail + data)
        if match is None:
            self._head_tail = (tail + data)[-2:]
            return data
        cut = match.end() - len(tail)
        # h11 reads 1xx heads (other than 101) and then the real one: keep cutting.
        status = self._head_start[9:12]
        informational = status[:1] == b"1" and status != b"101"
        self._head_pending = informational
        self._head_tail = b""
        self._head_start = b""
        if cut < len(data):
            self.unread(data[cut:])
            data = data[:cut]
        return data

    async def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        protocol = self._protocol
        if not protocol.chunks:
            error = protocol.failure()
            if error is not None:
                raise httpcore.ReadError(str(error) or type(error).__name__)
            if protocol.eof:
                return b""
            waiter = self._loop.create_future()
            protocol.waiter = waiter
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data from the upstream in {timeout:g} s") from None
            finally:
                if protocol.waiter is waiter:
                    protocol.waiter = None
            if not protocol.chunks:
                error = protocol.failure()
                if error is not None:
                    raise httpcore.ReadError(str(error) or type(error).__name__)
                return b""
        chunks = protocol.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) > max_bytes:
            protocol.chunks = [data[max_bytes:]]
            data = data[:max_bytes]
        else:
            protocol.chunks = []
        protocol.buffered_bytes -= len(data)
        if protocol.reading_paused and protocol.buffered_bytes <= _READ_HIGH_WATER_BYTES // 2:
            protocol.reading_paused = False
            self._transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if not self._head_pending:
            # The first write of a new request.
            self.requests += 1
            self.answered = self.written = False
            probe = _PROBE.get()
            if probe is not None:
                probe.stream = self
        # A new request (or the rest of one): its response starts with a head.
        self._head_pending = True
        self._head_tail = b""
        self._head_start = b""
        self._read_limit = None
        self._replay = b""
        if protocol.failure() is not None or self._transport.is_closing():
            raise httpcore.WriteError("the upstream connection is closed")
        held = self._held
        if not held and len(buffer) < _HOLD_WRITE_BYTES:
            # httpcore writes a request's head and then its body: held for a
            # moment, they leave in one send() (one packet, one system call).
            # The next read sends them at the latest, else the loop's next turn.
            held.append(buffer)
            self._loop.call_soon(self._send_held)
            return
        if held:
            held.append(buffer)
            buffer = b"".join(held)
            held.clear()
        self.written = True
        self._transport.write(buffer)
        if not protocol.write_paused:
            return
        waiter = self._loop.create_future()
        protocol.drain_waiter = waiter
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            raise httpcore.WriteTimeout(f"the upstream took no data for {timeout:g} s") from None
        error = protocol.failure()
        if error is not None:
            raise httpcore.WriteError(str(error) or type(error).__name__)

    async def aclose(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        """Drop the connection now (no await): an aborted stream's upstream sees
        the close at once instead of after the task's cancellation unwinds.

        A transport's ``abort()`` only closes the descriptor from a callback on
        the loop's next turn (uvloop's and asyncio's alike), behind everything
        else that turn runs: with 50 clients gone at once, behind 50 streams'
        bookkeeping. A ``shutdown(2)`` sends the FIN now."""
        if self._aborted:
            return
        self._aborted = True
        transport = self._transport
        # Once closing, the descriptor may be closed already, its number
        # reused by another connection: only an open one is shut down.
        sock = None if self._cut or transport.is_closing() else transport.get_extra_info("socket")
        transport.abort()
        shutdown_now(sock)

    def cut(self) -> None:
        """The upstream sees the close now (``shutdown(2)``); nothing more is
        read, so nothing wakes the task reading this connection. The transport
        is closed by :meth:`abort`, later: a burst of departing clients closes
        all their upstreams before any of their tasks unwinds."""
        if self._cut or self._aborted:
            return
        self._cut = True
        transport = self._transport
        if transport.is_closing():
            return
        transport.pause_reading()
        shutdown_now(transport.get_extra_info("socket"))

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                transport = await self._loop.start_tls(
                    self._transport, self._protocol, ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            self._transport.abort()
            raise httpcore.ConnectTimeout("TLS handshake with the upstream timed out") from None
        except (OSError, ssl.SSLError) as error:
            self._transport.abort()
            raise httpcore.ConnectError(str(error)) from error
        if transport is None:
            raise httpcore.ConnectError("the upstream closed during the TLS handshake")
        return UpstreamStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":
            # For an idle pooled connection: has the server sent anything or closed
            # it — or did we? A connection cut for a departed client can be back in
            # the pool before its transport is closed (the attempt was finishing
            # when the client left); reused, its next request would fail with
            # "Server disconnected without sending a response".
            protocol = self._protocol
            return bool(protocol.chunks) or protocol.eof or self._cut or self._aborted
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        return None


def shutdown_now(sock: typing.Any) -> None:
    """``shutdown(SHUT_RDWR)`` of a transport's socket: the peer sees the
    close now, whatever the loop does next. The transport's own socket object
    refuses ``shutdown()`` (uvloop's stand-in does); a bare ``_socket.socket``
    on the same descriptor does it and is detached, never closing it.

    Bare, with its family, type and protocol given: ``socket.socket`` would
    ask the stand-in for its family and type (a ``getsockopt`` each) and the
    kernel for its protocol, ~3 µs a call on a 2-core VM where the
    ``shutdown`` itself is ~5; with 50 clients resetting at once the last
    upstream waits for all the others' cuts. ``shutdown(2)`` does not look
    at the family the object was made with, so ``AF_INET`` serves a Unix or
    IPv6 socket too."""
    if sock is None:
        return
    try:
        fd = sock.fileno()
        if fd < 0:
            return
        twin = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, fd)
    except OSError:
        return
    try:
        twin.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer, or not connected: nothing to send
    finally:
        twin.detach()


class UpstreamBackend(httpcore.AsyncNetworkBackend):
    """Opens :class:`UpstreamStream` connections over TCP or a Unix socket."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[SocketOption] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local_addr = None if local_address is None else (local_address, 0)
        return await self._connect(
            lambda: loop.create_connection(_UpstreamProtocol, host, port, local_addr=local_addr),
            timeout, socket_options, tcp=True)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[SocketOption] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await self._connect(lambda: loop.create_unix_connection(_UpstreamProtocol, path),
                                   timeout, socket_options, tcp=False)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    @staticmethod
    async def _connect(open_connection: typing.Callable[[], typing.Awaitable[
                           tuple[asyncio.BaseTransport, _UpstreamProtocol]]],
                       timeout: float | None, socket_options: Iterable[SocketOption] | None,
                       *, tcp: bool) -> UpstreamStream:
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await open_connection()
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection to the upstream in {timeout:g} s") from None
        except OSError as error:
            raise httpcore.ConnectError(str(error) or type(error).__name__) from error
        transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            if tcp:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                for option in socket_options or ():
                    sock.setsockopt(*option)
            except OSError as error:
                transport.abort()
                raise httpcore.ConnectError(str(error)) from error
        return UpstreamStream(transport, protocol)
