"""The demo's client: raw HTTP/1.1 over blocking sockets, and what it made of an answer.

Plain blocking sockets on purpose: an asyncio stream reader drains the kernel
buffer as fast as it can and would hide the very slowness the slow-reader
section is about. The response itself is read by the tools' one reader
(:mod:`.sse_client`); :class:`Answer` is what the demo makes of its events.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h11

from tokenwire.middleware.core.chunks import read_chunk
from tokenwire.middleware.core.sse import SSEEvent

from .sse_client import BlockingReader, ResponseParser, SSEResponse, read_response, request_bytes

PROMPT = "Tell me about the sea."
_READ_TIMEOUT_S = 120.0
_HOST = "tokenwire-demo"


class DemoError(RuntimeError):
    """A section could not run; the message says why."""


Connect = Callable[[], socket.socket]


def tcp_connector(host: str, port: int, *, receive_buffer_bytes: int | None = None) -> Connect:
    """A function opening a TCP connection, with a capped receive buffer if asked."""
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer_bytes is not None:
            # Before connect(): the window scale is agreed in the handshake.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.settimeout(_READ_TIMEOUT_S)
        sock.connect((host, port))
        return sock
    return connect


def unix_connector(path: str, *, receive_buffer_bytes: int | None = None) -> Connect:
    """A function opening a connection to a Unix socket."""
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if receive_buffer_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.settimeout(_READ_TIMEOUT_S)
        sock.connect(path)
        return sock
    return connect


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the kernel sends RST, as when a client dies."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def http_get(connect: Connect, target: str) -> tuple[int, bytes]:
    """A plain ``GET`` (used on the engine's Unix socket): status and body."""
    with connect() as sock:
        sock.sendall(request_bytes(h11.Connection(h11.CLIENT), "GET", target,
                                   headers=[("connection", "close")], host=_HOST))
        response = read_response(sock, timeout_s=None)
    return response.status, response.body


def chat_body(model: str, max_tokens: int, *, ignore_eos: bool = True) -> bytes:
    """A streamed, greedy chat completion request that reports its usage."""
    return json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
        "temperature": 0, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": PROMPT}],
    }).encode()


@dataclass
class Answer:
    """What a reader made of one streamed chat completion."""

    status: int = 0
    request_id: str = ""
    events: int = 0
    text: str = ""
    finish_reason: str | None = None
    saw_done: bool = False
    completion_tokens: int | None = None
    error: str | None = None
    body_complete: bool = False
    wall_s: float = 0.0
    stream_id: str = ""
    """``x-tokenwire-stream-id`` (resumable sidecars only)."""
    ids: list[str] = field(default_factory=list)
    """The ``id:`` of every data event, in order (resumable sidecars only)."""

    @property
    def complete(self) -> bool:
        """Finished by the upstream and terminated with ``[DONE]`` and a clean body end."""
        return self.error is None and self.finish_reason is not None and self.saw_done \
            and self.body_complete

    def take(self, data: str) -> None:
        """Account for one SSE ``data`` payload."""
        if data == "[DONE]":
            self.saw_done = True
            return
        self.events += 1
        facts = read_chunk(data)
        if facts.error is not None:
            self.error = facts.error
            return
        if facts.completion_tokens is not None:
            self.completion_tokens = facts.completion_tokens
        self.text += facts.text
        if facts.finish_reason is not None:
            self.finish_reason = facts.finish_reason


class StreamReader:
    """Reads one streamed response off a blocking socket, ``recv_bytes`` at a
    time (every ``interval_s``), into an :class:`Answer`; ``raw`` keeps every byte."""

    def __init__(self, sock: socket.socket, *, recv_bytes: int = 65536, interval_s: float = 0.0) -> None:
        self.sock = sock
        self.answer = Answer()
        self._conn = h11.Connection(h11.CLIENT)
        self._reader = BlockingReader(sock, ResponseParser(self._conn, keep_raw=True),
                                      recv_bytes=recv_bytes, interval_s=interval_s, timeout_s=None)

    @property
    def raw(self) -> bytes:
        """Every byte read so far, head and framing included."""
        return self._reader.parser.current().raw

    def send(self, target: str, body: bytes, *, method: str = "POST",
             headers: Sequence[tuple[str, str]] = ()) -> None:
        sent = [("accept", "text/event-stream"), ("connection", "close"), *headers]
        self.sock.sendall(request_bytes(self._conn, method, target, body, headers=sent, host=_HOST))

    def read(self, on_event: Callable[[Answer], bool] | None = None) -> Answer:
        """Read on; ``on_event`` is called after every data event, and False from
        it stops reading (the caller then owns the socket)."""
        answer = self.answer

        def take(response: SSEResponse, event: SSEEvent) -> bool:
            if event.data is None:
                return False
            if not answer.status:
                answer.status = response.status
                answer.request_id = response.headers.get("x-request-id", "")
                answer.stream_id = response.stream_id
            if event.id is not None:
                answer.ids.append(event.id)
            answer.take(event.data)
            return on_event is not None and not on_event(answer)

        response = self._reader.read(stop=take)
        answer.status = response.status
        answer.request_id = response.headers.get("x-request-id", "")
        answer.stream_id = response.stream_id
        answer.body_complete = response.clean_end
        if response.error:
            # A body cut without its chunked terminator is how the wire core
            # says "this stream did not finish": report it as such.
            answer.error = answer.error or response.error
        answer.wall_s = self._reader.wall_s
        return answer


def stream_chat(connect: Connect, body: bytes, **reader_options: Any) -> StreamReader:
    """Open a connection and send a streamed chat completion; the caller reads."""
    reader = StreamReader(connect(), **reader_options)
    reader.send("/v1/chat/completions", body)
    return reader


def read_all(connect: Connect, target: str, body: bytes = b"", *, method: str = "POST",
             headers: Sequence[tuple[str, str]] = ()) -> Answer:
    """One request on its own connection, its answer read to the end."""
    reader = StreamReader(connect())
    reader.send(target, body, method=method, headers=headers)
    with reader.sock:
        return reader.read()


def engine_metrics(engine_socket: str) -> dict[str, float]:
    """The engine's unlabelled Prometheus samples, read over its Unix socket."""
    status, body = http_get(unix_connector(engine_socket), "/metrics")
    if status != 200:
        raise DemoError(f"engine /metrics answered HTTP {status}")
    samples: dict[str, float] = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def engine_model_name(engine_socket: str) -> str:
    status, body = http_get(unix_connector(engine_socket), "/v1/models")
    if status != 200:
        raise DemoError(f"engine /v1/models answered HTTP {status}")
    return str(json.loads(body)["data"][0]["id"])
