"""TokenWireMiddleware over real servers and sockets: streaming, slow clients,
disconnects during a silent prefill, heartbeats, app failures."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse as FastAPIStreamingResponse
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import TokenWireMiddleware, WireConfig
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG, StreamControl

from .asgi_apps import (
    SERVERS,
    Hooks,
    chat_chunk,
    chat_events,
    joined_text,
    open_request,
    read_response,
    reset,
    running_server,
    sse_data,
)

FRAMEWORKS = ("starlette", "sse-starlette", "fastapi")
SSE_HEADERS = {
    b"content-type": b"text/event-stream; charset=utf-8",
    b"cache-control": b"no-cache, no-transform",
    b"x-accel-buffering": b"no",
}


def framework_app(framework: str, stream: Any) -> Any:
    """A GET /stream endpoint in ``framework`` whose body is ``stream(request)``
    (an async iterator of SSE text; for sse-starlette, of data payloads)."""
    if framework == "starlette":
        async def endpoint(request: Request) -> StreamingResponse:
            return StreamingResponse(stream(request), media_type="text/event-stream")
        return Starlette(routes=[Route("/stream", endpoint, methods=["GET", "POST"])])
    if framework == "sse-starlette":
        async def payloads(request: Request) -> AsyncIterator[dict[str, str]]:
            async for text in stream(request):
                for data in sse_data(text.encode()):
                    yield {"data": data}

        async def sse_endpoint(request: Request) -> EventSourceResponse:
            return EventSourceResponse(payloads(request))
        return Starlette(routes=[Route("/stream", sse_endpoint)])
    api = FastAPI()

    @api.get("/stream")
    async def fastapi_endpoint(request: Request) -> FastAPIStreamingResponse:
        return FastAPIStreamingResponse(stream(request), media_type="text/event-stream")
    return api


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("server", SERVERS)
def test_stream_when_client_reads_then_events_arrive_with_sse_headers_and_record(
        server: str, framework: str) -> None:
    hooks = Hooks()
    app = TokenWireMiddleware(framework_app(framework, lambda request: chat_events(20)),
                              on_finished=hooks.on_finished)
    with running_server(app, server) as port:
        response = read_response(open_request(port, "/stream"))
    assert response.status == 200 and response.complete
    for name, value in SSE_HEADERS.items():
        assert response.headers[name] == value
    assert b"content-length" not in response.headers
    data = sse_data(response.body)
    # The generator never yields to the loop, so deltas queued behind the
    # first write may have merged: compare the text, not the event count.
    assert data[-1] == "[DONE]" and '"finish_reason":"stop"' in data[-2]
    assert joined_text(response.body) == "".join(f"t{i} " for i in range(20))
    record = hooks.wait_record()
    assert record.end_reason == "complete" and record.events_in == 22 and record.status == 200


@pytest.mark.parametrize("server", SERVERS)
def test_slow_client_when_it_stops_reading_then_app_is_not_stalled_and_pending_stays_bounded(
        server: str) -> None:
    count = 5000
    hooks = Hooks()
    seen: dict[str, Any] = {"max_pending": 0}
    done = threading.Event()

    async def produce(request: Request) -> AsyncIterator[str]:
        control: StreamControl = request.scope["extensions"]["tokenwire"]
        for i in range(count):
            yield f"data: {chat_chunk(f'w{i} ')}\n\n"
            seen["max_pending"] = max(seen["max_pending"], control.pending_bytes)
            seen["backpressured"] = seen.get("backpressured") or control.backpressured
            await asyncio.sleep(0)
        seen["produced_at"] = time.monotonic()
        done.set()

    # How long this machine, as loaded as it is now, takes to serve the same
    # answer to a client that reads: the slow client's deadline is scaled to it.
    baseline = TokenWireMiddleware(framework_app("starlette", produce), DEFAULT_CONFIG)
    with running_server(baseline, server, send_buffer_bytes=16 * 1024) as port:
        started = time.monotonic()
        assert read_response(open_request(port, "/stream"), timeout_s=60).complete
        served_s = time.monotonic() - started
    done.clear()
    seen.update(max_pending=0, backpressured=False)

    # A stalled app would still be waiting on the client when the deadline cuts
    # it off, and never finish; a free one finishes well within it (measured:
    # in under the time the reading client took, as most of its events merge).
    deadline_s = max(1.0, 3 * served_s)
    # The app's /stream is OpenAI chunks without [DONE]: routed as Chat Completions,
    # with a clean end complete, so its text merges for the stalled reader.
    config = DEFAULT_CONFIG.replace(max_pending_bytes=256 * 1024, write_deadline_s=deadline_s,
                                    dialect_routes=("/stream=chat.completions",), terminal_marker=None)
    app = TokenWireMiddleware(framework_app("starlette", produce), config,
                              on_finished=hooks.on_finished, on_abort=hooks.on_abort)
    with running_server(app, server, send_buffer_bytes=16 * 1024) as port:
        sock = open_request(port, "/stream", rcvbuf=4096)
        try:
            assert done.wait(2 * deadline_s + 5), "the app was stalled by a client that does not read"
            record = hooks.wait_record(2 * deadline_s + 5)
            ended_at = time.monotonic()
        finally:
            sock.close()
    assert seen["produced_at"] < ended_at
    # ~650 kB of events against ~100 kB of socket buffers: the rest merged.
    assert seen["backpressured"]
    assert 0 < seen["max_pending"] <= config.max_pending_bytes
    assert record.pending_high_water_bytes <= config.max_pending_bytes
    assert record.coalesced_events > 0
    assert record.end_reason == "slow_client" and record.error_code == "send_timeout"


@pytest.mark.parametrize("server", SERVERS)
def test_slow_client_when_pending_exceeds_cap_then_app_is_cancelled_with_slow_client(server: str) -> None:
    hooks = Hooks()
    seen: dict[str, Any] = {}

    async def produce(request: Request) -> AsyncIterator[str]:
        try:
            for i in range(100_000):
                # Not JSON: a barrier, nothing can merge.
                yield f"data: event {i} {'x' * 100}\n\n"
                await asyncio.sleep(0)
            seen["finished"] = True
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    config = DEFAULT_CONFIG.replace(max_pending_bytes=64 * 1024)
    app = TokenWireMiddleware(framework_app("starlette", produce), config,
                              on_finished=hooks.on_finished, on_abort=hooks.on_abort)
    with running_server(app, server, send_buffer_bytes=16 * 1024) as port:
        sock = open_request(port, "/stream", rcvbuf=4096)
        try:
            record = hooks.wait_record(10)
        finally:
            sock.close()
    assert record.end_reason == "slow_client" and record.error_code == "backpressure_exceeded"
    assert [reason for _, reason, _ in hooks.aborts] == ["slow_client"]
    deadline = time.monotonic() + 2
    while "cancelled" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen.get("cancelled") and not seen.get("finished")


def prefill_app(style: str, seen: dict[str, Any], prefill_s: float = 5.0) -> Any:
    """An app that stays silent for ``prefill_s`` before its first event:
    ``in-stream`` (headers sent, generator sleeping) or ``before-response``
    (the endpoint awaits before returning its response)."""
    async def tokens() -> AsyncIterator[str]:
        yield f"data: {chat_chunk('hello')}\n\n"

    async def prefill() -> None:
        try:
            await asyncio.sleep(prefill_s)
        except asyncio.CancelledError:
            seen["cancelled_at"] = time.monotonic()
            raise

    if style == "in-stream":
        async def stream(request: Request) -> AsyncIterator[str]:
            await prefill()
            async for text in tokens():
                yield text
        return framework_app("starlette", stream)
    api = FastAPI()

    @api.get("/stream")
    async def endpoint() -> FastAPIStreamingResponse:
        await prefill()
        return FastAPIStreamingResponse(tokens(), media_type="text/event-stream")
    return api


@pytest.mark.parametrize("style", ["in-stream", "before-response"])
@pytest.mark.parametrize("server", SERVERS)
def test_disconnect_when_client_resets_during_silent_prefill_then_app_is_cancelled_at_once(
        server: str, style: str) -> None:
    hooks = Hooks()
    seen: dict[str, Any] = {}
    app = TokenWireMiddleware(prefill_app(style, seen), on_abort=hooks.on_abort,
                              on_finished=hooks.on_finished)
    with running_server(app, server) as port:
        sock = open_request(port, "/stream", headers=(("X-Request-Id", "req-42"),))
        time.sleep(0.3)
        reset_at = time.monotonic()
        reset(sock)
        record = hooks.wait_record(3)
        deadline = time.monotonic() + 3
        while "cancelled_at" not in seen and time.monotonic() < deadline:
            time.sleep(0.005)
    assert "cancelled_at" in seen, "the app was not cancelled"
    assert seen["cancelled_at"] - reset_at < 1.0
    assert len(hooks.aborts) == 1
    request_id, reason, abort_at = hooks.aborts[0]
    assert (request_id, reason) == ("req-42", "client_gone")
    assert abort_at - reset_at < 1.0
    assert record.end_reason == "client_gone" and record.request_id == "req-42"


@pytest.mark.parametrize("server", SERVERS)
def test_heartbeats_when_app_is_silent_then_keepalive_comments_flow(server: str) -> None:
    async def stream(request: Request) -> AsyncIterator[str]:
        await asyncio.sleep(0.7)  # silent before the first event: headers commit at 0.1 s
        yield f"data: {chat_chunk('a')}\n\n"
        await asyncio.sleep(0.7)
        yield f"data: {chat_chunk('b')}\n\n"

    config = DEFAULT_CONFIG.replace(heartbeat_s=0.2, commit_deadline_s=0.1)
    app = TokenWireMiddleware(framework_app("starlette", stream), config)
    with running_server(app, server) as port:
        response = read_response(open_request(port, "/stream"))
    assert response.complete
    before, _, after = response.body.partition(b"data: ")
    assert before.count(b": keepalive\n") >= 2  # at ~0.3, 0.5 (and 0.7) s
    assert after.count(b": keepalive\n") >= 2
    assert set(before.split(b"\n")) <= {b": keepalive", b""}
    assert b"\n\n" not in before  # a heartbeat is never an (empty) event
    assert joined_text(response.body) == "ab"


@pytest.mark.parametrize("server", SERVERS)
def test_app_raises_when_stream_started_then_in_band_error_and_truncated_body(server: str) -> None:
    hooks = Hooks()

    async def stream(request: Request) -> AsyncIterator[str]:
        for i in range(10):
            yield f"data: {chat_chunk(str(i))}\n\n"
        raise RuntimeError("secret details stay in the server log")

    app = TokenWireMiddleware(framework_app("starlette", stream), on_finished=hooks.on_finished)
    with running_server(app, server) as port:
        response = read_response(open_request(port, "/stream"))
    assert response.status == 200 and not response.complete, "the body must be cut, not ended"
    data = sse_data(response.body)
    assert joined_text(response.body) == "0123456789"
    error = json.loads(data[-1])["error"]
    assert error["code"] == "upstream_failed" and "RuntimeError" not in error["message"]
    assert "secret" not in response.body.decode()
    assert hooks.wait_record().end_reason == "upstream_error"


@pytest.mark.parametrize("server", SERVERS)
def test_app_raises_before_first_event_then_real_error_status(server: str) -> None:
    async def stream(request: Request) -> AsyncIterator[str]:
        raise RuntimeError("boom")
        yield ""  # pragma: no cover

    app = TokenWireMiddleware(framework_app("starlette", stream))
    with running_server(app, server) as port:
        response = read_response(open_request(port, "/stream"))
    assert response.status == 502 and response.headers[b"content-type"] == b"application/json"
    assert json.loads(response.body)["error"]["code"] == "upstream_failed"


@pytest.mark.parametrize("server", SERVERS)
def test_extension_when_app_calls_abort_then_stream_ends_with_cancelled_error(server: str) -> None:
    hooks = Hooks()
    seen: dict[str, Any] = {}

    async def stream(request: Request) -> AsyncIterator[str]:
        control: StreamControl = request.scope["extensions"]["tokenwire"]
        seen["request_id"] = control.request_id
        seen["backpressured"] = control.backpressured
        try:
            for i in range(3):
                yield f"data: {chat_chunk(str(i))}\n\n"
                await asyncio.sleep(0.05)
            control.abort()
            control.abort()  # idempotent
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    app = TokenWireMiddleware(framework_app("starlette", stream), on_abort=hooks.on_abort,
                              on_finished=hooks.on_finished)
    with running_server(app, server) as port:
        started = time.monotonic()
        response = read_response(open_request(port, "/stream", headers=(("x-request-id", "abc"),)))
    assert time.monotonic() - started < 2
    assert seen["request_id"] == "abc" and seen["backpressured"] is False
    assert not response.complete
    assert json.loads(sse_data(response.body)[-1])["error"]["code"] == "cancelled"
    assert hooks.wait_record().end_reason == "cancelled"
    assert [(rid, reason) for rid, reason, _ in hooks.aborts] == [("abc", "cancelled")]
    deadline = time.monotonic() + 2
    while "cancelled" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen.get("cancelled")


@pytest.mark.parametrize("server", SERVERS)
def test_request_body_when_larger_than_read_ahead_then_app_sees_it_all(server: str) -> None:
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB, over the 1 MiB read-ahead

    async def stream(request: Request) -> AsyncIterator[str]:
        received = await request.body()
        yield f"data: {len(received)} {received == body}\n\n"

    app = TokenWireMiddleware(framework_app("starlette", stream))
    with running_server(app, server) as port:
        response = read_response(open_request(port, "/stream", method="POST", body=body))
    assert sse_data(response.body) == [f"{len(body)} True"]


def test_config_when_retries_requested_then_refused() -> None:
    with pytest.raises(ValueError, match="retry_attempts"):
        TokenWireMiddleware(framework_app("starlette", chat_events), WireConfig(retry_attempts=1))
