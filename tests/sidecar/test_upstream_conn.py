"""The sidecar's own HTTP/1.1 upstream connection (``sidecar/upstream/conn.py``),
through ``run_attempt`` and the pool, against real servers on 127.0.0.1.

Each upstream here is a small asyncio protocol that answers every whole request
(a head and its Content-Length body) with scripted bytes, written in the
pieces a test chooses (one byte at a time, a head split anywhere, 1xx heads
first), and counts the connections it accepted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import typing
from collections.abc import Callable

import pytest
from conftest import LoopThread
from tokenwire.middleware import Input, UpstreamData, UpstreamEnded, UpstreamFailed, UpstreamHeaders
from tokenwire.sidecar.upstream.attempt import Upstream, run_attempt
from tokenwire.sidecar.upstream.conn import MAX_HEAD_BYTES, Origin
from tokenwire.sidecar.upstream.pool import UpstreamPool

_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
_CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(_EVENT), _EVENT))
_TIMEOUTS: dict[str, float | None] = {"connect": 5.0, "pool": 5.0, "read": None, "write": None}


class _Upstream(asyncio.Protocol):
    """Answers each whole request with ``answer``, in ``pieces`` (sizes; the
    rest in one), closing after it if ``close_after``."""

    answer = _CHUNKED
    pieces: tuple[int, ...] = ()
    close_after = False
    connections = 0
    requests: list[bytes] = []

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
            type(self).requests.append(head + b"\r\n\r\n" + rest[:length])
            asyncio.get_running_loop().create_task(self._answer())

    async def _answer(self) -> None:
        answer = self.answer
        for size in self.pieces:
            self.transport.write(answer[:size])
            answer = answer[size:]
            await asyncio.sleep(0.001)  # separate reads for the sidecar, not timing
        self.transport.write(answer)
        if self.close_after:
            self.transport.close()


def _attempts(loop_thread: LoopThread, count: int, *, method: bytes = b"POST",
              configure: Callable[[type[_Upstream]], None] = lambda upstream: None,
              ) -> tuple[list[list[Input]], int, UpstreamPool]:
    """``count`` attempts one after another through one pool; what each fed,
    and how many connections the upstream accepted."""

    class Scripted(_Upstream):
        connections = 0
        requests: list[bytes] = []

    configure(Scripted)

    async def scenario() -> tuple[list[list[Input]], int, UpstreamPool]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Scripted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(Origin(b"127.0.0.1", port, b"127.0.0.1:%d" % port), max_connections=4,
                            keepalive_expiry_s=5.0)
        upstream = Upstream(f"http://127.0.0.1:{port}", b"http", b"127.0.0.1", port, b"", pool)
        readable = asyncio.Event()
        readable.set()
        runs: list[list[Input]] = []
        try:
            for _ in range(count):
                fed: list[Input] = []

                def body(chunks: list[bytes], fed: list[Input] = fed) -> None:
                    fed.extend(UpstreamData(chunk) for chunk in chunks)

                await run_attempt(upstream, method=method, target=b"/v1/chat/completions",
                                  headers=[(b"content-type", b"application/json"), (b"content-length", b"2")],
                                  body=b"{}", timeouts=_TIMEOUTS, readable=readable, feed=fed.append,
                                  feed_body=body)
                runs.append(fed)
        finally:
            await pool.aclose()
            server.close()
        return runs, Scripted.connections, pool

    return loop_thread.run(scenario())


def _body(fed: list[Input]) -> bytes:
    return b"".join(event.data for event in fed if isinstance(event, UpstreamData))


def test_sequential_streams_share_one_kept_alive_connection(loop_thread: LoopThread) -> None:
    """Three chunked answers in a row: each attempt reports its head, its event
    and its end, and the connection goes back to the pool for the next one."""
    runs, connections, _ = _attempts(loop_thread, 3)
    for fed in runs:
        assert [type(event) for event in fed] == [UpstreamHeaders, UpstreamData, UpstreamEnded]
        assert _body(fed) == _EVENT
        headers = fed[0]
        assert isinstance(headers, UpstreamHeaders)
        assert headers.status == 200 and (b"content-type", b"text/event-stream") in headers.headers
    assert connections == 1


def test_the_request_names_the_pods_host_and_its_bodys_length(loop_thread: LoopThread) -> None:
    seen: list[bytes] = []
    _attempts(loop_thread, 1, configure=lambda upstream: setattr(upstream, "requests", seen))
    assert re.fullmatch(rb"POST /v1/chat/completions HTTP/1\.1\r\nHost: 127\.0\.0\.1:\d+\r\n"
                        rb"content-type: application/json\r\ncontent-length: 2\r\n\r\n\{\}", seen[0])


@pytest.mark.parametrize("pieces", [tuple([1] * 120), (17,), (70, 3), (len(_CHUNKED) - 3,)])
def test_a_head_cut_anywhere_is_read_whole(loop_thread: LoopThread, pieces: tuple[int, ...]) -> None:
    runs, connections, _ = _attempts(loop_thread, 2,
                                     configure=lambda upstream: setattr(upstream, "pieces", pieces))
    for fed in runs:
        assert isinstance(fed[0], UpstreamHeaders) and isinstance(fed[-1], UpstreamEnded)
        assert _body(fed) == _EVENT
    assert connections == 1


def test_informational_heads_are_skipped(loop_thread: LoopThread) -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + _CHUNKED
    runs, connections, _ = _attempts(loop_thread, 2, configure=lambda upstream: (
        setattr(upstream, "answer", answer), setattr(upstream, "pieces", (30, 5))))
    for fed in runs:
        head = fed[0]
        assert isinstance(head, UpstreamHeaders) and head.status == 200
        assert _body(fed) == _EVENT and isinstance(fed[-1], UpstreamEnded)
    assert connections == 1


@pytest.mark.parametrize(("answer", "reused"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello", False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloEXTRA", False),  # past its framing
    (_CHUNKED + b"HTTP/1.1 200 OK\r\n", False),
])
def test_only_a_response_ended_cleanly_leaves_its_connection_for_the_next(
        loop_thread: LoopThread, answer: bytes, reused: bool) -> None:
    runs, connections, _ = _attempts(loop_thread, 2,
                                     configure=lambda upstream: setattr(upstream, "answer", answer))
    for fed in runs:
        assert isinstance(fed[-1], UpstreamEnded)
    assert connections == (1 if reused else 2)


def test_a_body_to_the_close_is_read_to_the_close(loop_thread: LoopThread) -> None:
    def configure(upstream: type[_Upstream]) -> None:
        upstream.answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"
        upstream.pieces = (40, 3)
        upstream.close_after = True

    runs, connections, _ = _attempts(loop_thread, 2, configure=configure)
    for fed in runs:
        assert _body(fed) == b"all of it" and isinstance(fed[-1], UpstreamEnded)
    assert connections == 2


def test_a_head_answer_has_no_body(loop_thread: LoopThread) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
    runs, connections, _ = _attempts(loop_thread, 2, method=b"HEAD",
                                     configure=lambda upstream: setattr(upstream, "answer", answer))
    assert [[type(event) for event in fed] for fed in runs] == [[UpstreamHeaders, UpstreamEnded]] * 2
    assert connections == 1


@pytest.mark.parametrize(("answer", "error"), [
    (b"", "Server disconnected without sending a response"),
    (b"HTTP/1.1 200 OK\r\ncontent-le", "closed in the middle of a response head"),
    (b"HTTP/1.1 200 OK\r\nx-a: " + b"a" * MAX_HEAD_BYTES, "over 102400 bytes"),
    (b"HTTP/1.1 200 OK\r\nx a: b\r\n\r\n", "illegal header line"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel", "2 bytes before the end of its 5-byte body"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", "conflicting Content-Length"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "asked for no upgrade"),
])
def test_a_broken_answer_is_a_failure_that_says_what(
        loop_thread: LoopThread, answer: bytes, error: str, caplog: pytest.LogCaptureFixture) -> None:
    """The log says what the pod sent wrong; the caller's words (the core puts
    them in the in-band error) name no class or library."""
    def configure(upstream: type[_Upstream]) -> None:
        upstream.answer = answer
        upstream.close_after = True

    with caplog.at_level(logging.WARNING, logger="tokenwire.sidecar"):
        runs, _, pool = _attempts(loop_thread, 1, configure=configure)
    failed = runs[0][-1]
    assert isinstance(failed, UpstreamFailed), runs[0]
    logged = [record.getMessage() for record in caplog.records if " failed: " in record.getMessage()]
    assert len(logged) == 1 and error in logged[0] and "POST /v1/chat/completions" in logged[0], logged
    assert logged[0].split(" failed: ")[1].startswith(("RemoteProtocolFault", "ReadFailed", "CutShort"))
    assert failed.message in {"the answer was not valid HTTP/1.1", "the connection broke during the answer",
                              "the upstream closed the connection before its answer ended"}, failed.message
    assert pool.connections == []  # closed, not pooled
