"""SIGTERM on a real process with every kind of connection open: none left hanging.

(The basic drain, a short stream finishing and a long one ended with an
in-band ``shutdown`` error, is in test_process.py.)
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest
from clients import ResponseReader, chat_body, connect, read_response, request_bytes
from processes import spawn
from upstreams import FakeUpstream

pytestmark = pytest.mark.slow

# Long enough that "closed at once" and "closed after the drain" cannot be
# confused on a loaded machine (the sidecar process shares its cores with the
# test), and that the short stream (0.2 s of silence, then its answer) finishes
# inside it there too: at 2 s it was cut once during a full run at load ~10.
_DRAIN_S = 5.0
# server.py's final flush (2 s) plus process exit, with room for a loaded machine.
_EXIT_WITHIN_S = _DRAIN_S + 2.0 + 3.0


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Read until the server closes (EOF or reset); False if it is still open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_shutdown_when_sigterm_with_mixed_connections_then_none_hang_and_exit_0(
        upstream: FakeUpstream) -> None:
    process = spawn(["--upstream", upstream.url, "--drain-s", str(_DRAIN_S),
                     "--socket-send-buffer-bytes", "4096", "--write-high-water-bytes", "4096"])
    long_streams = []
    for i in range(8):
        sock = connect(process.port)
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(), headers={
            "x-fake-silence-s": "60", "X-Request-Id": f"long-{i}"}))
        long_streams.append(ResponseReader(sock))
    short = connect(process.port)
    short.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                headers={"x-fake-silence-s": "0.2"}))
    short_reader = ResponseReader(short)
    # A client that stopped reading: its last bytes can never be flushed.
    stalled = connect(process.port, receive_buffer_bytes=4096)
    stalled.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(), headers={
        "x-fake-tokens": "100000", "x-fake-delay-s": "0.0005", "X-Request-Id": "stalled"}))
    idle = connect(process.port)
    idle.sendall(request_bytes("GET", "/models/v1/models"))
    assert read_response(idle).status == 200
    half_head = connect(process.port)
    half_head.sendall(b"POST /normal/v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    for reader in (*long_streams, short_reader):
        assert reader.read(head_only=True).status == 200
    assert stalled.recv(100).startswith(b"HTTP/1.1 200")

    process.signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    # An idle keep-alive connection carries nothing: closed at once, not after the drain.
    assert _closed_within(idle, _DRAIN_S)
    # A request whose head was still arriving is answered, not dropped: 503 and
    # Retry-After, so its client retries on another replica.
    half_head.sendall(b"Content-Length: 0\r\n\r\n")
    refused = read_response(half_head)
    assert refused.status == 503 and refused.headers["retry-after"] == "1"
    assert _closed_within(half_head, _DRAIN_S)
    finished = short_reader.read()
    assert finished.clean_end and finished.datas()[-1] == "[DONE]"
    for reader in long_streams:
        ended = reader.read()
        assert not ended.clean_end
        assert json.loads(ended.datas()[-1])["error"]["code"] == "shutdown"
    assert _closed_within(stalled, _EXIT_WITHIN_S), "the stalled client's connection was left open"
    assert process.process.wait(_EXIT_WITHIN_S) == 0
    assert time.monotonic() - signalled_at < _EXIT_WITHIN_S
    for i in range(8):
        assert upstream.connection_of(f"long-{i}").closed.wait(2)
    assert upstream.connection_of("stalled").closed.wait(2)
    # What an operator reads of it: start, the drain beginning and ending, the exit.
    assert process.process.stderr is not None
    said = [json.loads(line)["msg"] for line in process.process.stderr.read().decode().splitlines()
            if line.startswith("{")]
    lifecycle = [message for message in said if message.startswith(("started:", "drain", "exiting"))]
    # (The short stream may end before the signal on a loaded machine: its count is not fixed.)
    patterns = [rf"started: listening on 127\.0\.0\.1:{process.port}, config \(no file\), "
                rf"upstreams {re.escape(upstream.url)}",
                r"draining: (9|10) open streams on 1[12] connections, for up to 5 s",
                r"drain time over: ended 9 open streams", "exiting"]
    assert len(lifecycle) == len(patterns), said
    assert all(re.fullmatch(pattern, line) for pattern, line in zip(patterns, lifecycle, strict=True)), said
    for sock in (short, stalled, idle, half_head, *(reader.sock for reader in long_streams)):
        sock.close()


def test_shutdown_when_connections_wait_in_the_backlog_then_each_is_answered(upstream: FakeUpstream) -> None:
    """Connections the kernel already established but the sidecar has not
    accepted yet (its backlog) when SIGTERM comes: closing the listening
    socket would reset each, and their clients, whose connect() succeeded,
    would get a reset for their request. They are accepted first, and served
    or refused with 503 and Retry-After like any connection during a drain."""
    process = spawn(["--upstream", upstream.url, "--drain-s", str(_DRAIN_S)])
    socks = []
    process.signal(signal.SIGSTOP)  # nothing accepted while the clients connect
    try:
        for _ in range(20):  # more than a loop turn accepts
            sock = connect(process.port)
            sock.sendall(request_bytes("GET", "/models/v1/models"))
            socks.append(sock)
        process.signal(signal.SIGTERM)  # pending until the process runs again
    finally:
        process.signal(signal.SIGCONT)
    statuses = []
    for sock in socks:
        response = read_response(sock)  # status 0: closed (reset) with no answer
        statuses.append(response.status)
        if response.status == 503:
            assert response.headers["retry-after"] == "1"
        sock.close()
    assert 0 not in statuses, f"{statuses.count(0)} of 20 queued clients got no answer"
    assert set(statuses) <= {200, 503}
    assert process.process.wait(_EXIT_WITHIN_S) == 0
