"""A pooled upstream connection handed to the next request must be one that
can carry it.

* A connection cut for a departed client is never reused: the client can leave
  in the instant between the upstream's last byte and the connection's return
  to the pool, and the cut connection (shut down, not yet closed) must not be
  handed to the request waiting for it.
* A request that went out on a reused keep-alive connection the upstream
  closed as it arrived (before any byte of answer) is re-sent once on another
  connection, if it may reach the upstream twice (an idempotent method or an
  ``Idempotency-Key``); a POST without one is not, as nginx does.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import re
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from clients import chat_body, connect, exchange, read_response, request_bytes, reset, sse_datas, wait_for
from conftest import LoopThread, RunningSidecar
from upstreams import ScriptedUpstream

StartSidecar = Callable[..., RunningSidecar]

_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_REQUEST_LINE = re.compile(rb"[A-Z]+ (/\S*) HTTP/1\.1\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _unsent_bytes(sock: socket.socket) -> int:
    """Bytes written to ``sock`` its peer has not acknowledged (``SIOCOUTQ``):
    0 on loopback means they are in the peer's receive queue."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def test_a_client_leaving_as_its_response_ends_never_hands_the_cut_connection_to_the_next_request(
        loop_thread: LoopThread, start_sidecar: StartSidecar) -> None:
    """One upstream connection allowed, so the second request waits in the pool
    for the first one's. The first client resets its socket in the same loop
    turn as the upstream's last chunk arrives: the sidecar reads the chunk
    (the response is complete, the connection about to go back to the pool),
    then the reset (the client left: the connection is cut). The waiting
    request must get a fresh connection and its own whole answer, not a 502
    ("Server disconnected without sending a response") from the cut one."""
    writers: dict[str, asyncio.StreamWriter] = {}
    finish_first = asyncio.Event()

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if _REQUEST_LINE.findall(bytes(upstream.received))[-1] == b"/first":
            writers["first"] = writer
            writer.write(_SSE_HEAD + _chunk(_EVENT))
            await writer.drain()
            await finish_first.wait()  # the last chunk is written by the test, below
            return
        await upstream.send(writer, _SSE_HEAD + _chunk(_EVENT) + _chunk(b"data: [DONE]\n\n") + _LAST_CHUNK)

    upstream = ScriptedUpstream(respond)
    loop_thread.run(upstream.start())
    try:
        sidecar = start_sidecar(upstream.url, upstream_max_connections=1)
        context = sidecar.sidecar.context
        assert context is not None

        first = connect(sidecar.port)
        first.sendall(request_bytes("POST", "/first", body=chat_body()))
        head = first.recv(65536)
        while _EVENT.strip() not in head:
            head += first.recv(65536)
        assert head.startswith(b"HTTP/1.1 200")

        second = connect(sidecar.port)
        second.sendall(request_bytes("POST", "/second", body=chat_body()))
        pool = context.pools.upstreams[0].pool
        # The pool's description: the second request waits for the connection.
        wait_for(lambda: "1 queued" in loop_thread.call(lambda: repr(pool)), timeout_s=10)

        def last_chunk_and_the_client_leaving_in_one_turn() -> None:
            # Runs on the loop: nothing the sidecar does happens until it returns,
            # so its next poll finds the last chunk first, then the reset.
            writer = writers["first"]
            writer.write(_LAST_CHUNK)
            assert writer.transport.get_write_buffer_size() == 0  # in the kernel now, not held back
            upstream_socket = writer.get_extra_info("socket")
            deadline = time.monotonic() + 10
            while _unsent_bytes(upstream_socket) and time.monotonic() < deadline:
                time.sleep(0.001)
            reset(first)
            finish_first.set()

        loop_thread.call(last_chunk_and_the_client_leaving_in_one_turn)

        response = read_response(second, timeout_s=10)
        second.close()
        assert response.status == 200, response.body
        assert sse_datas(response.body)[-1] == "[DONE]"
        # The cut connection was closed, not reused: the second request had a new
        # one at once, not after failing on the cut one (a re-send would save it
        # there, since none of it could be written: the second line of defence).
        assert upstream.connections == 2
        assert context.pools.resent(upstream.url) == 0
        # And the race did happen: the first stream ended because its client left,
        # not complete (which would mean the reset came too late to cut anything:
        # the test would no longer test the race, and says so). The cut lands in
        # the moment the attempt gives way (httpcore's pool lock) before the
        # pool takes the connection back.
        wait_for(lambda: len(sidecar.log.records) == 2, timeout_s=10)
        reasons = sorted(record.end_reason.value for record in sidecar.log.records)
        assert reasons == ["client_gone", "complete"]
    finally:
        loop_thread.run(upstream.stop())


class ClosingOnReuse:
    """An upstream that answers the first request on each connection (keep-alive)
    and closes the connection when a second one arrives on it, without a byte
    of answer: the wire picture of an upstream that closed the idle connection
    just as the next request went out. ``close`` says how: ``fin`` after
    reading the request, ``rst`` (linger 0) as a closed socket answers data."""

    def __init__(self, close: str) -> None:
        self.close = close
        self.served: dict[asyncio.StreamWriter, int] = {}
        self.paths: list[bytes] = []
        self.upstream = ScriptedUpstream(self.respond)

    async def respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = _REQUEST_LINE.findall(bytes(self.upstream.received))[-1]
        self.paths.append(path)
        served = self.served[writer] = self.served.get(writer, 0) + 1
        if served > 1:
            if self.close == "rst":
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
            raise ConnectionResetError("closed on reuse")  # ends ScriptedUpstream's loop
        body = b'{"answer":"%b"}' % path
        await self.upstream.send(writer, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                         b"content-length: %d\r\n\r\n%b" % (len(body), body))


@pytest.fixture(params=["fin", "rst"])
def closing_on_reuse(request: pytest.FixtureRequest, loop_thread: LoopThread) -> Iterator[ClosingOnReuse]:
    upstream = ClosingOnReuse(request.param)
    loop_thread.run(upstream.upstream.start())
    yield upstream
    loop_thread.run(upstream.upstream.stop())


def _wait_for_an_idle_pooled_connection(sidecar: RunningSidecar, loop_thread: LoopThread) -> None:
    """Until the last answer's upstream connection is back in the pool, idle."""
    context = sidecar.sidecar.context
    assert context is not None
    pool = context.pools.upstreams[0].pool

    def idle() -> bool:
        return any(c.is_idle() for c in pool.connections)

    wait_for(lambda: loop_thread.call(idle), timeout_s=10)


def _second_request_on_a_closing_connection(
        upstream: ClosingOnReuse, sidecar: RunningSidecar, loop_thread: LoopThread,
        method: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """The first request opens the connection and leaves it idle in the pool;
    the second goes out on it and meets the close. Its status and body."""
    body = chat_body(stream=False) if method == "POST" else b""
    first = exchange(sidecar.port, method, "/one", body=body, headers=headers)
    assert first.status == 200 and first.body == b'{"answer":"/one"}'
    _wait_for_an_idle_pooled_connection(sidecar, loop_thread)
    second = exchange(sidecar.port, method, "/two", body=body, headers=headers)
    return second.status, second.body


def _metric(sidecar: RunningSidecar, name: str, upstream: str) -> float:
    text = httpx.get(sidecar.admin_url + "/metrics").text
    line = f'{name}{{upstream="{upstream}"}} '
    values = [float(row[len(line):]) for row in text.splitlines() if row.startswith(line)]
    assert values, f"{name} for {upstream} not in the metrics"
    return values[0]


@pytest.mark.parametrize(("method", "headers"), [
    ("GET", None),
    ("POST", {"Idempotency-Key": "req-1"}),
], ids=["GET", "POST-with-Idempotency-Key"])
def test_a_request_on_a_reused_connection_the_upstream_closed_is_resent_once(
        closing_on_reuse: ClosingOnReuse, start_sidecar: StartSidecar, loop_thread: LoopThread,
        method: str, headers: dict[str, str] | None, caplog: pytest.LogCaptureFixture) -> None:
    """No core retries here (``retry_attempts = 0``): the answer comes from the
    re-send alone, on a new connection, and the upstream is not blamed."""
    upstream = closing_on_reuse
    sidecar = start_sidecar(upstream.upstream.url, retry_attempts=0)
    with caplog.at_level(logging.INFO, logger="tokenwire.sidecar"):
        status, body = _second_request_on_a_closing_connection(upstream, sidecar, loop_thread, method,
                                                               headers)
    resent = [r.getMessage() for r in caplog.records if "re-sent" in r.getMessage()]
    assert len(resent) == 1 and f"{method} /two re-sent" in resent[0], resent
    assert (status, body) == (200, b'{"answer":"/two"}')
    assert upstream.paths == [b"/one", b"/two", b"/two"]  # on the closing connection, then a new one
    assert upstream.upstream.connections == 2
    address = upstream.upstream.url
    assert _metric(sidecar, "tokenwire_upstream_resent_total", address) == 1.0
    assert _metric(sidecar, "tokenwire_upstream_failures_total", address) == 0.0
    assert [record.retries for record in sidecar.log.records] == [0, 0]


def test_a_post_without_idempotency_key_is_not_resent(
        closing_on_reuse: ClosingOnReuse, start_sidecar: StartSidecar, loop_thread: LoopThread) -> None:
    """The upstream may have read it before it closed: sent again, it could
    start a second generation. It fails as before (502), sent once."""
    upstream = closing_on_reuse
    sidecar = start_sidecar(upstream.upstream.url)
    status, body = _second_request_on_a_closing_connection(upstream, sidecar, loop_thread, "POST")
    assert status == 502, body
    assert upstream.paths == [b"/one", b"/two"]
    assert _metric(sidecar, "tokenwire_upstream_resent_total", upstream.upstream.url) == 0.0


def test_a_fresh_connection_closed_before_any_answer_is_not_resent(
        loop_thread: LoopThread, start_sidecar: StartSidecar) -> None:
    """Only a reused connection is the keep-alive race: an upstream that closes
    a new connection on its first request is failing, and that is the core's
    to retry or not (here: not, ``retry_attempts = 0``)."""

    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()
        raise ConnectionResetError("closed at once")

    upstream = ScriptedUpstream(close)
    loop_thread.run(upstream.start())
    try:
        sidecar = start_sidecar(upstream.url, retry_attempts=0)
        assert exchange(sidecar.port, "GET", "/one").status == 502
        assert upstream.connections == 1
        assert _metric(sidecar, "tokenwire_upstream_resent_total", upstream.url) == 0.0
    finally:
        loop_thread.run(upstream.stop())


@pytest.mark.parametrize("key", [None, "chat-1"], ids=["no-key", "Idempotency-Key"])
def test_the_openai_sdks_post_is_resent_only_with_an_idempotency_key(
        closing_on_reuse: ClosingOnReuse, start_sidecar: StartSidecar, loop_thread: LoopThread,
        key: str | None) -> None:
    """The real openai SDK sends no ``Idempotency-Key`` on a chat completion
    (checked here, as SDKs change): its POST meeting the race is a 502, as
    nginx would answer; given the key (``extra_headers``), it is re-sent. The
    SDK's own retries are off: the answer must come from the sidecar."""
    import openai

    upstream = closing_on_reuse
    sidecar = start_sidecar(upstream.upstream.url, retry_attempts=0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sidecar.port}/v1", api_key="k", max_retries=0)
    extra_headers = {} if key is None else {"Idempotency-Key": key}
    statuses = []
    for turn in range(2):
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_headers=extra_headers)
        except openai.APIStatusError as error:
            assert error.request.headers.get("Idempotency-Key") == key
            statuses.append(error.status_code)
        else:
            assert raw.http_request.headers.get("Idempotency-Key") == key
            assert raw.http_response.json() == {"answer": "/v1/chat/completions"}
            statuses.append(raw.status_code)
        if turn == 0:  # the first answer's connection idle in the pool, as the second goes out
            _wait_for_an_idle_pooled_connection(sidecar, loop_thread)
    resent = key is not None
    assert statuses == [200, 200 if resent else 502]
    assert len(upstream.paths) == (3 if resent else 2)  # a re-send reaches the upstream once more
    assert _metric(sidecar, "tokenwire_upstream_resent_total", upstream.upstream.url) == float(resent)
