"""UpstreamPool (sidecar/upstream/pool.py) against a real HTTP/1.1 server on 127.0.0.1.

Each test runs its own event loop with a small asyncio server that answers
every request with ``ok`` (Content-Length, kept alive), counts the connections
it accepted and the ones it saw closed, and can hold its answers or close a
connection after answering. Nothing waits on wall-clock time but the
pool-timeout test, whose timeout is the behaviour under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from tokenwire.sidecar.upstream.conn import Origin
from tokenwire.sidecar.upstream.errors import ConnectFailed, PoolTimedOut, RemoteProtocolFault
from tokenwire.sidecar.upstream.pool import UpstreamPool


class _Server:
    def __init__(self) -> None:
        self.accepted = 0
        self.closed = 0
        self.hold: asyncio.Event | None = None  # answers wait for it while set
        self.close_after_answer = False
        self.requests = asyncio.Queue[str]()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.put_nowait(head.split(b" ")[1].decode())
                if self.hold is not None:
                    await self.hold.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                if self.close_after_answer:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1


async def _get(pool: UpstreamPool, base: str, path: str, pool_timeout_s: float | None = 5.0) -> bytes:
    """One request through the pool as ``run_attempt`` makes it: acquire, send,
    read the body its head frames, finish, release."""
    connection = await pool.acquire(pool_timeout_s)
    clean = False
    try:
        head = await connection.send(b"GET", path.encode(), [(b"Host", b"test")], b"", connect_timeout_s=5.0)
        assert isinstance(head.framing, int) and connection.stream is not None
        body = b""
        while len(body) < head.framing:
            body += await connection.stream.read(head.framing - len(body))
        clean = head.keep_alive
        return body
    finally:
        connection.finish(clean)
        pool.release(connection)


def _run(test: Callable[[_Server, str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = _Server()
        base = await server.start()
        try:
            await test(server, base)
        finally:
            await server.stop()

    asyncio.run(main())


def _pool(base: str, max_connections: int = 10, keepalive_expiry_s: float | None = 60.0) -> UpstreamPool:
    port = int(base.rsplit(":", 1)[1])
    return UpstreamPool(Origin(b"127.0.0.1", port, b"test"), max_connections=max_connections,
                        keepalive_expiry_s=keepalive_expiry_s)


async def _occupy(server: _Server, pool: UpstreamPool, base: str) -> asyncio.Task[bytes]:
    """A request ``/first`` the server holds its answer to (until ``server.hold``
    is set), running once the server has read it: it keeps its connection busy."""
    server.hold = asyncio.Event()
    first = asyncio.create_task(_get(pool, base, "/first"))
    assert await server.requests.get() == "/first"
    return first


async def _turns(until: Callable[[], bool], most: int = 200) -> None:
    """Let the loop run until ``until()`` holds (a bounded number of turns, no clock)."""
    for _ in range(most):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_requests_one_after_another_reuse_one_connection() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base)
        for i in range(5):
            assert await _get(pool, base, f"/{i}") == b"ok"
        assert server.accepted == 1
        assert [c.is_idle() for c in pool.connections] == [True]
        await pool.aclose()

    _run(test)


def test_at_the_limit_a_request_waits_then_takes_the_freed_connection() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base, max_connections=1)
        first = await _occupy(server, pool, base)
        second = asyncio.create_task(_get(pool, base, "/second"))
        await _turns(lambda: "1 queued" in repr(pool))
        server.hold.set()
        assert await first == b"ok" and await second == b"ok"
        assert server.accepted == 1  # the second request went out on the first's connection
        await pool.aclose()

    _run(test)


def test_at_the_limit_a_request_gives_up_after_its_pool_timeout() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base, max_connections=1)
        first = await _occupy(server, pool, base)
        with pytest.raises(PoolTimedOut, match="1 in use"):
            await _get(pool, base, "/second", pool_timeout_s=0.05)
        server.hold.set()
        assert await first == b"ok"
        assert await _get(pool, base, "/third") == b"ok"  # the timed-out request holds no place
        await pool.aclose()

    _run(test)


def test_a_cancelled_waiter_passes_its_turn_to_the_next() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base, max_connections=1)
        first = await _occupy(server, pool, base)
        second = asyncio.create_task(_get(pool, base, "/second"))
        third = asyncio.create_task(_get(pool, base, "/third"))
        await _turns(lambda: "2 queued" in repr(pool))
        second.cancel()
        server.hold.set()
        assert await first == b"ok" and await third == b"ok"
        assert second.cancelled()
        assert server.accepted == 1
        await pool.aclose()

    _run(test)


def test_a_connection_the_server_closed_is_not_reused() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base)
        server.close_after_answer = True
        assert await _get(pool, base, "/first") == b"ok"
        await _turns(lambda: server.closed == 1)
        # The idle connection saw the close: the next request opens a new one.
        await _turns(lambda: not any(c.reusable() for c in pool.connections))
        assert await _get(pool, base, "/second") == b"ok"
        assert server.accepted == 2
        await pool.aclose()

    _run(test)


def test_an_expired_idle_connection_is_closed_and_a_new_one_opened() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base, keepalive_expiry_s=0.0)  # idle connections expire at once
        assert await _get(pool, base, "/first") == b"ok"
        assert await _get(pool, base, "/second") == b"ok"
        assert server.accepted == 2
        await _turns(lambda: server.closed == 1)  # the expired one was closed, not leaked
        await pool.aclose()

    _run(test)


def test_a_failed_connect_frees_its_place() -> None:
    async def test(server: _Server, base: str) -> None:
        await server.stop()  # nothing listens there any more
        pool = _pool(base, max_connections=1)
        for _ in range(2):  # the second would wait for ever if the first kept the place
            with pytest.raises(ConnectFailed):
                await _get(pool, base, "/x")
        assert pool.connections == []
        await pool.aclose()

    _run(test)


def test_closing_the_pool_fails_waiting_requests_and_closes_its_connections() -> None:
    async def test(server: _Server, base: str) -> None:
        pool = _pool(base, max_connections=1)
        first = await _occupy(server, pool, base)
        waiting = asyncio.create_task(_get(pool, base, "/second", pool_timeout_s=None))
        await _turns(lambda: "1 queued" in repr(pool))
        await pool.aclose()
        with pytest.raises(ConnectFailed, match="closed"):
            await waiting
        # The busy connection was closed under its request: it fails, no answer.
        with pytest.raises(RemoteProtocolFault):
            await first
        server.hold.set()  # the server's handler, answering, finds its connection closed
        await _turns(lambda: server.closed == 1)
        with pytest.raises(ConnectFailed, match="closed"):
            await _get(pool, base, "/third")

    _run(test)
