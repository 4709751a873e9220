"""``/readyz`` of real sidecar processes while a fake engine on a fixed port is
stopped and started again, and while a real ``redis-server`` (the resume store)
is stopped and started again. Every wait polls against a deadline; the times
from "the engine is up" to "readyz 200" are measured and bounded by the health
interval they promise."""

from __future__ import annotations

import http.client
import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import SidecarProcess, spawn

pytestmark = pytest.mark.slow

INTERVAL_S = 0.5
TIMEOUT_S = 0.25
# What a loaded 2-core machine may add to a wait (process wake-ups, the poll's own step).
SLACK_S = 0.5
FAST = ["--health-interval-s", str(INTERVAL_S), "--health-timeout-s", str(TIMEOUT_S)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _EngineHandler(http.server.BaseHTTPRequestHandler):
    BODY = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{"content":"hi"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')

    def do_GET(self) -> None:
        self._answer(200, b"application/json", b'{"status":"ok"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self._answer(200, b"text/event-stream", self.BODY)

    def _answer(self, status: int, content_type: bytes, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type.decode())
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Engine:
    """A fake engine that can be stopped and started again on its one port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Listening from the moment this returns; that moment (``time.monotonic()``)."""
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _EngineHandler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return time.monotonic()

    def stop(self) -> float:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        return time.monotonic()


@pytest.fixture
def engine() -> Iterator[Engine]:
    fake = Engine()
    yield fake
    fake.stop()


@pytest.fixture
def sidecars() -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(*args: str) -> SidecarProcess:
        process = spawn(list(args))
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def readyz(sidecar: SidecarProcess) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.admin_port or 0, timeout=5)
    try:
        conn.request("GET", "/readyz")
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def codes(body: dict[str, Any]) -> list[str]:
    return [reason["code"] for reason in body.get("reasons", [])]


def wait_status(sidecar: SidecarProcess, status: int, timeout_s: float) -> float:
    """Poll ``/readyz`` every 10 ms until it answers ``status``; when it first did."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic()
        if readyz(sidecar)[0] == status:
            return now
        assert now < deadline, f"/readyz did not answer {status} within {timeout_s} s: {readyz(sidecar)}"
        time.sleep(0.01)


def _measured(label: str, seconds: float) -> None:
    print(f"\n[readiness] {label}: {seconds * 1000:.0f} ms")


def test_readyz_follows_the_health_checks_as_the_engine_goes_and_comes_back(
        engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    sidecar = sidecars("--upstream", engine.url, "--health-path", "/health", *FAST)
    status, body = readyz(sidecar)
    assert status == 503 and codes(body) == ["no_healthy_upstream"], body
    up_at = engine.start()
    # Never passed: its first pass puts it in, at the next check.
    ready_after = wait_status(sidecar, 200, INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at
    _measured("engine up -> readyz 200 (first pass)", ready_after)
    assert ready_after <= INTERVAL_S + SLACK_S
    down_at = engine.stop()
    out_after = wait_status(sidecar, 503, 2 * INTERVAL_S + TIMEOUT_S + SLACK_S) - down_at
    _measured("engine down -> readyz 503 (2 failed checks)", out_after)
    assert codes(readyz(sidecar)[1]) == ["no_healthy_upstream"]
    up_at = engine.start()
    # It had passed before: health_healthy_threshold (2) passes put it back.
    back_after = wait_status(sidecar, 200, 2 * INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at
    _measured("engine back -> readyz 200 (2 passes)", back_after)
    assert back_after <= 2 * INTERVAL_S + SLACK_S


def _post(sidecar: SidecarProcess) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                     headers={"content-type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_without_health_checks_readyz_follows_the_last_connects(
        engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    sidecar = sidecars("--upstream", engine.url, *FAST)
    # Without checks nothing is known before a first connect...
    assert readyz(sidecar)[0] == 200
    assert _post(sidecar) in (502, 503)
    # ...and a failed one says it at once.
    status, body = readyz(sidecar)
    assert status == 503 and codes(body) == ["upstreams_unreachable"], body
    # Out of its Service it gets no traffic: the connect probe finds the engine back.
    up_at = engine.start()
    ready_after = wait_status(sidecar, 200, INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at
    _measured("engine up -> readyz 200 (connect probe)", ready_after)
    assert ready_after <= INTERVAL_S + SLACK_S
    assert _post(sidecar) == 200
    engine.stop()
    assert readyz(sidecar)[0] == 200  # the last connect succeeded
    assert _post(sidecar) in (502, 503)
    assert codes(readyz(sidecar)[1]) == ["upstreams_unreachable"]
    up_at = engine.start()
    assert wait_status(sidecar, 200, INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at <= INTERVAL_S + SLACK_S


def test_no_ready_requires_upstream_keeps_readyz_200_with_the_engine_down(
        engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    sidecar = sidecars("--upstream", engine.url, "--health-path", "/health",
                       "--no-ready-requires-upstream", *FAST)
    assert readyz(sidecar) == (200, {"status": "ready"})


def test_the_workers_supervisor_is_ready_only_when_every_worker_is(
        engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    sidecar = sidecars("--workers", "2", "--upstream", engine.url, "--health-path", "/health", *FAST)
    status, body = readyz(sidecar)
    assert status == 503 and codes(body) == ["no_healthy_upstream"] and body["worker"] in (0, 1), body
    up_at = engine.start()
    ready_after = wait_status(sidecar, 200, INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at
    _measured("engine up -> supervisor readyz 200 (2 workers)", ready_after)
    assert readyz(sidecar) == (200, {"status": "ready"})


# ---------------------------------------------------------------- the resume store


class Redis:
    """A real ``redis-server`` on a fixed port, stopped and started again."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            pytest.fail("redis-server is not installed: run scripts/system-deps.sh redis-server")
        self._binary = binary
        self._directory = directory
        self.port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> float:
        """Answering PING from the moment this returns; that moment."""
        self._process = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self._directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return time.monotonic()
            except OSError:
                pass
            assert time.monotonic() < deadline and self._process.poll() is None, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> float:
        if self._process is not None:
            self._process.kill()
            self._process.wait(10)
            self._process = None
        return time.monotonic()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    yield server
    server.stop()


def _resume_args(redis: Redis, engine: Engine) -> list[str]:
    return ["--upstream", engine.url, "--resume", "--resume-store", redis.url,
            "--resume-owner-secret", "readiness-test", *FAST]


def test_readyz_is_503_while_the_resume_store_is_down_and_200_once_it_is_back(
        redis: Redis, engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    engine.start()
    redis.start()
    sidecar = sidecars(*_resume_args(redis, engine))
    assert readyz(sidecar) == (200, {"status": "ready"})
    down_at = redis.stop()
    out_after = wait_status(sidecar, 503, INTERVAL_S + TIMEOUT_S + SLACK_S) - down_at
    _measured("redis down -> readyz 503", out_after)
    status, body = readyz(sidecar)
    assert status == 503 and codes(body) == ["resume_store_unreachable"], body
    up_at = redis.start()
    back_after = wait_status(sidecar, 200, INTERVAL_S + TIMEOUT_S + SLACK_S) - up_at
    _measured("redis back -> readyz 200", back_after)
    assert back_after <= INTERVAL_S + SLACK_S


def test_a_sidecar_started_with_the_store_down_is_not_ready_from_its_ready_line(
        redis: Redis, engine: Engine, sidecars: Callable[..., SidecarProcess]) -> None:
    engine.start()
    sidecar = sidecars(*_resume_args(redis, engine))
    status, body = readyz(sidecar)
    assert status == 503 and codes(body) == ["resume_store_unreachable"], body
    relaxed = sidecars(*_resume_args(redis, engine), "--no-ready-requires-store")
    assert readyz(relaxed) == (200, {"status": "ready"})
    # Both reasons at once when the engine is gone too.
    engine.stop()
    both = sidecars(*_resume_args(redis, engine), "--health-path", "/health")
    status, body = readyz(both)
    assert status == 503 and codes(body) == ["no_healthy_upstream", "resume_store_unreachable"], body
