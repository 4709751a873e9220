"""``shutdown_now``: the upstream sees a departed client's close at once,
through the transport's own descriptor, which stays open for the transport
to close later (real sockets on a real loop)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile

import pytest
from conftest import LoopThread
from tokenwire.sidecar.upstream.transport import UpstreamBackend, shutdown_now


class _Held(asyncio.Protocol):
    """The loop's side of the connection: what a pooled upstream connection is."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass


def _listening(family: int, address: object) -> socket.socket:
    """A non-blocking listening socket of ``family`` bound to ``address``: the far end."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(address)  # type: ignore[arg-type]
    listener.listen(1)
    listener.setblocking(False)
    return listener


async def _cut_one(family: int, address: object) -> tuple[bytes, bool, bool]:
    """Connect the loop to ``address``, shut the loop's side down with
    ``shutdown_now``: what the far end reads, then whether the descriptor is
    still open and the transport not closing."""
    loop = asyncio.get_running_loop()
    listener = _listening(family, address)
    try:
        protocol = _Held()
        if family == socket.AF_UNIX:
            transport, _ = await loop.create_unix_connection(lambda: protocol, str(address))
        else:
            transport, _ = await loop.create_connection(lambda: protocol, *listener.getsockname()[:2])
        far, _ = await loop.sock_accept(listener)
        far.setblocking(False)
        fd = transport.get_extra_info("socket").fileno()
        shutdown_now(fd)
        transport.pause_reading()  # as UpstreamStream.cut: else the loop reads the EOF and closes it
        seen = await asyncio.wait_for(loop.sock_recv(far, 100), 10)  # b"": the FIN
        still_open = os.fstat(fd) is not None
        closing = transport.is_closing()
        transport.close()
        far.close()
        return seen, still_open, closing
    finally:
        listener.close()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6, socket.AF_UNIX])
def test_shutdown_now_sends_the_close_and_leaves_the_descriptor_to_its_transport(
        loop_thread: LoopThread, family: int) -> None:
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with tempfile.TemporaryDirectory() as directory:
        address: object = {socket.AF_INET: ("127.0.0.1", 0), socket.AF_INET6: ("::1", 0),
                           socket.AF_UNIX: os.path.join(directory, "up.sock")}[family]
        try:
            seen, still_open, closing = loop_thread.run(_cut_one(family, address))
        except OSError as error:
            if family == socket.AF_INET6:
                pytest.skip(f"IPv6 loopback unavailable: {error}")
            raise
    assert seen == b""
    assert still_open
    assert not closing


def test_shutdown_now_of_nothing_or_of_a_socket_whose_peer_left_does_nothing() -> None:
    shutdown_now(-1)  # no descriptor: nothing to shut down, no error
    left, right = socket.socketpair()
    try:
        right.close()
        shutdown_now(left.fileno())  # the peer is gone: shutdown may fail, quietly
        assert left.fileno() >= 0
    finally:
        left.close()


async def _connect_and_cut(family: int, address: object) -> tuple[bytes, bool]:
    """An upstream connection opened by the sidecar's own backend, then cut
    as for a departed client: what the far end reads, and whether the
    connection would still be offered for reuse."""
    loop = asyncio.get_running_loop()
    listener = _listening(family, address)
    try:
        backend = UpstreamBackend()
        if family == socket.AF_UNIX:
            stream = await backend.connect_unix_socket(str(address), timeout=10)
        else:
            stream = await backend.connect_tcp("127.0.0.1", listener.getsockname()[1], timeout=10)
        far, _ = await loop.sock_accept(listener)
        far.setblocking(False)
        stream.cut()
        seen = await asyncio.wait_for(loop.sock_recv(far, 100), 10)  # b"": the FIN
        reusable = stream.idle_and_silent()
        stream.abort()
        far.close()
        return seen, reusable
    finally:
        listener.close()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_UNIX])
def test_a_cut_upstream_connection_sends_its_close_at_once(loop_thread: LoopThread, family: int) -> None:
    """``UpstreamStream.cut`` shuts down the descriptor it was opened with
    (looked up once, at connect time): the upstream reads the FIN at once,
    before the transport is closed, and the connection is never offered for
    reuse."""
    with tempfile.TemporaryDirectory() as directory:
        address: object = ("127.0.0.1", 0) if family == socket.AF_INET else os.path.join(directory, "up.sock")
        seen, reusable = loop_thread.run(_connect_and_cut(family, address))
    assert seen == b""
    assert not reusable
