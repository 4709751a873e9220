"""``block`` makes the producer wait, measured at both ends: the upstream times
its own blocked sends, the sidecar's record says how long it held the upstream
unread (``producer_wait_s``); the two agree, and nothing merges."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import RunningSidecar
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG

from tests.middleware.asgi_apps import Hooks, running_server
from tests.middleware.wire_harness import chunk

CHUNKS = 20_000
TEXT = [f"w{i % 1000:03d} " for i in range(CHUNKS)]


@dataclass
class BurstUpstream:
    """A blocking-socket engine that sends its whole answer as fast as TCP lets it,
    timing each send: the sum of the sends' durations is how long it was held."""

    send_buffer_bytes: int = 16 * 1024
    sock: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    held_s: list[float] = field(default_factory=list)
    """Per answer, in the order they ended: the time its sends were held."""
    done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def serve(self) -> None:
        """Answers each connection (the sidecar may open one it never uses) until closed."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    return
                request += data
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            frames = [f"data: {chunk(text)}\n\n".encode() for text in TEXT]
            frames.append(f"data: {chunk(finish='stop')}\n\ndata: [DONE]\n\n".encode())
            held_s = 0.0
            for start in range(0, len(frames), 20):  # about 3.5 KB per send, as an engine flushes
                data = b"".join(frames[start:start + 20])
                began = time.perf_counter()
                conn.sendall(data)
                held_s += time.perf_counter() - began
        self.held_s.append(held_s)
        self.done.release()


@pytest.fixture
def burst() -> Iterator[BurstUpstream]:
    upstream = BurstUpstream()
    thread = threading.Thread(target=upstream.serve, daemon=True)
    thread.start()
    yield upstream
    upstream.sock.close()


def slow_read(port: int, headers: dict[str, str], *, read_bytes: int, pause_s: float) -> bytes:
    """A reader taking ``read_bytes`` every ``pause_s`` through a small receive buffer."""
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n{lines}\r\n{body}".encode())
        received = bytearray()
        while not received.endswith(b"0\r\n\r\n"):
            data = sock.recv(read_bytes)
            if not data:
                break
            received += data
            time.sleep(pause_s)  # the reader's own pace, not a wait for the server
    return bytes(received)


def answer_text(raw: bytes) -> str:
    text = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            payload = json.loads(line[6:])
            text.append(payload["choices"][0]["delta"].get("content") or "")
    return "".join(text)


@pytest.mark.slow
def test_block_holds_the_engine_for_as_long_as_the_record_says(
        burst: BurstUpstream, start_sidecar: Callable[..., RunningSidecar]) -> None:
    """The issue's burst: 20,000 chunks to a reader taking about 4 MB/s through a
    4 KiB receive buffer. Under block the engine's sends are held as long as the
    record says, and nothing merges; under coalesce the engine is never held."""
    sidecar = start_sidecar(burst.url, client_settings=("slow_client_policy=coalesce|block",),
                            heartbeat_s=0.0)
    records = {}
    for policy in ("block", "coalesce"):
        request_id = uuid.uuid4().hex
        raw = slow_read(sidecar.port, {"x-request-id": request_id, "tokenwire-slow-client-policy": policy},
                        read_bytes=16384, pause_s=0.004)
        assert burst.done.acquire(timeout=10)
        records[policy] = record = sidecar.record(request_id)
        assert answer_text(raw) == "".join(TEXT), policy
        assert record.end_reason.value == "complete"
    block, coalesce = records["block"], records["coalesce"]
    block_held_s, coalesce_held_s = burst.held_s
    assert block.coalesced_events == 0 and block.events_out == CHUNKS + 2
    assert coalesce.coalesced_events > CHUNKS // 2  # the same reader, merged
    assert block.pending_high_water_bytes < 256 * 1024
    assert coalesce.producer_wait_s == 0.0 and coalesce_held_s < block_held_s / 4
    assert block_held_s > 1.0  # the reader is the bottleneck: the engine was held
    assert abs(block.producer_wait_s - block_held_s) <= 0.1 * block_held_s, (block.producer_wait_s,
                                                                           block_held_s)
    print(f"\nblock: engine held {block_held_s:.2f} s (measured at the upstream), record "
          f"{block.producer_wait_s:.2f} s, {block.coalesced_events} merged; coalesce: held "
          f"{coalesce_held_s:.2f} s, {coalesce.coalesced_events} merged")


@pytest.mark.slow
def test_block_holds_an_asgi_app_for_as_long_as_the_record_says() -> None:
    """The middleware, under real uvicorn: an app whose every ``send`` is timed is
    held (``send`` waits while the core paused it) as long as its record says."""
    held: list[float] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        frames = [f"data: {chunk(text)}\n\n".encode() for text in TEXT]
        frames.append(f"data: {chunk(finish='stop')}\n\ndata: [DONE]\n\n".encode())
        total = 0.0
        for start in range(0, len(frames), 20):
            began = time.perf_counter()
            await send({"type": "http.response.body", "body": b"".join(frames[start:start + 20]),
                        "more_body": True})
            total += time.perf_counter() - began
        await send({"type": "http.response.body", "body": b""})
        held.append(total)

    hooks = Hooks()
    config = DEFAULT_CONFIG.replace(slow_client_policy="block", heartbeat_s=0.0)
    wrapped = TokenWireMiddleware(app, config, on_finished=hooks.on_finished)
    with running_server(wrapped, "uvicorn-h11") as port:
        raw = slow_read(port, {}, read_bytes=16384, pause_s=0.004)
        record = hooks.wait_record(30)
    assert answer_text(raw) == "".join(TEXT)
    assert record.end_reason.value == "complete" and record.coalesced_events == 0
    assert held and held[0] > 1.0
    assert abs(record.producer_wait_s - held[0]) <= 0.1 * held[0], (record.producer_wait_s, held[0])
    print(f"\nblock, middleware: the app's sends held {held[0]:.2f} s, record {record.producer_wait_s:.2f} s")
