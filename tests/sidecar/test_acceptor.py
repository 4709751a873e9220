"""The proxy's listener takes a burst of connections in one loop turn (sidecar/process/acceptor.py).

uvloop's ``create_server`` took one connection per loop turn, so a burst of N
connections waited N turns of a busy sidecar. These tests count loop turns,
not time: each connection of a burst must be made within a handful of turns,
whatever the burst's size.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trustme
import uvloop
from tokenwire.sidecar.process.acceptor import Acceptor, bind_listeners

BURST = 100
# A few connections are accepted a turn (4), each made two turns after: the
# burst within BURST / 4 + 3 turns, with slack. A turn per connection would
# take BURST + 1 (uvloop's create_server).
TURNS = 40


class _Counting(asyncio.Protocol):
    made: list[asyncio.BaseTransport]

    def __init__(self, made: list[asyncio.BaseTransport]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


def _run(loop_factory: Callable[[], asyncio.AbstractEventLoop],
         main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop = loop_factory()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop],
                         ids=["uvloop", "asyncio"])
def test_burst_is_accepted_in_a_few_turns_not_one_turn_per_connection(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def main() -> None:
        listeners = await bind_listeners("127.0.0.1", 0, backlog=BURST * 2, reuse_port=False)
        port = listeners[0].getsockname()[1]
        # The kernel completes every handshake into the backlog before anything is accepted.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(BURST)]
        made: list[asyncio.BaseTransport] = []
        acceptor = Acceptor(listeners, lambda sock, address: _Counting(made))
        acceptor.start()
        turns = 0
        while len(made) < BURST and turns < TURNS:
            await asyncio.sleep(0)
            turns += 1
        try:
            assert len(made) == BURST, f"{len(made)} of {BURST} connections made after {turns} turns"
        finally:
            acceptor.close()
            for transport in made:
                transport.close()
            for client in clients:
                client.close()
            await asyncio.sleep(0)

    _run(loop_factory, main)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop],
                         ids=["uvloop", "asyncio"])
def test_factory_gets_the_accepted_socket_and_the_peer_address_before_the_loop_has_them(
        loop_factory: Callable[[], asyncio.AbstractEventLoop], host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")

    async def main() -> None:
        try:
            listeners = await bind_listeners(host, 0, backlog=16, reuse_port=False)
        except OSError as error:
            pytest.skip(f"cannot listen on {host}: {error}")
        port = listeners[0].getsockname()[1]
        seen: list[tuple[bool, int, int, int, object, object]] = []
        made: list[asyncio.BaseTransport] = []

        errors: list[Exception] = []

        def factory(sock: socket.socket, address: object) -> asyncio.Protocol:
            # What the socket says of itself, and what the kernel says of its descriptor
            # (an error kept for the test to raise: raised here, it would end the hand-over).
            try:
                seen.append((isinstance(sock, socket.socket) and not sock.getblocking(), int(sock.family),
                             sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN),
                             sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE), sock.getpeername(), address))
            except Exception as error:
                errors.append(error)
            return _Counting(made)

        acceptor = Acceptor(listeners, factory)
        acceptor.start()
        reader, writer = await asyncio.open_connection(host, port)
        while not made:
            await asyncio.sleep(0)
        try:
            assert errors == []
            (non_blocking, family, domain, kind, peer, address), = seen
            assert non_blocking
            assert family == domain == (socket.AF_INET6 if ":" in host else socket.AF_INET)
            assert kind == socket.SOCK_STREAM
            assert peer == address == writer.get_extra_info("sockname")
            # The transport the loop made of it carries bytes, and closes the socket once.
            made[0].write(b"ok")  # type: ignore[attr-defined]  # uvloop's transports subclass nothing
            assert await reader.readexactly(2) == b"ok"
        finally:
            writer.close()
            for transport in made:
                transport.close()
            acceptor.close()
            await asyncio.sleep(0)

    _run(loop_factory, main)


def test_closed_acceptor_refuses_new_connections_and_keeps_open_ones() -> None:
    async def main() -> None:
        listeners = await bind_listeners("127.0.0.1", 0, backlog=16, reuse_port=False)
        port = listeners[0].getsockname()[1]
        made: list[asyncio.BaseTransport] = []
        acceptor = Acceptor(listeners, lambda sock, address: _Counting(made))
        acceptor.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not made:
            await asyncio.sleep(0)
        acceptor.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        # The connection accepted before the close still carries bytes both ways.
        transport = made[0]
        transport.write(b"still here")  # type: ignore[attr-defined]  # uvloop's transports subclass nothing
        assert await reader.readexactly(10) == b"still here"
        writer.close()
        transport.close()

    _run(uvloop.new_event_loop, main)


def test_bind_listeners_port_in_use_names_the_address() -> None:
    async def main() -> None:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(OSError) as error:
                await bind_listeners("127.0.0.1", port, backlog=16, reuse_port=False)
            assert error.value.errno == errno.EADDRINUSE
            assert error.value.strerror == f"cannot listen on 127.0.0.1:{port}: Address already in use"
        finally:
            taken.close()

    _run(asyncio.new_event_loop, main)


_OUT_OF_DESCRIPTORS = r'''
import asyncio, logging, os, resource, sys
from tokenwire.sidecar.process.acceptor import Acceptor, bind_listeners

hog = []

class FreeOnError(logging.Handler):
    """Once the acceptor reports running out of descriptors, give them back."""
    def emit(self, record):
        print("logged:", record.getMessage(), flush=True)
        while hog:
            os.close(hog.pop())

logging.getLogger("tokenwire.sidecar").addHandler(FreeOnError())

async def main():
    listeners = await bind_listeners("127.0.0.1", 0, backlog=16, reuse_port=False)
    accepted = asyncio.get_running_loop().create_future()

    class Made(asyncio.Protocol):
        def connection_made(self, transport):
            accepted.set_result(None)

    Acceptor(listeners, lambda sock, address: Made()).start()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        while True:
            hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("ready", listeners[0].getsockname()[1], flush=True)
    await asyncio.wait_for(accepted, 30)
    print("accepted", flush=True)

asyncio.run(main())
'''


@pytest.mark.slow
def test_out_of_descriptors_is_logged_and_accepting_resumes_once_some_are_free() -> None:
    """EMFILE pauses accepting (logged) instead of spinning or dying; the
    queued client is served once descriptors are free (a child process, so
    the descriptor limit is its own)."""
    child = subprocess.Popen([sys.executable, "-c", _OUT_OF_DESCRIPTORS], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().split()
        assert ready[0] == "ready", ready
        client = socket.create_connection(("127.0.0.1", int(ready[1])))  # queued by the kernel
        out, err = child.communicate(timeout=60)
        client.close()
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert "logged: cannot accept connections ([Errno 24] Too many open files): pausing for 1.0 s" in out
    assert out.rstrip().endswith("accepted")


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop],
                         ids=["uvloop", "asyncio"])
def test_plain_http_on_tls_port_when_repeated_then_logged_once_per_client_host(
        loop_factory: Callable[[], asyncio.AbstractEventLoop], caplog: pytest.LogCaptureFixture) -> None:
    """``curl http://`` against the TLS port: the handshake fails and the
    connection closes (asyncio has closed the socket by then, so no 400 can be
    written as nginx does); the operator reads one warning per client host,
    not one per attempt."""
    authority = trustme.CA()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    authority.issue_cert("localhost").configure_cert(tls)

    async def plain_request(port: int, source: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer

    async def main() -> None:
        listeners = await bind_listeners("127.0.0.1", 0, backlog=16, reuse_port=False)
        port = listeners[0].getsockname()[1]
        acceptor = Acceptor(listeners, lambda sock, address: asyncio.Protocol(), tls=tls,
                            tls_handshake_timeout_s=10.0)
        acceptor.start()
        try:
            for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.1"):
                assert await plain_request(port, source) == b""
                await acceptor.handed_over()
        finally:
            acceptor.close()

    with caplog.at_level(logging.WARNING, logger="tokenwire.sidecar"):
        _run(loop_factory, main)
    told = [record.getMessage() for record in caplog.records if "plain HTTP" in record.getMessage()]
    assert len(told) == 2, told
    assert told[0].startswith("plain HTTP from 127.0.0.1 on the TLS port") and "https://" in told[0]
    assert told[1].startswith("plain HTTP from 127.0.0.2 ")
