"""A pooled upstream connection handed to the next request must be one that
can carry it.

* A connection cut for a departed client is never reused: the client can leave
  in the instant between the upstream's last byte and the connection's return
  to the pool, and the cut connection (shut down, not yet closed) must not be
  handed to the request waiting for it.
"""

from __future__ import annotations

import asyncio
import fcntl
import re
import socket
import struct
import termios
import time
from collections.abc import Callable

from clients import chat_body, connect, read_response, request_bytes, reset, sse_datas, wait_for
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


def test_aClientLeavingAsItsResponseEnds_neverHandsTheCutConnectionToTheNextRequest(
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
        pools = context.pools.upstreams[0].pools
        assert len(pools) == 1
        # httpcore's own description of its pool: the second request waits for the connection.
        wait_for(lambda: "1 queued" in loop_thread.call(lambda: repr(pools[0])), timeout_s=10)

        def last_chunk_and_the_client_leaving_in_one_turn() -> None:
            # Runs on the loop: nothing the sidecar does happens until it returns,
            # so its next poll finds the last chunk first, then the reset.
            writer = writers["first"]
            writer.write(_LAST_CHUNK)
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
        # The cut connection was closed, not reused: the second request had a new one.
        assert upstream.connections == 2
        # And the race did happen: the first stream ended because its client left,
        # not complete (which would mean the reset came too late to cut anything).
        wait_for(lambda: len(sidecar.log.records) == 2, timeout_s=10)
        reasons = sorted(record.end_reason.value for record in sidecar.log.records)
        assert reasons == ["client_gone", "complete"]
    finally:
        loop_thread.run(upstream.stop())
