"""The servers of the cancel-by-id rows (``test_cancel_and_settings_clients.py``).

One event loop in a background thread runs, on real sockets on 127.0.0.1:

* ``engine``: :class:`CancelEngine`, an ASGI app under uvicorn that streams
  long answers in the three dialects, one case per path (``/<case>/v1/messages``,
  ``/<case>/v1/responses``, ``/<case>/v1/chat/completions``), and notes for each
  case what a real engine would feel: the request's headers, how many deltas it
  wrote, and when it was stopped (its client's ``http.disconnect`` under
  uvicorn: the sidecar closed the connection; or its task cancelled: the
  middleware stopped the app), or that it finished;
* per driver, tokenwire as an operator who wants cancel by id
  and per-request settings configures it: resume on with its default grace of
  0 (a client that leaves stops its answer, unless it asked to keep it going),
  clients allowed ``Tokenwire-Heartbeat-S`` down to 0.1 s and
  ``Tokenwire-Keep-Generating`` up to 60 s; the sidecar built from the flags
  a user types (``tokenwire sidecar --upstream URL --resume --client-settings
  ...``, and ``--cors-allow-origins`` the page's origin), the middleware as
  ``TokenWireMiddleware(app, WireConfig(...))`` under uvicorn. The caller is
  the ``Authorization`` header (the default ``resume_owner_header``), which
  every SDK here sends its key in: the Anthropic SDKs too (anthropic-python
  2.x and the TypeScript SDK 1.x send ``Authorization: Bearer``, no longer
  ``x-api-key``; checked from what the engine received).

Every stream's accounting record is kept (both drivers), with the sidecar's
log fields (``client_settings``, ``http_version``) by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from behaviour.drivers import serve
from tokenwire.middleware import StreamRecord, TokenWireMiddleware, WireConfig
from tokenwire.sidecar import Sidecar, StreamLog

from tokenwire.tools.cli import load_sidecar_config

from .servers import loop_in_thread

T = TypeVar("T")
Scope = MutableMapping[str, Any]
DRIVERS = ("sidecar", "middleware")
HEARTBEAT_LOW_S = 0.1
SETTINGS = (f"heartbeat_s={HEARTBEAT_LOW_S:g}..60", "keep_generating_s=0..60")
"""The operator's bounds: what a request may ask for by a ``Tokenwire-`` header."""
DELTAS = 4000
GAP_S = 0.005
"""A long answer (20 s at most): only a cancel, or the client leaving, ends it early."""
PREFILL_S = 0.35
"""Silence after the answer's first event(s): heartbeats at 0.1 s fill it, the 15 s default would not."""
ANTHROPIC_MODEL = "claude-compat-1"
RESPONSES_MODEL = "gpt-compat-1"


@dataclass
class Case:
    """What the engine saw of one case's stream."""

    headers: dict[str, str] = field(default_factory=dict)
    method: str = ""
    sent: int = 0
    """Text deltas written so far."""
    stopped_at: float | None = None
    """``time.monotonic()`` when the engine was stopped (disconnect or cancel)."""
    finished_at: float | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)

    def note(self, **changes: Any) -> None:
        with self.changed:
            for name, value in changes.items():
                setattr(self, name, value)
            self.changed.notify_all()

    def wait(self, predicate: Callable[[Case], bool], timeout_s: float = 10.0) -> bool:
        """Wait (on the engine's own notifications) until ``predicate(self)``."""
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout_s)


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _anthropic(case: str) -> tuple[list[bytes], Callable[[int], bytes], list[bytes]]:
    message = {"id": f"msg_{case}", "type": "message", "role": "assistant", "model": ANTHROPIC_MODEL,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 5, "output_tokens": 1}}
    head = [_sse("message_start", {"type": "message_start", "message": message}),
            _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})]
    tail = [_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": DELTAS},
                                   "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
            _sse("message_stop", {"type": "message_stop"})]
    return head, lambda i: _sse("content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": f"w{i} "}}), tail


def _responses(case: str) -> tuple[list[bytes], Callable[[int], bytes], list[bytes]]:
    response = {"id": f"resp_{case}", "object": "response", "created_at": 0, "model": RESPONSES_MODEL,
                "status": "in_progress", "output": []}

    def frame(kind: str, seq: int, **fields: Any) -> bytes:
        return _sse(kind, {"type": kind, **fields, "sequence_number": seq})

    return ([frame("response.created", 0, response=response)],
            lambda i: frame("response.output_text.delta", i + 1, item_id="msg_1", output_index=0,
                            content_index=0, delta=f"w{i} ", logprobs=[]),
            [frame("response.completed", DELTAS + 1, response={**response, "status": "completed"})])


def _chat(case: str) -> tuple[list[bytes], Callable[[int], bytes], list[bytes]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(None, {"id": f"chatcmpl-{case}", "object": "chat.completion.chunk", "created": 0,
                           "model": "compat-model",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    return ([chunk({"role": "assistant", "content": ""})], lambda i: chunk({"content": f"w{i} "}),
            [chunk({}, "stop"), b"data: [DONE]\n\n"])


_DIALECTS = {"messages": _anthropic, "responses": _responses, "chat/completions": _chat}


class CancelEngine:
    """The engine of the cancel rows (see the module docstring); ``pages`` are
    HTML pages it serves at ``/page/<name>`` (the middleware's browser row
    reads its page from the server it calls, as the grid's ``page.html``)."""

    def __init__(self) -> None:
        self.cases: dict[str, Case] = {}
        self.pages: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def case(self, name: str) -> Case:
        with self._lock:
            return self.cases.setdefault(name, Case())

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path.startswith("/page/"):
            await self._answer(send, 200, self.pages.get(path[6:], b""), b"text/html; charset=utf-8")
            return
        name, _, route = path.lstrip("/").partition("/v1/")
        while (await receive()).get("more_body"):
            pass  # the request body: the answer does not depend on it
        if route.startswith("responses/") and route.endswith("/cancel"):
            # The engine's own cancel knows no response: tokenwire answers its callers' own.
            await self._answer(send, 404, b'{"error":{"message":"No response found","type":'
                                          b'"invalid_request_error","param":null,"code":null}}')
            return
        make = _DIALECTS.get(route)
        if make is None:
            await self._answer(send, 404, b'{"error":{"message":"no such route"}}')
            return
        case = self.case(name)
        case.note(method=scope["method"], headers={k.decode("latin-1"): v.decode("latin-1")
                                                   for k, v in scope["headers"]})
        await self._stream(case, make(name), receive, send)

    async def _stream(self, case: Case, script: tuple[list[bytes], Callable[[int], bytes], list[bytes]],
                      receive: Any, send: Any) -> None:
        head, delta, tail = script
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            # Under uvicorn the app hears its client leave as http.disconnect: a
            # real engine stops generating then (vLLM aborts the request).
            while (await receive())["type"] != "http.disconnect":
                pass
            if case.finished_at is None:
                case.note(stopped_at=time.monotonic())
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            for frame in head:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await asyncio.sleep(PREFILL_S)
            for i in range(DELTAS):
                await send({"type": "http.response.body", "body": delta(i), "more_body": True})
                case.note(sent=i + 1)
                await asyncio.sleep(GAP_S)
            for frame in tail:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            case.note(finished_at=time.monotonic())
        except asyncio.CancelledError:
            # The middleware stops the app it wraps by cancelling it (a cancel by id, a client gone).
            if case.stopped_at is None:
                case.note(stopped_at=time.monotonic())
            raise
        finally:
            watcher.cancel()

    @staticmethod
    async def _answer(send: Any, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


class _Records(StreamLog):
    """The sidecar's records in memory, with its log fields by request id."""

    def __init__(self, servers: CancelServers) -> None:
        super().__init__(None)
        self.servers = servers

    def write(self, record: StreamRecord, **extra: object) -> None:
        self.servers.extras[record.request_id] = extra
        self.servers.records.append(record)


@dataclass
class CancelServers:
    loop: asyncio.AbstractEventLoop
    engine: CancelEngine
    page_origin: str
    """The origin the sidecar lets call it cross-origin (the browser row's page)."""
    urls: dict[str, str] = field(default_factory=dict)
    """Driver (or ``engine``, the engine's own) → base URL."""
    records: list[StreamRecord] = field(default_factory=list)
    extras: dict[str, dict[str, object]] = field(default_factory=dict)

    def url(self, driver: str) -> str:
        return self.urls[driver]

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def record_of(self, stream_id: str, timeout_s: float = 10.0) -> StreamRecord:
        """The accounting record of the stream ``stream_id`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in list(self.records):
                if record.stream_id == stream_id:
                    return record
            time.sleep(0.01)
        raise AssertionError(f"no record for stream {stream_id}")


async def _start(servers: CancelServers, stack: contextlib.AsyncExitStack) -> None:
    engine_port = await stack.enter_async_context(serve(servers.engine))
    direct = f"http://127.0.0.1:{engine_port}"
    servers.urls["engine"] = direct
    wrapped = TokenWireMiddleware(servers.engine, WireConfig(resume=True, client_settings=SETTINGS),
                                  on_finished=servers.records.append)
    port = await stack.enter_async_context(
        serve(wrapped, send_buffer_bytes=wrapped.config.socket_send_buffer_bytes))
    servers.urls["middleware"] = f"http://127.0.0.1:{port}"
    flags = ["--upstream", direct, "--listen", "127.0.0.1:0", "--admin-listen", "", "--drain-s", "0",
             "--resume", "--cors-allow-origins", servers.page_origin]
    for setting in SETTINGS:
        flags += ["--client-settings", setting]
    sidecar = Sidecar(load_sidecar_config(flags, {}), log=_Records(servers))
    await sidecar.start()
    stack.push_async_callback(sidecar.shutdown)
    servers.urls["sidecar"] = f"http://127.0.0.1:{sidecar.address[1]}"


@contextlib.contextmanager
def running_cancel_servers(page_origin: str) -> Iterator[CancelServers]:
    """The engine and tokenwire in front of it, until the block ends."""
    with loop_in_thread() as loop:
        servers = CancelServers(loop, CancelEngine(), page_origin)
        stack = contextlib.AsyncExitStack()
        try:
            servers.run(_start(servers, stack))
            yield servers
        finally:
            servers.run(stack.aclose())
