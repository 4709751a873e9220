"""Driver adapters for the shared behaviour suite.

A driver takes a :class:`Scenario` and returns the raw bytes a real client
received over a real socket on 127.0.0.1 (status line, headers, chunked body,
exactly as they came). ``test_behaviour.py`` runs every scenario against every
driver in :data:`DRIVERS` and holds each to the same reference.

Adding a driver: write a class with ``name`` and ``async def run(scenario)``
and register it with ``@register``. The sidecar slot is below.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import uvicorn
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.sidecar import Sidecar, SidecarConfig, StreamLog

from .scenarios import PLAYED, Scenario, scenario_app


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
    writer.write(f"GET /{scenario.name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
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


async def through_sidecar(app: Any, scenario: Scenario) -> bytes:
    """``app`` served bare by uvicorn as the upstream of an in-process
    :class:`Sidecar` (same loop); what a client of ``scenario`` got."""
    async with serve(app) as upstream_port:
        config = SidecarConfig(wire=scenario.config, upstream=(f"http://127.0.0.1:{upstream_port}",),
                               listen="127.0.0.1:0", admin_listen="", drain_s=0.0, log_file="")
        sidecar = Sidecar(config, log=StreamLog(None))
        await sidecar.start()
        try:
            return await fetch(sidecar.address[1], scenario)
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
