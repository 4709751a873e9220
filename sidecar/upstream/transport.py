"""The sidecar's upstream connections on plain asyncio protocols.

Theory of operation
-------------------
A connection is an :class:`asyncio.Protocol` that keeps reading into a small
buffer, and :meth:`UpstreamStream.read` takes whatever is buffered (up to
``max_bytes``), waiting on one future only when nothing is: events that
arrived while the driver was busy are read together, in one call (anyio's
streams, httpcore's default, resumed and paused the transport's reading and
ran a cancellation checkpoint and a timeout scope on every read, and asked
the kernel with ``poll()`` whether an idle pooled connection was still open).
Flow control stays TCP's: past ``_READ_HIGH_WATER_BYTES`` buffered the
transport stops reading until ``read()`` drains it, and an upstream the wire
core paused (:meth:`UpstreamStream.pause_delivery`) is not read at all until it
resumes; a ``block`` stream's socket also gets a small receive buffer
(:meth:`UpstreamStream.cap_receive_buffer`), so the engine's sends are held
after tens of KiB rather than after an autotuned buffer of megabytes. Whether
an idle pooled connection is still good (:meth:`UpstreamStream.idle_and_silent`)
is answered from the protocol's own state, without a system call.

A request is written in one piece (:meth:`UpstreamStream.send_request`: one
``send()``, one packet). The response head is read by
:class:`~tokenwire.sidecar.upstream.conn.UpstreamConnection`, which puts back
what came after it (:meth:`UpstreamStream.unread`); a chunked body is then
delivered from the protocol's own ``data_received``
(:meth:`UpstreamStream.deliver_chunked`, no task wake-up per read), other bodies
are read with ``read()``. Either way a byte the upstream sends past its
response's framing stays here, where :attr:`UpstreamStream.buffered` sees it
and the connection is closed instead of pooled: otherwise the next request on
it would read those bytes as the start of its answer.

Failures are the client's own family (:mod:`~tokenwire.sidecar.upstream.errors`,
mapped onto failure kinds in one place): ``ConnectFailed``/``ConnectTimedOut``
when connecting, ``ReadFailed`` and ``WriteFailed`` after; ``b""`` from
``read()`` is EOF.
"""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import socket
import typing
from collections.abc import Callable, Iterable
from typing import Final

from .body import ChunkDelivery, ChunkedBodyReader
from .errors import ConnectFailed, ConnectTimedOut, CutShort, ReadFailed, RemoteProtocolFault, WriteFailed

# Bytes buffered from the upstream before its transport stops reading.
_READ_HIGH_WATER_BYTES: Final = 256 * 1024

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
        except RemoteProtocolFault as error:
            self.done.set_exception(error)
            return
        if chunks:
            self.deliver(chunks)
        if self.reader.done and not self.done.done():
            self.done.set_result(None)

    def closed(self, error: Exception | None) -> None:
        if not self.done.done():
            if error is not None:
                self.done.set_exception(ReadFailed(str(error) or type(error).__name__))
            else:
                self.done.set_exception(CutShort("the upstream closed before the end of its chunked body"))


class UpstreamStream:
    """One upstream connection's bytes: written in one piece a request, read
    as they are buffered (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: _UpstreamProtocol, fd: int) -> None:
        """``fd``: the transport's descriptor (-1: none), for :meth:`cut`,
        looked up once here: ``get_extra_info("socket")`` builds uvloop's
        stand-in socket and asks the kernel for its name on every call, and
        a burst of departing clients cuts its upstreams one after another."""
        self._transport = transport
        self._protocol = protocol
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._aborted = False
        self._cut = False
        self.receive_capped = False
        """The socket's receive buffer was capped (:meth:`cap_receive_buffer`): Linux
        keeps such a cap for good, so the connection is never pooled again."""

    @property
    def buffered(self) -> bool:
        """Bytes have arrived that no read has taken (or the upstream closed)."""
        return bool(self._protocol.chunks) or self._protocol.eof

    def idle_and_silent(self) -> bool:
        """Between requests: open, nothing sent by the pod (bytes or a close),
        not cut or aborted. A connection cut for a departed client can be back
        in the pool before its transport is closed (the attempt was finishing
        when the client left); reused, its next request would fail."""
        protocol = self._protocol
        return not (protocol.chunks or protocol.eof or self._cut or self._aborted
                    or self._transport.is_closing())

    def unread(self, data: bytes) -> None:
        """Put bytes back in front of the buffer (read past a head's or body's end)."""
        protocol = self._protocol
        protocol.chunks.insert(0, data)
        protocol.buffered_bytes += len(data)

    def send_request(self, data: bytes) -> None:
        """Write a whole request (one ``send()``); ``WriteFailed`` if
        the connection is closed already."""
        if self._protocol.failure() is not None or self._transport.is_closing():
            raise WriteFailed("the upstream connection is closed")
        self._transport.write(data)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        protocol = self._protocol
        if not protocol.write_paused:
            return
        waiter = self._loop.create_future()
        protocol.drain_waiter = waiter
        await waiter
        error = protocol.failure()
        if error is not None:
            raise WriteFailed(str(error) or type(error).__name__)

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

    def cap_receive_buffer(self, receive_buffer_bytes: int) -> None:
        """Cap what the kernel may hold of this response (a ``block`` stream, as its
        head arrives, while little of its body is queued: a cap below what is
        queued closes the window and stalls the sender for seconds). Linux
        autotunes a receive buffer to megabytes, which an engine would fill
        without ever being made to wait for a paused reader."""
        if not self.receive_capped:
            self.receive_capped = True
            sock = self._transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)

    def pause_delivery(self) -> None:
        """Stop handing body reads over and stop reading the socket (the wire core
        paused the upstream): what the upstream sends next waits in the kernel,
        and TCP pushes back on it."""
        protocol = self._protocol
        protocol.sink_paused = True
        if not protocol.reading_paused:
            protocol.reading_paused = True
            self._transport.pause_reading()

    def resume_delivery(self) -> None:
        protocol = self._protocol
        if protocol.reading_paused and protocol.buffered_bytes <= _READ_HIGH_WATER_BYTES // 2:
            protocol.reading_paused = False
            self._transport.resume_reading()
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

    async def read(self, max_bytes: int) -> bytes:
        """What is buffered, up to ``max_bytes`` (waiting for some if none);
        ``b""`` once the upstream closed; ``ReadFailed`` if the
        connection failed."""
        protocol = self._protocol
        if not protocol.chunks:
            error = protocol.failure()
            if error is not None:
                raise ReadFailed(str(error) or type(error).__name__)
            if protocol.eof:
                return b""
            waiter = self._loop.create_future()
            protocol.waiter = waiter
            try:
                await waiter
            finally:
                if protocol.waiter is waiter:
                    protocol.waiter = None
            if not protocol.chunks:
                error = protocol.failure()
                if error is not None:
                    raise ReadFailed(str(error) or type(error).__name__)
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

    def close(self) -> None:
        """Close the connection (what is still to be written goes first)."""
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
        fd = -1 if self._cut or transport.is_closing() else self._fd
        transport.abort()
        shutdown_now(fd)

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
        shutdown_now(self._fd)  # first: the FIN goes out before anything else
        transport.pause_reading()


def shutdown_now(fd: int) -> None:
    """``shutdown(SHUT_RDWR)`` of a transport's descriptor (-1: nothing to
    do): the peer sees the close now, whatever the loop does next. The
    transport's own socket object refuses ``shutdown()`` (uvloop's stand-in
    does); a bare ``_socket.socket`` on the same descriptor does it and is
    detached, never closing it.

    Bare, with its family, type and protocol given: ``socket.socket`` would
    ask the stand-in for its family and type (a ``getsockopt`` each) and the
    kernel for its protocol, each about as dear as the ``shutdown`` itself
    (docs/perf/resets.md); with many clients resetting at once the last
    upstream waits for all the others' cuts. ``shutdown(2)`` does not look
    at the family the object was made with, so ``AF_INET`` serves a Unix or
    IPv6 socket too."""
    if fd < 0:
        return
    try:
        twin = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, fd)
    except OSError:
        return
    try:
        twin.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer, or not connected: nothing to send
    finally:
        twin.detach()


class UpstreamBackend:
    """Opens :class:`UpstreamStream` connections over TCP or a Unix socket."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[SocketOption] | None = None,
                          ) -> UpstreamStream:
        loop = asyncio.get_running_loop()
        local_addr = None if local_address is None else (local_address, 0)
        return await self._connect(
            lambda: loop.create_connection(_UpstreamProtocol, host, port, local_addr=local_addr),
            timeout, socket_options, tcp=True)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[SocketOption] | None = None,
                                  ) -> UpstreamStream:
        loop = asyncio.get_running_loop()
        return await self._connect(lambda: loop.create_unix_connection(_UpstreamProtocol, path),
                                   timeout, socket_options, tcp=False)

    @staticmethod
    async def _connect(open_connection: typing.Callable[[], typing.Awaitable[
                           tuple[asyncio.BaseTransport, _UpstreamProtocol]]],
                       timeout: float | None, socket_options: Iterable[SocketOption] | None,
                       *, tcp: bool) -> UpstreamStream:
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await open_connection()
        except TimeoutError:
            raise ConnectTimedOut(f"no connection to the upstream in {timeout:g} s") from None
        except OSError as error:
            raise ConnectFailed(str(error) or type(error).__name__) from error
        transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        fd = -1
        if sock is not None:
            fd = sock.fileno()
            if tcp:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                for option in socket_options or ():
                    sock.setsockopt(*option)
            except OSError as error:
                transport.abort()
                raise ConnectFailed(str(error)) from error
        return UpstreamStream(transport, protocol, fd)
