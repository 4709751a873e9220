"""A Redis outage in the middle of a stream: killed (SIGKILL) at one event,
restarted at another, with and without its AOF. The live client gets the whole
answer either way; a resume afterwards is exact or clearly refused (the
in-band ``replay_gap`` error, or the 404 of a stream the store lost), never a
stream with tokens missing and a clean end."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import LoopThread, RunningSidecar
from resume_client import open_stream, resume
from upstreams import chunk, token

pytestmark = pytest.mark.slow

TOKENS = 60


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class RedisServer:
    """A redis-server this test may kill and start again on the same port and files."""

    directory: Path
    aof: bool
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.aof
                       else ["--appendonly", "no"])
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir",
             str(self.directory), *persistence], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as probe:
                    probe.sendall(b"PING\r\n")
                    if probe.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)  # polling a starting server's port: nothing to wait on instead
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


class GatedEngine:
    """An engine whose answer stops at given events until the test lets it go on."""

    def __init__(self, loop_thread: LoopThread, stops: tuple[int, ...]) -> None:
        self._loop_thread = loop_thread
        self.reached = {at: asyncio.Event() for at in stops}
        self.go_on = {at: asyncio.Event() for at in stops}
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        writer.write(chunk(role="assistant"))
        for i in range(TOKENS):
            if i in self.reached:
                self.reached[i].set()
                await self.go_on[i].wait()
            writer.write(chunk(token(i)))
            await writer.drain()
            await asyncio.sleep(0.005)  # several batches while the store is down
        writer.write(chunk(finish="stop") + b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    def wait_reached(self, at: int) -> None:
        async def wait() -> None:
            await asyncio.wait_for(self.reached[at].wait(), 10)
        self._loop_thread.run(wait())

    def let_go(self, at: int) -> None:
        self._loop_thread.run(_set(self.go_on[at]))


async def _set(event: asyncio.Event) -> None:
    event.set()


@pytest.fixture
def redis_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, aof=request.param)
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def _texts(events: list[object]) -> list[str]:
    out = []
    for event in events:
        data = getattr(event, "data", None)
        if data and data.startswith("{"):
            delta = (json.loads(data).get("choices") or [{}])[0].get("delta", {})
            out.append(delta.get("content") or "")
    return out


# (kill at token, restart at token or None: after the answer ended)
POINTS = [(10, 30), (10, None), (50, None), (0, 5)]


@pytest.mark.parametrize("redis_server", [True, False], ids=["aof", "no-aof"], indirect=True)
@pytest.mark.parametrize(("kill_at", "restart_at"), POINTS)
def test_a_resume_after_a_redis_outage_is_exact_or_clearly_refused(
        redis_server: RedisServer, kill_at: int, restart_at: int | None, loop_thread: LoopThread,
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    stops = (kill_at,) if restart_at is None else (kill_at, restart_at)
    engine = GatedEngine(loop_thread, stops)
    loop_thread.run(engine.start())
    try:
        sidecar = start_sidecar(f"http://127.0.0.1:{engine.port}", resume=True, resume_grace_s=0.0,
                                resume_store=redis_server.url, resume_owner_secret="outage")

        def outage() -> None:
            engine.wait_reached(kill_at)
            redis_server.kill()
            engine.let_go(kill_at)
            if restart_at is not None:
                engine.wait_reached(restart_at)
                redis_server.start()
                engine.let_go(restart_at)

        thread = threading.Thread(target=outage, daemon=True)
        thread.start()
        live = open_stream(sidecar.port, "POST", "/v1/chat/completions", timeout_s=30,
                           body=b'{"stream": true, "messages": []}')
        thread.join(20)
        if restart_at is None:
            redis_server.start()
        # The live client never noticed.
        assert live.status == 200 and live.clean_end
        assert "".join(_texts(live.data_events)) == "".join(token(i) for i in range(TOKENS))
        outcomes: dict[int, str] = {}
        for after in (0, 3, kill_at, kill_at + 2):
            last_id = f"{live.stream_id}.{after}" if after else None
            got = resume(sidecar.port, live.stream_id, last_id, timeout_s=10)
            for _ in range(5):  # as a client does: a store not reachable yet says when to retry
                if got.status != 503:
                    break
                time.sleep(float(got.headers["retry-after"]))
                got = resume(sidecar.port, live.stream_id, last_id, timeout_s=10)
            if got.status != 200:
                # Clearly refused before any event: the store lost the stream itself.
                body = json.loads(got.body)
                assert got.status in (404, 410) and body["error"]["code"] in (
                    "stream_not_found", "replay_gap", "resume_unavailable"), (got.status, body)
                outcomes[after] = body["error"]["code"]
                continue
            seqs = [int(event.id.rpartition(".")[2]) for event in got.data_events if event.id]
            assert seqs == list(range(after + 1, after + 1 + len(seqs))), seqs  # nothing skipped
            if got.clean_end:
                # Exact: everything from where it asked, to [DONE].
                assert seqs[-1] == TOKENS + 3 and got.data_events[-1].data == "[DONE]"
                outcomes[after] = "exact"
            else:
                error = json.loads(got.data_events[-1].data)["error"]
                assert error["code"] == "replay_gap", error
                outcomes[after] = "replay_gap"
        if redis_server.aof:
            # What was stored before the kill is replayed, then the loss is said.
            assert outcomes[0] == "replay_gap", outcomes
        print(f"\nkilled at {kill_at}, restarted at {restart_at} (aof {redis_server.aof}): "
              + ", ".join(f"from {after}: {outcome}" for after, outcome in sorted(outcomes.items())))
    finally:
        loop_thread.run(engine.stop())
