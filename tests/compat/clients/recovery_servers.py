"""The servers of the recovery rows (``test_recovery_clients.py``).

One event loop in a background thread (``servers.loop_in_thread``) runs, on
real sockets on 127.0.0.1:

* ``upstream``: the fake engine of the sidecar tests
  (``tests/sidecar/upstreams.py``, :class:`FakeUpstream`): ``x-fake-tokens``
  chunks ``t0 t1 ...`` after a role chunk, then the finish, the usage and
  ``[DONE]``;
* ``redis``: a :class:`Sidecar` built from the flags an operator of replicas
  types: ``--resume --resume-store redis://... --resume-owner-secret ...``, a
  resume grace (a client cut off keeps its answer generating for its
  reconnect), ``--cors-allow-origins`` the browser rows' page,
  ``--client-settings slow_client_policy=coalesce|block``;
* ``tls``: the same in front of the same engine, with ``--tls-cert``/``--tls-key``
  (a trustme CA), its own memory store: HTTP/2 by ALPN;
* ``block``: a sidecar that lets a request choose ``coalesce`` or ``block``, in
  front of :class:`BurstEngine` (below);
* relays made per row: a :class:`~.servers.SlowLink` cutting its first
  connection a few events in (a dropped network), a :class:`FailoverLink` in
  front of two replicas (a load balancer).

The ``writer_gone`` rows start real sidecar processes (``tests/sidecar/processes.py``,
``spawn``) sharing the same Redis, and SIGKILL one.

Every in-process sidecar's records are kept with its log fields by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tokenwire.middleware import StreamRecord
from tokenwire.sidecar import Sidecar, StreamLog

from tokenwire.tools.cli import load_sidecar_config

from .servers import SlowLink, loop_in_thread

# tests/sidecar is not a package: its helpers are imported by name, as tests/test_readme.py does.
_SIDECAR_TESTS = str(Path(__file__).resolve().parents[2] / "sidecar")
if _SIDECAR_TESTS not in sys.path:
    sys.path.append(_SIDECAR_TESTS)
from clients import tls_server_files  # noqa: E402
from processes import SidecarProcess, spawn  # noqa: E402
from upstreams import FakeUpstream, chunk  # noqa: E402

__all__ = ["CHAT", "BurstEngine", "FailoverLink", "RecoveryServers", "SidecarProcess", "chat_body",
           "error_of", "running_recovery_servers"]

T = TypeVar("T")
CHAT = "/normal/v1/chat/completions"
OWNER_SECRET = "recovery-rows-share-this"
RESUME_GRACE_S = 10.0
CUT_AFTER_BYTES = 1500
"""A cut link's first connection ends after this many bytes of the answer (head
included): about seven events in, mid-event."""
BLOCK_SETTINGS = "slow_client_policy=coalesce|block"


class _Records(StreamLog):
    """A sidecar's records in memory, with its log fields by request id."""

    def __init__(self, into: list[StreamRecord], extras: dict[str, dict[str, object]]) -> None:
        super().__init__(None)
        self.into = into
        self.extras = extras

    def write(self, record: StreamRecord, **extra: object) -> None:
        self.extras[record.request_id] = extra
        self.into.append(record)


@dataclass
class BurstEngine:
    """A blocking-socket engine that writes its whole answer (``chunks`` text
    chunks, the finish, ``[DONE]``) as fast as TCP takes it, through a small send
    buffer, and says when it was made to wait: ``held`` is set once its socket
    took nothing for :attr:`HELD_S` (the sidecar stopped reading it, or could
    not keep up), ``finished`` once the answer is written."""

    HELD_S = 0.1
    chunks: int = 5000
    sock: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    held: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    held_s: float = 0.0
    """How long the socket of the last answer took nothing, in all."""
    changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def text(self) -> list[str]:
        return [f"w{i:04d} " for i in range(self.chunks)]

    def serve(self) -> None:
        """Answers each connection, one thread each, until the socket is closed."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def reset(self) -> None:
        self.held.clear()
        self.finished.clear()
        self.held_s = 0.0

    def wait_held_or_finished(self, timeout_s: float) -> bool:
        """Wait (on the engine's own notifications) until it was held or wrote its answer."""
        with self.changed:
            return self.changed.wait_for(lambda: self.held.is_set() or self.finished.is_set(), timeout_s)

    def _note(self, event: threading.Event) -> None:
        with self.changed:
            event.set()
            self.changed.notify_all()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    return  # a connection the sidecar opened and never used
                request += data
            head, _, body = request.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            while len(body) < length:
                body += conn.recv(65536)
            frames = [chunk(role="assistant"), *(chunk(text) for text in self.text()),
                      chunk(finish="stop"), b"data: [DONE]\n\n"]
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                self._send(conn, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"connection: close\r\n\r\n")
                for start in range(0, len(frames), 20):  # ~3 KB per write, as an engine flushes
                    self._send(conn, b"".join(frames[start:start + 20]))
                self._note(self.finished)

    def _send(self, conn: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            _, writable, _ = select.select([], [conn], [], self.HELD_S)
            if not writable:
                self._note(self.held)  # nothing taken for HELD_S: the engine waits on its reader
                began = time.monotonic()
                select.select([], [conn], [], 30.0)
                self.held_s += self.HELD_S + time.monotonic() - began
                continue
            view = view[conn.send(view):]


class FailoverLink:
    """A TCP relay in front of replicas, as a load balancer: each connection goes
    to the first of ``ports`` that accepts it (a SIGKILLed replica refuses), and
    is relayed both ways as it comes. ``landed`` lists the port of each,
    ``answered_bytes`` counts what the replicas sent back."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.landed: list[int] = []
        self.answered_bytes = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        for port in self.ports:
            try:
                server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            self.landed.append(port)
            break
        else:
            client_writer.close()
            return

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, back: bool) -> None:
            try:
                while data := await reader.read(65536):
                    self.answered_bytes += len(data) if back else 0
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(client_reader, server_writer, False),
                             pump(server_reader, client_writer, True))


@dataclass
class RecoveryServers:
    loop: asyncio.AbstractEventLoop
    upstream: FakeUpstream
    burst: BurstEngine
    redis_url: str
    page_origin: str
    tls_files: dict[str, str]
    urls: dict[str, str] = field(default_factory=dict)
    """``redis``, ``tls``, ``block`` → the sidecar's base URL."""
    records: list[StreamRecord] = field(default_factory=list)
    extras: dict[str, dict[str, object]] = field(default_factory=dict)
    """Request id → the sidecar's log fields (``method``, ``path``, ``http_version``...)."""

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def port(self, name: str) -> int:
        return int(self.urls[name].rsplit(":", 1)[1])

    def cut_link(self, name: str = "redis") -> tuple[str, SlowLink]:
        """A relay to sidecar ``name`` that cuts its first connection after
        :data:`CUT_AFTER_BYTES`, and carries every later one whole: its URL."""
        link = SlowLink(self.port(name), 10**9, cut_first_after_bytes=CUT_AFTER_BYTES)
        port = self.run(link.start())
        return f"http://127.0.0.1:{port}", link

    def failover_link(self, ports: list[int]) -> tuple[str, FailoverLink]:
        """A relay to the first of ``ports`` that accepts each connection: its URL."""
        link = FailoverLink(ports)
        port = self.run(link.start())
        return f"http://127.0.0.1:{port}", link

    def close_link(self, link: SlowLink | FailoverLink) -> None:
        self.run(link.stop())

    def record(self, request_id: str, timeout_s: float = 10.0) -> StreamRecord:
        """The record of the request ``request_id`` (its ``x-request-id``; waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in list(self.records):
                if record.request_id == request_id:
                    return record
            time.sleep(0.01)
        raise AssertionError(f"no record for {request_id}")

    def resume_records(self, stream_id: str, count: int, timeout_s: float = 10.0) -> list[StreamRecord]:
        """The records of the first ``count`` ``GET /v1/streams/{stream_id}`` the
        sidecars here served, in the order they ended (waits for them)."""
        path = f"/v1/streams/{stream_id}"
        deadline = time.monotonic() + timeout_s
        while True:
            found = [record for record in list(self.records)
                     if self.extras.get(record.request_id, {}).get("path") == path
                     and self.extras[record.request_id].get("method") == "GET"]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.01)

    # ------------------------------------------------------------ the store

    def stored_end(self, stream_id: str, timeout_s: float = 15.0) -> dict[str, str]:
        """The stream's hash in Redis once its end is stored there (waits for it)."""
        import redis

        client = redis.Redis.from_url(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                state = {k.decode(): v.decode() for k, v in client.hgetall(f"tw:{{{stream_id}}}:m").items()}
                if state.get("end"):
                    return state
                assert time.monotonic() < deadline, f"stream {stream_id} never ended in the store: {state}"
                time.sleep(0.02)  # polling Redis: the store has nothing to wait on
        finally:
            client.close()

    def lose_events(self, stream_id: str, first: int, last: int) -> int:
        """Delete events ``first..last`` of the stored stream: what a Redis that
        restarted from an older snapshot or AOF, or failed over to a replica
        that had not yet received them, no longer has. The number deleted."""
        import redis

        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.xdel(f"tw:{{{stream_id}}}:e", *[f"0-{n}" for n in range(first, last + 1)]))
        finally:
            client.close()

    def replica(self, *extra: str) -> SidecarProcess:
        """A sidecar process sharing the Redis store (and its owner secret) with the others."""
        return spawn(["--upstream", self.upstream.url, "--resume", "--resume-store", self.redis_url,
                      "--resume-owner-secret", OWNER_SECRET, "--cors-allow-origins", self.page_origin,
                      *extra])


async def _sidecar(servers: RecoveryServers, stack: contextlib.AsyncExitStack, upstream: str,
                   *flags: str) -> str:
    config = load_sidecar_config(["--upstream", upstream, "--listen", "127.0.0.1:0", "--admin-listen", "",
                                  "--drain-s", "0", *flags], {})
    sidecar = Sidecar(config, log=_Records(servers.records, servers.extras))
    await sidecar.start()
    stack.push_async_callback(sidecar.shutdown)
    scheme = "https" if config.tls_cert else "http"
    return f"{scheme}://127.0.0.1:{sidecar.address[1]}"


async def _start(servers: RecoveryServers, stack: contextlib.AsyncExitStack) -> None:
    await servers.upstream.start()
    stack.push_async_callback(servers.upstream.stop)
    up = servers.upstream.url
    servers.urls["redis"] = await _sidecar(
        servers, stack, up, "--resume", "--resume-store", servers.redis_url, "--resume-owner-secret",
        OWNER_SECRET, "--resume-grace-s", str(RESUME_GRACE_S), "--cors-allow-origins", servers.page_origin,
        "--client-settings", BLOCK_SETTINGS)
    servers.urls["tls"] = await _sidecar(
        servers, stack, up, "--resume", "--tls-cert", servers.tls_files["tls_cert"],
        "--tls-key", servers.tls_files["tls_key"])
    servers.urls["block"] = await _sidecar(servers, stack, servers.burst.url, "--client-settings",
                                           BLOCK_SETTINGS)


@contextlib.contextmanager
def running_recovery_servers(redis_url: str, page_origin: str, directory: Path) -> Iterator[RecoveryServers]:
    """The engines and the sidecars in front of them, until the block ends."""
    import trustme

    burst = BurstEngine()
    threading.Thread(target=burst.serve, daemon=True).start()
    with loop_in_thread() as loop:
        servers = RecoveryServers(loop, FakeUpstream(), burst, redis_url, page_origin,
                                  tls_server_files(trustme.CA(), directory))
        stack = contextlib.AsyncExitStack()
        try:
            servers.run(_start(servers, stack))
            yield servers
        finally:
            servers.run(stack.aclose())
            burst.sock.close()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}], **extra}


def error_of(data: str) -> dict[str, Any] | None:
    """The ``error`` object of an in-band error event's data, or None."""
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    return error if isinstance(error, dict) else None
