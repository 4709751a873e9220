"""A rolling restart loses no stream: with resume on and a Redis store the
replicas share, a draining sidecar hands its open streams off (its clients are
closed without the terminal event, reconnect, and are served from the store by
another replica, while the draining one keeps generating into the store).

In process: two sidecars, one drained, one client resuming on the other.
Processes: three sidecars behind a real HAProxy (``mode tcp``, round-robin,
health-checked), 30 clients that reconnect as the README's retry says, each
replica restarted in turn; every answer exact and generated once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from clients import chat_body
from conftest import LoopThread, RecordingLog, make_config
from processes import SidecarProcess, spawn
from resume_client import request_bytes
from test_resume import PATH, text_of
from tokenwire.middleware import EndReason, SSEEvent
from tokenwire.sidecar.process.server import Sidecar
from upstreams import FakeUpstream, expected_text

from tokenwire.tools.sse_client import SSEResponse, read_response

pytestmark = pytest.mark.slow

SECRET = "replicas-share-this"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _exact(events: list[SSEEvent], stream_id: str, tokens: int) -> None:
    """The whole answer, once: role, the tokens, finish, usage, [DONE], ids 1.. in a row."""
    assert [e.id for e in events] == [f"{stream_id}.{n}" for n in range(1, tokens + 5)]
    assert text_of(events) == expected_text(tokens)
    assert events[-1].data == "[DONE]"


# ---------------------------------------------------------------- in process


def test_a_drained_sidecar_hands_its_stream_to_the_other(
        loop_thread: LoopThread, upstream: FakeUpstream, redis_url: str) -> None:
    def sidecar() -> tuple[Sidecar, RecordingLog]:
        config = make_config(upstream.url, resume=True, resume_store=redis_url,
                             resume_owner_secret=SECRET, drain_s=10.0)
        log = RecordingLog()
        running = Sidecar(config, log=log)
        loop_thread.run(running.start())
        return running, log

    (first, first_log), (second, _) = sidecar(), sidecar()
    try:
        tokens = 150
        sock = socket.create_connection(first.address, timeout=10)
        sock.sendall(request_bytes("POST", PATH, body=chat_body(), headers={
            "x-request-id": "handed-1", "x-fake-tokens": str(tokens), "x-fake-delay-s": "0.01"}))
        draining: list[concurrent.futures.Future[None]] = []

        def drain_after_five(response: SSEResponse, event: SSEEvent) -> bool:
            if len(response.data_events) == 5 and not draining:
                # SIGTERM's equivalent: the drain, on the sidecar's loop, not awaited here.
                draining.append(asyncio.run_coroutine_threadsafe(first.shutdown(), loop_thread.loop))
            return False

        began = time.monotonic()
        part = read_response(sock, timeout_s=10, stop=drain_after_five)
        sock.close()
        cut_at = time.monotonic()
        # Cut without its terminal event and without the in-band shutdown error, long
        # before the answer's end (1.5 s): the hand-off, not the drain's end.
        assert part.status == 200 and not part.clean_end and draining
        assert part.data_events[-1].data != "[DONE]" and "error" not in (part.data_events[-1].data or "")
        assert cut_at - began < 1.0
        stream_id = part.stream_id
        rest = _get(second.address[1], f"/v1/streams/{stream_id}", part.data_events[-1].id or "")
        assert rest.status == 200 and rest.clean_end
        _exact(part.data_events + rest.data_events, stream_id, tokens)
        assert len(upstream.requests_with("handed-1")) == 1  # generated once, on the first
        draining[0].result(15)  # its drain ends once the answer is stored
        record = next(r for r in first_log.records if r.request_id == "handed-1")
        assert record.end_reason is EndReason.DETACHED  # completed into the store for a reader
    finally:
        if not draining:
            loop_thread.run(first.shutdown())
        loop_thread.run(second.shutdown())


def _get(port: int, path: str, last_event_id: str) -> SSEResponse:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_bytes("GET", path, headers={"Accept": "text/event-stream",
                                                        "Last-Event-ID": last_event_id}))
        return read_response(sock, timeout_s=10)


# ---------------------------------------------------------------- three processes behind HAProxy


@dataclass
class Balancer:
    """HAProxy in front of the replicas: round-robin, a TCP connect check every 100 ms."""

    process: subprocess.Popen[bytes]
    port: int
    stats: Path

    def status(self) -> dict[str, str]:
        """Each server's status as HAProxy sees it (``UP``, ``DOWN``...)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.stats))
            sock.sendall(b"show stat\n")
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
        lines = out.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {row["svname"]: row["status"] for row in rows if row["svname"].startswith("r")}

    def wait(self, name: str, status: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := self.status().get(name, "")).split()[0:1] != [status]:
            assert time.monotonic() < deadline, f"{name} is {seen}, not {status}"
            time.sleep(0.02)


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[tuple[Balancer, list[int]]]:
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(binary).exists():
        pytest.fail("haproxy is not installed: run scripts/system-deps.sh haproxy")
    ports = [_free_port() for _ in range(3)]
    port = _free_port()
    stats = tmp_path / "haproxy.sock"
    servers = "\n".join(f"    server r{n} 127.0.0.1:{p} check inter 100ms fall 1 rise 1"
                        for n, p in enumerate(ports))
    (tmp_path / "haproxy.cfg").write_text(f"""\
global
    maxconn 2000
    stats socket {stats} level admin
defaults
    mode tcp
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    # A replica that stopped listening is skipped at once, never waited for.
    retries 3
    option redispatch 1
listen sidecars
    bind 127.0.0.1:{port}
    balance roundrobin
{servers}
""")
    process = subprocess.Popen([binary, "-f", str(tmp_path / "haproxy.cfg"), "-db"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not stats.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr
        time.sleep(0.02)
    yield Balancer(process, port, stats), ports
    process.terminate()
    process.wait(10)


@dataclass
class Client:
    """One streaming client, reconnecting as the README says: the POST re-sent with
    ``Last-Event-ID`` (an SDK's retry) or, every other one, ``GET /v1/streams/{id}``
    with it (what an EventSource sends by itself); a 503 or a refused connection
    before any event is retried (an SDK retries those)."""

    number: int
    tokens: int
    port: int
    events: list[SSEEvent] = field(default_factory=list)
    stream_id: str = ""
    cuts: list[float] = field(default_factory=list)
    """When each response was cut without its end."""
    resumed: list[float] = field(default_factory=list)
    """When the first event of each reconnect after a cut arrived."""
    retries: int = 0
    error: str = ""

    @property
    def request_id(self) -> str:
        return f"rolling-{self.number}"

    def run(self, deadline: float) -> None:
        try:
            self._run(deadline)
        except Exception as error:  # the test reports it with the client's number
            self.error = repr(error)

    def _run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            headers = {"x-request-id": self.request_id, "x-fake-tokens": str(self.tokens),
                       "x-fake-delay-s": "0.02"}
            method, path, body = "POST", PATH, chat_body()
            if self.events:
                headers["Last-Event-ID"] = self.events[-1].id or ""
                if self.number % 2:
                    method, path, body = "GET", f"/v1/streams/{self.stream_id}", b""
                    headers = {"Accept": "text/event-stream", "Last-Event-ID": headers["Last-Event-ID"]}
            first_seen: list[float] = []

            def note(response: SSEResponse, event: SSEEvent, first_seen: list[float] = first_seen) -> bool:
                if not first_seen and event.data is not None:
                    first_seen.append(time.monotonic())
                return False

            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
                    sock.sendall(request_bytes(method, path, body=body, headers=headers))
                    response = read_response(sock, timeout_s=10, stop=note)
            except OSError:
                response = SSEResponse()
            if response.status in (0, 503) and not response.data_events:
                self.retries += 1  # not served (a replica going away): once more, a moment later
                time.sleep(0.05)
                continue
            if response.status == 204:
                return  # after the last event: an EventSource stops here
            assert response.status == 200, (response.status, response.body[:300])
            if first_seen and self.cuts and len(self.resumed) < len(self.cuts):
                self.resumed.append(first_seen[0])
            self.stream_id = self.stream_id or response.stream_id
            self.events += response.data_events
            if response.clean_end:
                return
            self.cuts.append(time.monotonic())
        raise AssertionError("the answer did not end in time")


def test_a_rolling_restart_of_three_replicas_loses_no_stream(
        balancer: tuple[Balancer, list[int]], upstream: FakeUpstream, redis_url: str) -> None:
    haproxy, ports = balancer
    args = ["--upstream", upstream.url, "--resume", "--resume-store", redis_url,
            "--resume-owner-secret", SECRET, "--drain-s", "20"]

    def start(n: int) -> SidecarProcess:
        return spawn([*args, "--listen", f"127.0.0.1:{ports[n]}"])

    replicas = [start(n) for n in range(3)]
    for n in range(3):
        haproxy.wait(f"r{n}", "UP")
    tokens = 200  # 4 s an answer at 50 tokens/s
    clients = [Client(n, tokens, haproxy.port) for n in range(30)]
    deadline = time.monotonic() + 50
    threads: list[threading.Thread] = []
    sigterms: list[float] = []
    stopped: list[int] = []
    offered: list[int] = []  # streams each replica had open at its SIGTERM
    try:
        # The answers start spread over the restarts (one every 0.35 s), so that
        # every replica has streams of its own open when its turn comes.
        for client in clients[:6]:
            threads.append(threading.Thread(target=client.run, args=(deadline,), daemon=True))
            threads[-1].start()
            time.sleep(0.35)
        pending = clients[6:]
        for n in range(3):
            sigterms.append(time.monotonic())
            replicas[n].signal(signal.SIGTERM)
            # The rest of the clients keep arriving while the replica drains.
            while replicas[n].process.poll() is None:
                if pending:
                    client = pending.pop(0)
                    threads.append(threading.Thread(target=client.run, args=(deadline,), daemon=True))
                    threads[-1].start()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    replicas[n].process.wait(0.35)
            stopped.append(replicas[n].process.returncode)
            _, err = replicas[n].process.communicate(timeout=5)
            handed = [line for line in err.decode().splitlines() if "offered a hand-off" in line]
            assert handed, err.decode()[-2000:]
            offered.append(int(handed[0].split("draining: ")[1].split()[0]))
            replicas[n] = start(n)
            haproxy.wait(f"r{n}", "UP")
        for client in pending:
            threads.append(threading.Thread(target=client.run, args=(deadline,), daemon=True))
            threads[-1].start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for replica in replicas:
            replica.stop()
    assert stopped == [0, 0, 0]
    assert [c.error for c in clients if c.error] == []
    for client in clients:
        _exact(client.events, client.stream_id, tokens)
    generations = [len(upstream.requests_with(c.request_id)) for c in clients]
    assert generations == [1] * 30  # each answer generated once, whatever replica served it
    cut = [c for c in clients if c.cuts]
    waits = [resumed - max(t for t in sigterms if t <= at)
             for c in cut for at, resumed in zip(c.cuts, c.resumed, strict=False)]
    cuts = sum(len(c.cuts) for c in cut)
    print(f"\nopen at each SIGTERM: {offered}; {len(cut)} of 30 clients handed off ({cuts} cuts, "
          f"{sum(c.retries for c in clients)} requests retried); SIGTERM to the reconnect's first event: "
          f"median {statistics.median(waits) * 1000:.0f} ms, max {max(waits) * 1000:.0f} ms")
    assert min(offered) >= 1 and len(cut) >= 10, offered  # every restart had streams to hand off
    assert max(waits) < 5.0
