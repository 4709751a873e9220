"""The middleware's send-buffer cap under servers that bind their own socket
(the README's ``uvicorn module:app``, no ``listening_socket``): a client that
stops reading is seen after kilobytes, not megabytes; and the one warning
where the cap cannot be made."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.exchange import StreamControl
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG, listening_socket
from tokenwire.middleware.asgi.send_buffer import SendBufferCap, cap_port

from .asgi_apps import ASGIApp, Hooks, chat_chunk, open_request, read_response, running_server

START_S = 30.0
HELD_BELOW_BYTES = 400 * 1024
"""What the app may write before a stalled reader is seen: the capped kernel
buffers and the server's transport (64 KiB) took ~80 kB here; uncapped, the
kernel's took 2.8 MB (1.2 MB in the report that found it)."""
GIVE_UP_BYTES = 8 << 20
LOGGER = "tokenwire.middleware"


@contextmanager
def served_by_host_port(app: ASGIApp, server: str) -> Iterator[int]:
    """Serve ``app`` with ``server`` on 127.0.0.1 and a port of its choice, on a
    listener without a capped send buffer; uvicorn binds it itself, as
    ``uvicorn module:app`` does. Yields the port."""
    bound: list[int] = []
    ready = threading.Event()
    if server.startswith("uvicorn"):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=server.split("-")[1],
                                lifespan="off", loop="asyncio", log_level="critical", access_log=False)
        uv = uvicorn.Server(config)

        async def run_uvicorn() -> None:
            serving = asyncio.ensure_future(uv.serve())
            while not uv.started and not serving.done():
                await asyncio.sleep(0)  # uvicorn has no started event: yield until its startup ran
            if uv.started:
                bound.append(uv.servers[0].sockets[0].getsockname()[1])
            ready.set()
            await serving

        thread = threading.Thread(target=asyncio.run, args=(run_uvicorn(),), daemon=True)
        thread.start()
        try:
            assert ready.wait(START_S) and bound, "uvicorn did not start"
            yield bound[0]
        finally:
            uv.should_exit = True
            thread.join(10)
        return
    # Hypercorn's own bind gives no handle on the port it chose: an uncapped
    # listener of ours, the same socket to the kernel.
    with running_server(app, server) as port:
        yield port


def stalling_app(seen: dict[str, Any], backpressured: threading.Event) -> Starlette:
    """GET /stream: events until the stream says ``backpressured`` (the bytes
    written by then go in ``seen``), then silence until the client leaves."""

    async def produce(request: Request) -> AsyncIterator[str]:
        control: StreamControl = request.scope["extensions"]["tokenwire"]
        written = 0
        i = 0
        while written < GIVE_UP_BYTES:
            event = f"data: {chat_chunk(f'w{i} ' * 20)}\n\n"
            yield event
            written += len(event)
            i += 1
            if control.backpressured:
                break
            await asyncio.sleep(0)
        seen["written"] = written
        seen["backpressured"] = control.backpressured
        backpressured.set()
        await asyncio.Event().wait()  # until the middleware cancels it (the client left)

    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(produce(request), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", endpoint)])


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records
            if record.name == LOGGER and str(record.getMessage()).startswith(text)]


@pytest.mark.parametrize("server", ["uvicorn-h11", "uvicorn-httptools", "hypercorn"])
def test_stalled_reader_when_the_server_binds_its_own_socket_then_backpressure_is_seen_within_kilobytes(
        server: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    seen: dict[str, Any] = {}
    backpressured = threading.Event()
    hooks = Hooks()
    config = DEFAULT_CONFIG.replace(dialect_routes=("/stream=chat.completions",), terminal_marker=None)
    app = TokenWireMiddleware(stalling_app(seen, backpressured), config, on_finished=hooks.on_finished)
    with served_by_host_port(app, server) as port:
        sock = open_request(port, "/stream", rcvbuf=4096)  # and never read
        try:
            assert backpressured.wait(60), "the app never finished writing"
        finally:
            sock.close()
        record = hooks.wait_record(30)
        # A second request on the same port: the port was looked at once.
        again = open_request(port, "/missing")
        try:
            assert read_response(again).status == 404
        finally:
            again.close()
    assert seen["backpressured"], f"{seen['written']} bytes written without backpressure"
    assert seen["written"] < HELD_BELOW_BYTES, seen
    assert record.end_reason == "client_gone"
    capped = messages(caplog, "send buffer capped")
    assert len(capped) == 1, [r.getMessage() for r in caplog.records]
    fields = capped[0].__dict__["fields"]
    assert fields["port"] == port and fields["listeners"] >= 1 and fields["connections"] >= 1
    assert fields["socket_send_buffer_bytes"] == config.socket_send_buffer_bytes
    assert not messages(caplog, "backpressure cannot be seen")


def test_listening_socket_when_served_from_it_then_capped_again_without_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine's way (``listening_socket``): the cap is already there; the
    middleware sets it again and says nothing but that."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with sock:
        cap = SendBufferCap(DEFAULT_CONFIG.socket_send_buffer_bytes)
        cap.see({"type": "http", "server": ("127.0.0.1", port)})
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        capped = cap_port(port, DEFAULT_CONFIG.socket_send_buffer_bytes)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
    assert capped is not None and capped.listeners == 1 and capped.connections == 0
    assert len(messages(caplog, "send buffer capped")) == 1
    assert not messages(caplog, "backpressure cannot be seen")


async def _call(app: TokenWireMiddleware, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays: the middleware stops listening at the end
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent


async def plain_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def http_scope(**extra: Any) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": "/", "raw_path": b"/", "query_string": b"", "headers": [],
            **extra}


@pytest.mark.parametrize("server_key", ["missing", "no listener"])
def test_port_when_the_cap_cannot_be_made_then_one_warning_with_the_fix(
        server_key: str, caplog: pytest.LogCaptureFixture) -> None:
    """A server that does not say its address (``scope["server"]`` is optional
    in ASGI), or a port with no listener in this process: one warning naming
    ``listening_socket``, however many requests come."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with socket.socket() as unused:  # a port nobody in this process listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        extra: dict[str, Any] = {} if server_key == "missing" else {"server": ("127.0.0.1", port)}
        app = TokenWireMiddleware(plain_app)

        async def three_requests() -> None:
            for _ in range(3):
                sent = await _call(app, http_scope(client=("127.0.0.1", 50000), **extra))
                assert sent[-1]["body"] == b"ok"

        asyncio.run(three_requests())
    warnings = messages(caplog, "backpressure cannot be seen")
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert warnings[0].levelno == logging.WARNING
    text = warnings[0].getMessage()
    assert "listening_socket(" in text and "sockets=[listening_socket(" in text
    if server_key == "no listener":
        assert f"on port {port}: no listening socket" in text
    assert not messages(caplog, "send buffer capped")


def test_descriptors_when_the_system_lists_none_then_the_warning_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cap = SendBufferCap(DEFAULT_CONFIG.socket_send_buffer_bytes, folders=("/nonexistent/fd",))
    for _ in range(2):
        cap.see(http_scope(server=("127.0.0.1", 8000)))
    warnings = messages(caplog, "backpressure cannot be seen on port 8000: this system does not list")
    assert len(warnings) == 1


def test_unix_socket_when_served_then_nothing_capped_or_said(caplog: pytest.LogCaptureFixture) -> None:
    """A Unix socket's peer is a local proxy with buffers of its own."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    cap = SendBufferCap(DEFAULT_CONFIG.socket_send_buffer_bytes)
    cap.see(http_scope(server=("/run/app.sock", None)))
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_cap_server_sockets_when_off_then_the_servers_sockets_are_left_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    """The opt-out: the app's other routes (a download) keep the kernel's autotuned buffer."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = TokenWireMiddleware(stalling_app({}, threading.Event()), cap_server_sockets=False)
    with served_by_host_port(app, "uvicorn-h11") as port:
        before = _listener_send_buffer(port)
        sock = open_request(port, "/missing")
        try:
            assert read_response(sock).status == 404
        finally:
            sock.close()
        assert _listener_send_buffer(port) == before
    assert not messages(caplog, "send buffer capped") and not messages(caplog, "backpressure cannot be seen")


def _listener_send_buffer(port: int) -> int:
    """SO_SNDBUF of this process's listener on ``port`` (through a duplicate descriptor)."""
    import os
    import stat

    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if (sock.family == socket.AF_INET and sock.getsockname()[1] == port
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    raise AssertionError(f"no listener on port {port} in this process")
