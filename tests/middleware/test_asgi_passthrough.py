"""What the middleware must not touch: non-SSE responses, websockets, lifespan,
and an app's work after its response is complete."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import threading
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from tokenwire.middleware import TokenWireMiddleware

from .asgi_apps import SERVERS, open_request, read_response, running_server


def plain_app(background_done: threading.Event | None = None) -> Starlette:
    async def json_endpoint(request: Request) -> JSONResponse:
        payload = await request.json()
        return JSONResponse({"echo": payload, "ok": True}, headers={"x-custom": "1"})

    async def text_stream(request: Request) -> StreamingResponse:
        async def chunks() -> Any:
            for i in range(5):
                yield f"line {i}\n"
        return StreamingResponse(chunks(), media_type="text/plain")

    async def crash(request: Request) -> Response:
        raise RuntimeError("before the response")

    async def later() -> None:
        await asyncio.sleep(0.3)
        if background_done is not None:
            background_done.set()

    async def with_background(request: Request) -> Response:
        return Response("done", background=BackgroundTask(later))

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        text = await websocket.receive_text()
        await websocket.send_text(text.upper())
        await websocket.close()

    return Starlette(routes=[
        Route("/json", json_endpoint, methods=["POST"]),
        Route("/text", text_stream),
        Route("/crash", crash),
        Route("/background", with_background),
        WebSocketRoute("/ws", echo),
    ])


def exchange(port: int, path: str, method: str = "GET", body: bytes = b"") -> bytes:
    sock = open_request(port, path, method=method, body=body,
                        headers=(("Content-Type", "application/json"),) if body else ())
    with sock:
        return read_response(sock).raw


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize(("path", "method", "body"), [
    ("/json", "POST", b'{"prompt": "hi", "stream": false}'),
    ("/text", "GET", b""),
    ("/crash", "GET", b""),
    ("/missing", "GET", b""),
])
def test_passthrough_when_response_is_not_sse_then_bytes_are_identical(
        server: str, path: str, method: str, body: bytes) -> None:
    with running_server(plain_app(), server) as port:
        bare = exchange(port, path, method, body)
    with running_server(TokenWireMiddleware(plain_app()), server) as port:
        wrapped = exchange(port, path, method, body)
    assert bare and wrapped == bare


def websocket_exchange(port: int) -> bytes:
    """Handshake, send "hello", return every byte up to the server's close frame."""
    key = base64.b64encode(b"tokenwire-key-16").decode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with sock:
        sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                      f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        received = bytearray()
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        mask = os.urandom(4)
        payload = b"hello"
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)
        while not received.endswith(b"\x88\x02\x03\xe8"):  # the server's close frame, code 1000
            data = sock.recv(65536)
            assert data, "connection closed before the close frame"
            received += data
        return bytes(received)


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn"])
def test_passthrough_when_websocket_then_bytes_are_identical(server: str) -> None:
    with running_server(plain_app(), server) as port:
        bare = websocket_exchange(port)
    with running_server(TokenWireMiddleware(plain_app()), server) as port:
        wrapped = websocket_exchange(port)
    assert b"101" in bare.split(b"\r\n", 1)[0] and b"HELLO" in bare
    assert wrapped == bare


@pytest.mark.parametrize("scope_type", ["lifespan", "websocket"])
def test_passthrough_when_not_http_then_app_gets_the_same_objects(scope_type: str) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.extend((scope, receive, send))

    async def receive() -> dict[str, Any]:
        return {"type": f"{scope_type}.startup"}

    async def send(message: Any) -> None:
        pass

    scope = {"type": scope_type, "asgi": {"version": "3.0"}}
    asyncio.run(TokenWireMiddleware(app)(scope, receive, send))
    assert seen[0] is scope and seen[1] is receive and seen[2] is send


def test_passthrough_when_lifespan_under_uvicorn_then_startup_and_shutdown_reach_app() -> None:
    events: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            events.append(message["type"])
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

    with running_server(TokenWireMiddleware(app), "uvicorn-h11", lifespan="on"):
        pass
    assert events == ["lifespan.startup", "lifespan.shutdown"]


@pytest.mark.parametrize("server", SERVERS)
def test_passthrough_when_client_leaves_after_response_then_background_task_is_not_cancelled(
        server: str) -> None:
    background_done = threading.Event()
    aborts: list[str] = []
    app = TokenWireMiddleware(plain_app(background_done), on_abort=lambda rid, reason: aborts.append(reason))
    with running_server(app, server) as port:
        sock = open_request(port, "/background")
        assert read_response(sock).body == b"done"
        sock.close()
        assert background_done.wait(3)
    assert aborts == []
