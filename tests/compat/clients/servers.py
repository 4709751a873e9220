"""The servers every client case talks to, started once for the folder.

One event loop in a background thread runs them all (real sockets on
127.0.0.1, clients in the test thread or in child processes):

* ``direct``: the scripted upstream alone under uvicorn (h11);
* ``middleware`` x profile: the same app inside ``TokenWireMiddleware`` under
  uvicorn, configured as a user of the README would (``WireConfig(resume=True)``);
* ``sidecar`` x profile: a :class:`Sidecar` built from the flags a user types
  (``tokenwire sidecar --upstream URL --resume``) in front of ``direct``.

Profiles: ``plain`` (the defaults), ``resume`` (resume on), ``heartbeat``
(heartbeats every 0.15 s), and those of the two rows beside the grid:
``reconnect`` (resume on with a grace, read through a :class:`SlowLink` that
cuts the first connection: ``cut-link-<driver>``) and ``drop`` (the drop
policy). Every stream's accounting record is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from behaviour.drivers import serve
from tokenwire.middleware import SlowClientPolicy, StreamRecord, TokenWireMiddleware, WireConfig
from tokenwire.sidecar import Sidecar, StreamLog

from tokenwire.tools.cli import load_sidecar_config

from .scripts import ScriptedUpstream

T = TypeVar("T")
DRIVERS = ("middleware", "sidecar")
TARGETS = ("direct", *DRIVERS)
PROFILES = ("plain", "resume", "heartbeat", "reconnect", "drop")
HEARTBEAT_S = 0.15
RESUME_GRACE_S = 5.0
DROPPABLE = "progress"
CUT_AFTER_BYTES = 1500
"""The ``reconnect`` row's first connection is cut after this many bytes of the
answer (head included): a few events in, mid-event, well before its end."""

MIDDLEWARE_CONFIG: dict[str, WireConfig | None] = {
    "plain": None,  # TokenWireMiddleware(app): the middleware's own defaults
    "resume": WireConfig(resume=True),
    "heartbeat": WireConfig(heartbeat_s=HEARTBEAT_S),
    "reconnect": WireConfig(resume=True, resume_grace_s=RESUME_GRACE_S),
    "drop": WireConfig(slow_client_policy=SlowClientPolicy.DROP, droppable_event_types=(DROPPABLE,)),
}
SIDECAR_FLAGS: dict[str, list[str]] = {
    "plain": [],
    "resume": ["--resume"],
    "heartbeat": ["--heartbeat-s", str(HEARTBEAT_S)],
    "reconnect": ["--resume", "--resume-grace-s", str(RESUME_GRACE_S)],
    "drop": ["--slow-client-policy", "drop", "--droppable-event-types", DROPPABLE],
}


def stall_max_s(case: str) -> float:
    """Read directly, the upstream waits for the reader: stall a fixed while then."""
    return DIRECT_STALL_S if case.endswith(".direct") else THROUGH_STALL_MAX_S


SLOW_LINK_BYTES_S = 400_000
DIRECT_STALL_S = 0.5
THROUGH_STALL_MAX_S = 10.0


class _Records(StreamLog):
    """Keeps the sidecar's records in memory instead of writing JSON lines, and
    the HTTP version each request came in (``"1.1"`` or ``"2"``) by request id."""

    def __init__(self, into: list[StreamRecord], http_versions: dict[str, object]) -> None:
        super().__init__(None)
        self.into = into
        self.http_versions = http_versions

    def write(self, record: StreamRecord, **extra: object) -> None:
        self.http_versions[record.request_id] = extra.get("http_version")
        self.into.append(record)


@dataclass
class Servers:
    loop: asyncio.AbstractEventLoop
    upstream: ScriptedUpstream
    urls: dict[tuple[str, str], str] = field(default_factory=dict)
    """``(target, profile)`` → base URL (``direct`` has one for every profile)."""
    broken: dict[tuple[str, str], Exception] = field(default_factory=dict)
    """A target that could not be built as a user would build it: its cases fail with this."""
    records: list[StreamRecord] = field(default_factory=list)
    http_versions: dict[str, object] = field(default_factory=dict)
    """The sidecar's request id → the HTTP version the client spoke (its access log's ``http_version``)."""
    sidecar_retries: int = 0

    def url(self, target: str, profile: str) -> str:
        if (target, profile) in self.broken:
            error = self.broken[(target, profile)]
            raise AssertionError(f"{target} ({profile}) could not be set up: {error!r}") from error
        return self.urls[(target, profile)]

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stall(self, case: str) -> None:
        """A slow reader's pause: until the upstream wrote all of ``case``'s answer
        (through tokenwire, which takes it all), at most ``stall_max_s(case)``."""
        deadline = time.monotonic() + stall_max_s(case)
        while case not in self.upstream.finished and time.monotonic() < deadline:
            time.sleep(0.01)

    def record_of(self, case: str, timeout_s: float = 10.0) -> StreamRecord:
        """The accounting record of ``case``'s last request (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = self.upstream.requests.get(case)
            if ids:
                for record in reversed(self.records):
                    if record.request_id == ids[-1]:
                        return record
            time.sleep(0.01)
        raise AssertionError(f"no record for {case} (requests {self.upstream.requests.get(case)})")


class SlowLink:
    """A TCP relay that carries the answer to the client at ``bytes_per_s``
    (a slow mobile link), reading the server through a 4 KiB receive buffer so
    the server feels it. A browser is never a slow reader by itself: Chromium
    takes megabytes off a socket while the page reads nothing (measured: 24 MB
    in 2.5 s behind a stalled fetch reader), so its slow cases go through this.

    With ``cut_first_after_bytes`` the first connection it relays is closed
    (both ways) once that many bytes of the answer went to the client: a
    dropped connection mid-answer, which a reconnecting client survives."""

    CHUNK_BYTES = 2048

    def __init__(self, port: int, bytes_per_s: int, cut_first_after_bytes: int | None = None) -> None:
        self.port = port
        self.bytes_per_s = bytes_per_s
        self.cut_first_after_bytes = cut_first_after_bytes
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
            server_reader, server_writer = await asyncio.open_connection(sock=sock, limit=self.CHUNK_BYTES)
        except OSError:
            sock.close()
            client_writer.close()
            return
        self.connections += 1
        cut_after = self.cut_first_after_bytes if self.connections == 1 else None

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pace: bool) -> None:
            sent = 0
            try:
                while data := await reader.read(self.CHUNK_BYTES):
                    if pace and cut_after is not None and sent + len(data) >= cut_after:
                        writer.write(data[:cut_after - sent])
                        await writer.drain()
                        server_writer.close()
                        break
                    sent += len(data)
                    writer.write(data)
                    await writer.drain()
                    if pace:
                        await asyncio.sleep(len(data) / self.bytes_per_s)
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(client_reader, server_writer, False),
                             pump(server_reader, client_writer, True))


async def _start(servers: Servers, stack: contextlib.AsyncExitStack) -> None:
    app = servers.upstream
    direct_port = await stack.enter_async_context(serve(app))
    direct = f"http://127.0.0.1:{direct_port}"
    for profile in PROFILES:
        servers.urls[("direct", profile)] = direct
        config = MIDDLEWARE_CONFIG[profile]
        on_finished = servers.records.append
        try:
            wrapped = (TokenWireMiddleware(app, on_finished=on_finished) if config is None
                       else TokenWireMiddleware(app, config, on_finished=on_finished))
        except ValueError as error:  # ConfigError: the README's own usage must be valid
            servers.broken[("middleware", profile)] = error
            wrapped = TokenWireMiddleware(app, on_finished=on_finished)
        port = await stack.enter_async_context(
            serve(wrapped, send_buffer_bytes=wrapped.config.socket_send_buffer_bytes))
        servers.urls[("middleware", profile)] = f"http://127.0.0.1:{port}"
        sidecar_config = load_sidecar_config(
            ["--upstream", direct, "--listen", "127.0.0.1:0", "--admin-listen", "", "--drain-s", "0",
             *SIDECAR_FLAGS[profile]], {})
        servers.sidecar_retries = sidecar_config.wire.retry_attempts
        sidecar = Sidecar(sidecar_config, log=_Records(servers.records, servers.http_versions))
        await sidecar.start()
        stack.push_async_callback(sidecar.shutdown)
        servers.urls[("sidecar", profile)] = f"http://127.0.0.1:{sidecar.address[1]}"
    for target in TARGETS:
        port = int(servers.urls[(target, "plain")].rsplit(":", 1)[1])
        link = SlowLink(port, SLOW_LINK_BYTES_S)
        servers.urls[(f"slow-link-{target}", "plain")] = f"http://127.0.0.1:{await link.start()}"
        stack.push_async_callback(link.stop)
    for driver in DRIVERS:
        port = int(servers.urls[(driver, "reconnect")].rsplit(":", 1)[1])
        link = SlowLink(port, 10**9, cut_first_after_bytes=CUT_AFTER_BYTES)
        servers.urls[(f"cut-link-{driver}", "reconnect")] = f"http://127.0.0.1:{await link.start()}"
        stack.push_async_callback(link.stop)


@contextlib.contextmanager
def loop_in_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop (uvloop where installed) running in a thread of its own, until the block ends."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@contextlib.contextmanager
def running_servers() -> Iterator[Servers]:
    with loop_in_thread() as loop:
        servers = Servers(loop, ScriptedUpstream())
        stack = contextlib.AsyncExitStack()
        try:
            servers.run(_start(servers, stack))
            yield servers
        finally:
            servers.run(stack.aclose())
