"""Driver adapters for the shared behaviour suite.

A driver takes a :class:`Scenario` and returns the raw bytes a real client
received over a real socket on 127.0.0.1 (status line, headers, chunked body,
exactly as they came). ``test_behaviour.py`` runs every scenario against every
driver in :data:`DRIVERS` and holds each to the same reference.

Adding a driver: write a class with ``name`` and ``async def run(scenario)``
and register it with ``@register``. The sidecar runs twice: its client speaking
HTTP/1.1 and HTTP/2.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.events
import h2.settings
import uvicorn
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.sidecar import Sidecar, SidecarConfig, StreamLog

from .scenarios import PLAYED, Scenario, path_of, scenario_app


class Driver(Protocol):
    name: str

    async def run(self, scenario: Scenario) -> bytes:
        """Play ``scenario``; return every byte the client received."""
        ...


DRIVERS: dict[str, Callable[[], Driver]] = {}


def register(factory: Callable[[], Driver]) -> Callable[[], Driver]:
    DRIVERS[factory().name] = factory
    return factory


@contextlib.asynccontextmanager
async def serve(app: Any, *, send_buffer_bytes: int | None = None) -> AsyncIterator[int]:
    """Run ``app`` under uvicorn (h11) in this loop on a free port; yield it.
    ``send_buffer_bytes`` caps SO_SNDBUF of accepted sockets (Linux inherits
    it from the listener), as a deployment of the middleware should."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http="h11", lifespan="off", log_level="critical", access_log=False,
                            date_header=False, server_header=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


async def fetch(port: int, scenario: Scenario) -> bytes:
    """GET ``/<scenario>`` as a real client; stall first if the scenario says so;
    read until the server ends the response or closes the connection."""
    sock = socket.socket()
    if scenario.client_stall_s:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    played = PLAYED[scenario.name] = asyncio.Event()
    writer.write(f"GET {path_of(scenario)} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Connection: close\r\n\r\n".encode())
    if scenario.client_stall_s:
        # asyncio reads eagerly; stop it so the kernel buffers fill up.
        writer.transport.pause_reading()
        # Stalled until the app has sent everything (the driver then holds what
        # the client did not take), and at least client_stall_s; bounded, for a
        # driver that pushes back on the app instead.
        loop = asyncio.get_running_loop()
        started = loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(played.wait(), max(10.0, 25 * scenario.client_stall_s))
        rest_s = scenario.client_stall_s - (loop.time() - started)
        if rest_s > 0:
            await asyncio.sleep(rest_s)
        writer.transport.resume_reading()
    try:
        return await asyncio.wait_for(reader.read(), 20)
    finally:
        writer.close()


async def through_middleware(app: Any, scenario: Scenario) -> bytes:
    """``app`` behind :class:`TokenWireMiddleware` under uvicorn; what a client of ``scenario`` got."""
    wrapped = TokenWireMiddleware(app, scenario.config)
    async with serve(wrapped, send_buffer_bytes=scenario.config.socket_send_buffer_bytes) as port:
        return await fetch(port, scenario)


async def through_sidecar(app: Any, scenario: Scenario,
                          client: Callable[[int, Scenario], Awaitable[bytes]] | None = None) -> bytes:
    """``app`` served bare by uvicorn as the upstream of an in-process
    :class:`Sidecar` (same loop); what ``client`` (HTTP/1.1 :func:`fetch` by
    default) got as a client of ``scenario``."""
    async with serve(app) as upstream_port:
        config = SidecarConfig(wire=scenario.config, upstream=(f"http://127.0.0.1:{upstream_port}",),
                               listen="127.0.0.1:0", admin_listen="", drain_s=0.0, log_file="")
        sidecar = Sidecar(config, log=StreamLog(None))
        await sidecar.start()
        try:
            return await (client or fetch)(sidecar.address[1], scenario)
        finally:
            await sidecar.shutdown()


@register
class MiddlewareDriver:
    """The scenario app behind :class:`TokenWireMiddleware`, under uvicorn (h11)."""

    name = "middleware"

    async def run(self, scenario: Scenario) -> bytes:
        return await through_middleware(scenario_app, scenario)


@register
class SidecarDriver:
    """The scenario app served bare by uvicorn as the upstream, with an
    in-process :class:`Sidecar` (same loop) in front of it.

    The sidecar runs with ``scenario.config`` as its wire config, no admin
    listener, no drain and no stream log. A ``Fail`` step makes the app raise,
    so uvicorn cuts the upstream body without its terminator; the sidecar
    reports that as ``UpstreamFailed(PROTOCOL)``, as the middleware does for
    the app's exception.
    """

    name = "sidecar"

    async def run(self, scenario: Scenario) -> bytes:
        return await through_sidecar(scenario_app, scenario)


async def fetch_h2(port: int, scenario: Scenario) -> bytes:
    """``fetch`` over HTTP/2 with prior knowledge, the answer rendered as the
    HTTP/1.1 bytes it stands for, so the suite holds it to the same reference:
    END_STREAM is the chunked terminator, unless trailers name an error
    (``tokenwire-error-code``: how the sidecar ends a dead stream), which, like
    RST_STREAM, is a body cut without it, and a body without Content-Length is
    chunked (HTTP/2 frames every body). A
    stalled client is one that neither reads nor opens its window: its stream
    window is 4 KiB, credited only once the stall is over."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    stall_s = scenario.client_stall_s
    if stall_s:
        conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4096})
    conn.initiate_connection()
    conn.send_headers(1, [(b":method", b"GET"), (b":path", path_of(scenario).encode()),
                          (b":scheme", b"http"), (b":authority", b"127.0.0.1")], end_stream=True)
    played = PLAYED[scenario.name] = asyncio.Event()
    writer.write(conn.data_to_send())
    if stall_s:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(played.wait(), max(10.0, 25 * stall_s))
        rest_s = stall_s - (loop.time() - started)
        if rest_s > 0:
            await asyncio.sleep(rest_s)
    status, headers, body, complete = b"", [], bytearray(), False
    ended = failed = False
    try:
        while not ended:
            data = await asyncio.wait_for(reader.read(65536), 20)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    fields = [(bytes(k), bytes(v)) for k, v in event.headers or []]
                    status = dict(fields)[b":status"]
                    headers = [(k, v) for k, v in fields if not k.startswith(b":")]
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data or b""
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    failed = any(bytes(name) == b"tokenwire-error-code" for name, _ in event.headers or [])
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
                    complete = not failed
                elif isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                    ended = True
            writer.write(conn.data_to_send())
    finally:
        writer.close()
    lines = [b"HTTP/1.1 " + status + b" -"] + [name + b": " + value for name, value in headers]
    if any(name == b"content-length" for name, _ in headers):
        return b"\r\n".join([*lines, b"", b""]) + bytes(body)
    lines.append(b"transfer-encoding: chunked")
    framed = b"%x\r\n%b\r\n" % (len(body), bytes(body)) if body else b""
    return b"\r\n".join([*lines, b"", b""]) + framed + (b"0\r\n\r\n" if complete else b"")


@register
class SidecarHttp2Driver:
    """The sidecar of :class:`SidecarDriver`, its client speaking HTTP/2 (prior
    knowledge): every wire rule holds per HTTP/2 stream, byte for byte."""

    name = "sidecar-h2"

    async def run(self, scenario: Scenario) -> bytes:
        return await through_sidecar(scenario_app, scenario, fetch_h2)
