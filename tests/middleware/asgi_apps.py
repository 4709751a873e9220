"""Helpers for the ASGI middleware tests: real servers on 127.0.0.1, raw clients.

Each server runs in its own thread with its own event loop, bound to a free
port, so tests can use blocking sockets and the synchronous OpenAI SDK.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from tokenwire.middleware.core.record import StreamRecord

from tokenwire.tools.sse_client import read_response as read_sse_response

SERVERS = ("uvicorn-h11", "uvicorn-httptools", "hypercorn")

ASGIApp = Callable[..., Awaitable[None]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_server(app: ASGIApp, server: str, *, lifespan: str = "off",
                   send_buffer_bytes: int | None = None) -> Iterator[int]:
    """Serve ``app`` with ``server`` (one of SERVERS) on a free port; yield the port.

    ``send_buffer_bytes`` caps SO_SNDBUF of accepted connections (set on the
    listener, which Linux copies), so a slow reader is seen by the server soon.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if server.startswith("uvicorn"):
        config = uvicorn.Config(app, http=server.split("-")[1], lifespan=lifespan, loop="asyncio",
                                log_level="critical", access_log=False, date_header=False,
                                server_header=False, ws="websockets-sansio")
        uv = uvicorn.Server(config)
        thread = threading.Thread(target=lambda: asyncio.run(uv.serve(sockets=[sock])), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not uv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        try:
            yield port
        finally:
            uv.should_exit = True
            thread.join(10)
            sock.close()
        return
    sock.listen(128)
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) the listener
    config.include_date_header = False
    config.include_server_header = False
    config.loglevel = "CRITICAL"
    config.accesslog = None
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("hypercorn did not start") from None
            time.sleep(0.02)
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


@dataclass
class Hooks:
    """Records what the middleware's hooks saw, with monotonic timestamps."""

    aborts: list[tuple[str, str, float]] = field(default_factory=list)
    records: list[StreamRecord] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)

    def on_abort(self, request_id: str, reason: str) -> None:
        self.aborts.append((request_id, reason, time.monotonic()))

    def on_finished(self, record: StreamRecord) -> None:
        self.records.append(record)
        self.finished.set()

    def wait_record(self, timeout_s: float = 5.0) -> StreamRecord:
        assert self.finished.wait(timeout_s), "no accounting record"
        return self.records[-1]


def chat_chunk(text: str, index: int = 0, *, finish: str | None = None) -> str:
    """One OpenAI chat.completion.chunk as JSON."""
    delta: dict[str, Any] = {"content": text} if finish is None else {}
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                       "model": "tiny", "choices": [{"index": index, "delta": delta,
                                                     "finish_reason": finish}]},
                      separators=(",", ":"))


async def chat_events(count: int, delay_s: float = 0.0) -> AsyncIterator[str]:
    """``count`` text chunks, a finish chunk and [DONE], as SSE text."""
    for i in range(count):
        yield f"data: {chat_chunk(f't{i} ')}\n\n"
        if delay_s:
            await asyncio.sleep(delay_s)
    yield f"data: {chat_chunk('', finish='stop')}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- raw HTTP client


@dataclass
class RawResponse:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool
    """True if the body ended with its terminator; False if the connection was cut."""
    raw: bytes


def open_request(port: int, path: str = "/", *, method: str = "GET", body: bytes = b"",
                 headers: tuple[tuple[str, str], ...] = (), rcvbuf: int | None = None,
                 ) -> socket.socket:
    """Connect and send one HTTP/1.1 request; the caller reads (or does not)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_response(sock: socket.socket, timeout_s: float = 10.0) -> RawResponse:
    """Read one response until its end or until the server closes; a server
    silent for ``timeout_s`` raises ``TimeoutError`` (never read as a cut body)."""
    sock.settimeout(timeout_s)
    response = read_sse_response(sock, timeout_s=None, keep_raw=True)
    if response.error == "timeout":
        raise TimeoutError(f"no answer in {timeout_s} s")
    headers = {name.encode("latin-1"): value.encode("latin-1") for name, value in response.headers.items()}
    return RawResponse(response.status, headers, response.body, response.clean_end, response.raw)


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets an RST, as when a client crashes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def sse_data(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments skipped)."""
    out = []
    for block in body.decode().split("\n\n"):
        lines = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if lines:
            out.append("\n".join(lines))
    return out


def joined_text(body: bytes) -> str:
    """The concatenated ``delta.content`` of every chat chunk in an SSE body."""
    text = []
    for data in sse_data(body):
        if data.startswith("{"):
            obj = json.loads(data)
            for choice in obj.get("choices", ()):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)
