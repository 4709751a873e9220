"""Fake OpenAI-compatible upstreams: real asyncio HTTP/1.1 servers on 127.0.0.1.

One server plays every behaviour; the first path segment picks it, so one
base URL per behaviour works with any client (``base_url=.../silent/v1``):

    /normal/...     OpenAI chat chunks, then [DONE] (JSON when not streaming)
    /silent/...     one chunk, ``x-fake-silence-s`` of nothing, the rest
    /die/...        a few chunks, then the socket closes mid-body
    /noheaders/...  reads the request, never answers
    /malformed/...  an SSE line longer than any sane limit
    /status503/...  503 for the first ``x-fake-fail-first`` requests with one id (with
                    ``Retry-After: x-fake-retry-after`` when given), then normal
    /echo/...       JSON: the request line, headers and body it received
    /models/...     a plain JSON body (``/v1/models``), Content-Length framed
    /abort/{id}     the explicit abort call: 200, recorded like every request
    /prefill/...    normal, with ``x-fake-prefill-s`` (default 0.5) between the role chunk and the text

A path ending in ``/completions`` (not ``/chat/completions``) streams legacy
text-completion chunks (``choices[].text``, no role chunk) instead.

Request headers tune it: ``x-fake-tokens`` (count), ``x-fake-delay-s``
(between tokens), ``x-fake-silence-s``, ``x-fake-prefill-s`` (any mode: after
the role chunk). Every connection is recorded with the moment the *peer* (the
sidecar) closed it, which is how tests see an abort reach the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


def chunk(text: str | None = None, *, role: str | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    """One OpenAI ``chat.completion.chunk`` SSE event."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if text is not None:
        delta["content"] = text
    payload: dict[str, Any] = {
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def text_chunk(text: str = "", *, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    """One legacy ``text_completion`` SSE event (``/v1/completions``)."""
    payload: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
                               "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def token(i: int) -> str:
    return f"t{i} "


def expected_text(tokens: int) -> str:
    return "".join(token(i) for i in range(tokens))


def client_request_id(headers: dict[str, str]) -> str:
    """The id the client gave a request the fake sees (or the sidecar's, if it gave none)."""
    return headers.get("x-client-request-id") or headers.get("x-request-id", "")


@dataclass
class Connection:
    """One upstream connection as the fake saw it."""

    opened_at: float
    request_ids: list[str] = field(default_factory=list)
    peer_closed_at: float | None = None
    """``time.monotonic()`` when the sidecar closed or reset it (None: still open / we closed)."""
    closed: threading.Event = field(default_factory=threading.Event)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: Connection
    finished_at: float | None = None
    """``time.monotonic()`` when the fake wrote the last byte of its answer."""
    received_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the fake had read the request's head."""


class _Listener:
    """A TCP listener on a free 127.0.0.1 port; subclasses answer in ``_serve``."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def start_unix(self, path: str) -> None:
        """Listen on the Unix socket ``path`` instead (as an engine behind ``tokenwire up`` does)."""
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class FakeUpstream(_Listener):
    """The fake engine; ``await start()`` on a running loop, then use ``url``."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []
        self.connections: list[Connection] = []
        self._failures: dict[str, int] = {}

    def requests_with(self, request_id: str) -> list[Request]:
        """The requests of the client request ``request_id``: the sidecar sends a
        client's own id as ``x-client-request-id`` (its own goes in ``x-request-id``)."""
        return [r for r in self.requests if client_request_id(r.headers) == request_id]

    def connection_of(self, request_id: str) -> Connection:
        matches = self.requests_with(request_id)
        assert matches, f"the upstream never saw {request_id}"
        return matches[-1].connection

    # ------------------------------------------------------------ serving

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        record = Connection(opened_at=time.monotonic())
        self.connections.append(record)
        carried = b""
        try:
            while True:
                try:
                    head = carried + await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                    record.peer_closed_at = time.monotonic()
                    return
                request = self._parse(head, record)
                request.body = await reader.readexactly(int(request.headers.get("content-length", "0")))
                self.requests.append(request)
                record.request_ids.append(client_request_id(request.headers))
                # Watch the socket while answering: an EOF or reset is the sidecar aborting.
                watcher = asyncio.ensure_future(reader.read(1))
                responder = asyncio.ensure_future(self._respond(request, writer))
                done, _ = await asyncio.wait({watcher, responder}, return_when=asyncio.FIRST_COMPLETED)
                carried = b""
                if watcher in done:
                    carried = b"" if watcher.exception() is not None else watcher.result()
                    if not carried:
                        record.peer_closed_at = time.monotonic()
                        responder.cancel()
                        return
                    # The client's next request on this connection began before the
                    # answer's last write returned (keep-alive): no abort; keep its byte.
                    await asyncio.wait({responder})
                else:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                keep_alive = responder.exception() is None and responder.result()
                if not keep_alive:
                    return
        finally:
            record.closed.set()
            writer.close()

    @staticmethod
    def _parse(head: bytes, record: Connection) -> Request:
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Request(method, path, headers, b"", record)

    async def _respond(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; True if the connection may be reused."""
        mode = request.path.split("/")[1]
        headers = request.headers
        tokens = int(headers.get("x-fake-tokens", "5"))
        delay_s = float(headers.get("x-fake-delay-s", "0"))
        streaming = b'"stream": true' in request.body or b'"stream":true' in request.body
        if mode == "status503":
            request_id = client_request_id(headers)
            failures = self._failures.get(request_id, 0)
            if failures < int(headers.get("x-fake-fail-first", "1")):
                self._failures[request_id] = failures + 1
                retry_after = headers.get("x-fake-retry-after")
                await self._plain(writer, 503, b'{"error":{"message":"overloaded"}}',
                                  extra=f"retry-after: {retry_after}\r\n" if retry_after else "")
                request.finished_at = time.monotonic()
                return True
            mode = "normal"
        if mode == "noheaders":
            await asyncio.sleep(3600)
            return False
        if mode == "abort":
            await self._plain(writer, 200, b"{}")
            return True
        if mode in ("echo", "models") or (mode == "normal" and not streaming):
            if mode == "echo":
                body = json.dumps({"method": request.method, "path": request.path, "headers": headers,
                                   "body": request.body.decode()}).encode()
            elif mode == "models":
                body = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
            else:
                message = {"role": "assistant", "content": expected_text(tokens)}
                body = json.dumps({
                    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}).encode()
            await self._plain(writer, 200, body)
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nx-engine: fake\r\n\r\n")
        if request.path.endswith("/completions") and not request.path.endswith("/chat/completions"):
            def piece(text: str | None = None, *, finish: str | None = None,
                      usage: dict[str, int] | None = None) -> bytes:
                return text_chunk(text or "", finish=finish, usage=usage)
        else:
            piece = chunk
            await self._send(writer, chunk(role="assistant"))
        prefill_s = headers.get("x-fake-prefill-s", "0.5" if mode == "prefill" else "0")
        if float(prefill_s):
            await asyncio.sleep(float(prefill_s))
        if mode == "malformed":
            await self._send(writer, b"data: " + b"x" * 200_000)
            await asyncio.sleep(3600)
            return False
        for i in range(tokens):
            if mode == "die" and i == 2:
                await writer.drain()
                transport = writer.transport
                transport.abort()
                return False
            if mode == "silent" and i == 1:
                await asyncio.sleep(float(headers.get("x-fake-silence-s", "1")))
            if delay_s:
                await asyncio.sleep(delay_s)
            await self._send(writer, piece(token(i)))
        await self._send(writer, piece(finish="stop"))
        await self._send(writer, piece(usage={"prompt_tokens": 1, "completion_tokens": tokens,
                                              "total_tokens": tokens + 1}))
        await self._send(writer, DONE)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        request.finished_at = time.monotonic()
        return True

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        await writer.drain()

    @staticmethod
    async def _plain(writer: asyncio.StreamWriter, status: int, body: bytes, extra: str = "") -> None:
        reason = {200: "OK", 503: "Service Unavailable"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{extra}"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()


Respond = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await FakeUpstream._plain(writer, 200, b"{}")


class ScriptedUpstream(_Listener):
    """A raw upstream that records every byte it receives and answers with ``respond``.

    Unlike :class:`FakeUpstream` it never parses more than it must (one head and
    its Content-Length body per request, to know where the answer goes), so a
    test sees exactly what the sidecar forwarded, byte for byte, and can answer
    with anything: a gzip body, a line of 100 MB, bytes that are not UTF-8.
    """

    def __init__(self, respond: Respond = _answer_ok) -> None:
        super().__init__()
        self.respond = respond
        self.received = bytearray()
        self.connections = 0
        self.sent_bytes = 0
        """What ``respond`` managed to write through :meth:`send` before the sidecar cut it off."""
        self.cut_off = threading.Event()
        """Set when the sidecar closed or reset the connection while ``respond`` was writing."""
        self.request_seen = threading.Event()

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write and drain ``data``, counting it; the sidecar going away sets ``cut_off``."""
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            self.cut_off.set()
            raise
        self.sent_bytes += len(data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError) as error:
                    self.received += getattr(error, "partial", b"")
                    return
                self.received += head
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.received += await reader.readexactly(length)
                self.request_seen.set()
                await self.respond(reader, writer)
        except ConnectionError:
            self.cut_off.set()
        finally:
            writer.close()
