"""A pooled upstream connection is reused only after a response that ended
exactly where its framing says: a byte past it (a body after a HEAD answer,
more than Content-Length, anything after the last chunk) would otherwise be
read by the next request on that connection as the start of its answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator

import pytest
from clients import (
    RawResponse,
    chat_body,
    connect,
    exchange,
    read_response,
    request_bytes,
    sse_datas,
    wait_for,
)
from conftest import LoopThread, RunningSidecar
from upstreams import ScriptedUpstream

StartSidecar = Callable[..., RunningSidecar]
# What a poisoned connection would hand the next request: a whole, valid answer.
_SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 6\r\n\r\n\"EVIL\""
_REQUEST_LINE = re.compile(rb"([A-Z]+) (/\S*) HTTP/1\.1\r\n")


def _json(status: int, body: bytes, *, extra: bytes = b"", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b%b"
            % (status, length, body, extra))


def _answer(path: bytes) -> bytes:
    return json.dumps({"answer": path.decode()}).encode()


def _sse(path: bytes, tail: bytes) -> bytes:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%b"}}]}\n\n' % path
    done = b"data: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n" % (len(event), event) + b"%x\r\n%b\r\n" % (len(done), done)
            + b"0\r\n\r\n" + tail)


@pytest.fixture
def sidecar_of_pooled() -> dict[str, RunningSidecar]:
    return {}


@pytest.fixture
def pooled(loop_thread: LoopThread, start_sidecar: StartSidecar,
           sidecar_of_pooled: dict[str, RunningSidecar]) -> Iterator[tuple[ScriptedUpstream, int]]:
    """A scripted upstream whose answer to ``/bad-*`` oversteps its framing; every
    other path gets a well-framed JSON answer naming that path."""
    upstream: ScriptedUpstream

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, path = _REQUEST_LINE.findall(bytes(upstream.received))[-1]
        if path.startswith(b"/bad-head"):
            # HEAD: the length a GET would have, and then (wrongly) that body.
            response = _json(200, b"", extra=_SMUGGLED, length=len(_SMUGGLED))
        elif path.startswith(b"/bad-length"):
            response = _json(200, b"ok", extra=_SMUGGLED)
        elif path.startswith(b"/bad-chunked"):
            response = _sse(path, _SMUGGLED)
        elif path.startswith(b"/good-sse"):
            response = _sse(path, b"")
        elif path.startswith(b"/bytewise"):
            # One byte per write: the head's end and every chunk line straddle reads.
            for byte in _sse(path, b""):
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0)
            return
        else:
            response = _json(200, b"" if method == b"HEAD" else _answer(path),
                             length=len(_answer(path)))
        writer.write(response)
        await writer.drain()

    upstream = ScriptedUpstream(respond)
    loop_thread.run(upstream.start())
    sidecar = start_sidecar(upstream.url)
    sidecar_of_pooled["sidecar"] = sidecar
    yield upstream, sidecar.port
    loop_thread.run(upstream.stop())


def _head(port: int, path: str) -> RawResponse:
    """A HEAD request; only the head is read (a test client cannot know that
    a Content-Length in a HEAD answer announces no body)."""
    with connect(port) as sock:
        sock.sendall(request_bytes("HEAD", path))
        return read_response(sock, head_only=True)


def _next_answer_is_its_own(port: int) -> None:
    response = exchange(port, "GET", "/next")
    assert response.status == 200
    assert json.loads(response.body) == {"answer": "/next"}


def test_well_framed_responses_reuse_one_connection(pooled: tuple[ScriptedUpstream, int]) -> None:
    """The control: without a framing fault the pool keeps the connection."""
    upstream, port = pooled
    assert _head(port, "/first").status == 200
    _next_answer_is_its_own(port)
    assert sse_datas(exchange(port, "POST", "/good-sse", body=chat_body()).body)[-1] == "[DONE]"
    _next_answer_is_its_own(port)
    assert upstream.connections == 1


def test_head_answer_with_a_body_is_not_handed_to_the_next_client(
        pooled: tuple[ScriptedUpstream, int]) -> None:
    upstream, port = pooled
    response = _head(port, "/bad-head")
    assert response.status == 200
    assert response.headers["content-length"] == str(len(_SMUGGLED))
    _next_answer_is_its_own(port)
    assert upstream.connections == 2  # the poisoned connection was closed, not pooled


def test_more_than_content_length_closes_the_connection(pooled: tuple[ScriptedUpstream, int]) -> None:
    upstream, port = pooled
    response = exchange(port, "GET", "/bad-length")
    assert response.body == b"ok"
    _next_answer_is_its_own(port)
    assert upstream.connections == 2


def test_bytes_after_the_last_chunk_close_the_connection(pooled: tuple[ScriptedUpstream, int]) -> None:
    upstream, port = pooled
    response = exchange(port, "POST", "/bad-chunked", body=chat_body())
    datas = sse_datas(response.body)
    assert datas[-1] == "[DONE]"
    assert "/bad-chunked" in datas[0]
    _next_answer_is_its_own(port)
    assert upstream.connections == 2


def test_an_answer_cut_into_single_bytes_is_read_whole_and_the_connection_reused(
        pooled: tuple[ScriptedUpstream, int], loop_thread: LoopThread,
        sidecar_of_pooled: dict[str, RunningSidecar]) -> None:
    upstream, port = pooled
    datas = sse_datas(exchange(port, "POST", "/bytewise", body=chat_body()).body)
    assert datas[-1] == "[DONE]" and "/bytewise" in datas[0]
    # The client has its answer at [DONE]; the chunked terminator is still
    # arriving a byte at a time. Once read, the connection is idle in the pool.
    context = sidecar_of_pooled["sidecar"].sidecar.context
    assert context is not None
    pool = context.pools.upstreams[0].pool

    def idle() -> bool:
        return any(c.is_idle() for c in pool.connections)

    wait_for(lambda: loop_thread.call(idle), timeout_s=10)
    _next_answer_is_its_own(port)
    assert upstream.connections == 1
