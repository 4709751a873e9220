"""The upstream pool's plain HTTP/1.1 connection (``sidecar/upstream_conn.py``):
httpcore's HTTP/1.1 connection, without the lock yields and the body
iteration around it. Real sockets, real httpcore.
"""

from __future__ import annotations

import asyncio
import typing

import httpcore
from conftest import LoopThread
from tokenwire.middleware import Input, UpstreamEnded, UpstreamHeaders
from tokenwire.sidecar.upstream import Upstream, run_attempt
from tokenwire.sidecar.upstream_conn import UpstreamConnection, open_connection
from tokenwire.sidecar.upstream_io import UpstreamBackend
from tokenwire.sidecar.upstream_pool import UpstreamPool

_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"%x\r\n%b\r\n0\r\n\r\n" % (len(_EVENT), _EVENT))


class _Upstream(asyncio.Protocol):
    """Answers each whole request (a head and its Content-Length body) with ``_ANSWER``."""

    connections = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        type(self).connections += 1
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        self.transport = typing.cast(asyncio.Transport, transport)
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.transport.write(_ANSWER)


def test_plainHttpOrigins_getTheLeanConnection_httpsKeepsHttpcoresOwn() -> None:
    backend = UpstreamBackend()
    plain = open_connection(httpcore.Origin(b"http", b"127.0.0.1", 8000), backend, uds=None,
                            keepalive_expiry_s=5.0)
    tls = open_connection(httpcore.Origin(b"https", b"example.com", 443), backend, uds=None,
                          keepalive_expiry_s=5.0)
    assert isinstance(plain, UpstreamConnection)
    assert isinstance(tls, httpcore.AsyncHTTPConnection)
    # Not yet connected: no other request may have it, and it is neither idle nor closed.
    assert not plain.is_available() and not plain.is_idle() and not plain.is_closed()
    assert not plain.has_expired()


def test_sequentialStreams_shareOneKeptAliveConnection_eachEndedByH11(loop_thread: LoopThread) -> None:
    """Three chunked answers in a row: each attempt reports its head and its end,
    and the connection h11 saw end each response goes back to the pool, idle,
    for the next one (the upstream sees one connection)."""

    async def scenario() -> tuple[list[list[Input]], int, bool, str]:
        _Upstream.connections = 0
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(max_connections=4, keepalive_expiry_s=5.0, network_backend=UpstreamBackend())
        upstream = Upstream(f"http://127.0.0.1:{port}", b"http", b"127.0.0.1", port, b"", pool)
        readable = asyncio.Event()
        readable.set()
        runs: list[list[Input]] = []
        timeouts: dict[str, float | None] = {"connect": 5.0, "pool": 5.0, "read": None, "write": None}
        try:
            for _ in range(3):
                fed: list[Input] = []
                bodies: list[list[bytes]] = []
                await run_attempt(upstream, method=b"POST", target=b"/v1/chat/completions",
                                  headers=[(b"content-type", b"application/json"), (b"content-length", b"2")],
                                  body=b"{}", timeouts=timeouts,
                                  readable=readable, feed=fed.append, feed_body=bodies.append)
                assert bodies == [[_EVENT]]
                runs.append(fed)
            connections = pool.connections
            idle = len(connections) == 1 and connections[0].is_idle()
            kind = type(connections[0]).__name__
        finally:
            await pool.aclose()
            server.close()
        return runs, _Upstream.connections, idle, kind

    runs, connections, idle, kind = loop_thread.run(scenario())
    for fed in runs:
        assert [type(event) for event in fed] == [UpstreamHeaders, UpstreamEnded]
    assert connections == 1
    assert idle
    assert kind == "UpstreamConnection"


def test_theHttpcoreInternalsOverridden_stillExist() -> None:
    """``upstream_conn`` replaces or calls these by name; an httpcore that
    renamed one would leave the override unused (or fail at run time): this
    says so first."""
    for name in ("_send_request_headers", "_send_event", "_response_closed"):
        assert callable(getattr(httpcore.AsyncHTTP11Connection, name, None)), name

    class _Stream(httpcore.AsyncNetworkStream):
        pass

    connection = httpcore.AsyncHTTP11Connection(httpcore.Origin(b"http", b"h", 80), _Stream())
    assert hasattr(connection, "_state_lock") and hasattr(connection, "_h11_state")
