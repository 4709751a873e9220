"""Random bytes, split at random, at the sidecar's client side.

Whatever arrives, the sidecar answers with an error status or closes the
connection: no exception escapes its protocol callbacks, and the next
well-formed request on a new connection is served.
"""

from __future__ import annotations

import contextlib
import socket
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from clients import chat_body, connect, exchange, wait_for
from conftest import LoopThread
from hypothesis import given, settings
from hypothesis import strategies as st

# Garbage after a plausible start reaches the header, body and chunk parsers too.
_PREFIXES = [b"", b"GET / HTTP/1.1\r\n", b"POST /normal/v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
             b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
             b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"]


def _send_and_read(port: int, data: bytes, cuts: list[int]) -> bytes:
    with connect(port, timeout_s=3.0) as sock:
        start = 0
        for cut in cuts:
            sock.sendall(data[start:start + cut])
            start += cut
        with contextlib.suppress(OSError):  # the sidecar may already have answered and closed
            sock.sendall(data[start:])
            sock.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
        return received


def test_downstream_when_random_bytes_in_random_splits_then_error_or_close_and_still_serving(
        start_sidecar: Callable[..., Any], loop_thread: LoopThread) -> None:
    sidecar = start_sidecar(header_read_timeout_s=0.3, body_read_timeout_s=0.3, keepalive_timeout_s=0.3)
    errors: list[dict[str, Any]] = []
    loop = loop_thread.loop
    previous = loop_thread.call(loop.get_exception_handler)
    loop_thread.call(lambda: loop.set_exception_handler(lambda _, context: errors.append(context)))

    @settings(max_examples=60, deadline=None)
    @given(prefix=st.sampled_from(_PREFIXES), garbage=st.binary(min_size=1, max_size=600),
           cuts=st.lists(st.integers(min_value=1, max_value=64), max_size=6))
    def one_connection(prefix: bytes, garbage: bytes, cuts: list[int]) -> None:
        answer = _send_and_read(sidecar.port, prefix + garbage, cuts)
        # An error status for garbage, or a plain close; never a hang, never a crash.
        assert answer == b"" or answer.startswith(b"HTTP/1.1 "), answer[:80]
        assert not errors, errors

    try:
        one_connection()
    finally:
        loop_thread.call(lambda: loop.set_exception_handler(previous))
    served = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                      headers={"x-fake-tokens": "2"})
    assert served.status == 200 and served.clean_end
    # Nothing is left behind by all that garbage: every connection closed and forgotten.
    context = sidecar.sidecar.context
    wait_for(lambda: loop_thread.call(lambda: len(context.connections)) == 0)
    assert len(context.registry) == 0


@pytest.mark.parametrize("prefix", [b"", b"GET / HTTP/1.1\r\nX-Long: "])
def test_downstream_when_megabytes_of_head_garbage_then_memory_stays_bounded(
        start_sidecar: Callable[..., Any], prefix: bytes) -> None:
    """4 MiB that never completes a head, in 16 KiB writes: the sidecar answers
    431 (or closes) and its traced memory (the loop runs in this process) never
    grows by more than 1 MiB: it keeps about ``max_head_bytes`` (64 KiB), not 4 MiB."""
    sidecar = start_sidecar()
    garbage = bytes(range(33, 127)) * 200  # no CR/LF: never a complete line
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        sent = 0
        with connect(sidecar.port, timeout_s=5.0) as sock:
            with contextlib.suppress(OSError):  # closed by the sidecar mid-way: the point
                sock.sendall(prefix)
                while sent < 4 << 20:
                    sock.sendall(garbage[:16384] if len(garbage) >= 16384 else garbage * 2)
                    sent += 16384
            answer = b""
            with contextlib.suppress(OSError):
                answer = sock.recv(65536)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431") or answer.startswith(b"HTTP/1.1 400"), \
        answer[:80]
    # (All 4 MiB may well be sent: after its 431 the sidecar closes lingeringly,
    # draining and dropping what the client still sends, as nginx does.)
    assert peak - baseline < 1 << 20, f"traced memory grew by {(peak - baseline) / 1024:.0f} KiB"
