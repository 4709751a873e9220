"""``--workers N`` over real processes: one port shared by N workers, one admin
port that sees them all, signals that reach every worker, a dead worker
restarted and its streams logged as ``worker_lost``.

Connections are spread over the workers by the kernel (SO_REUSEPORT hashes
each connection's addresses), so tests that need both workers open 20
connections: the chance that all land on one worker is 2 in a million.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from clients import ResponseReader, chat_body, connect, read_response, request_bytes, wait_for
from processes import SidecarProcess, spawn
from prometheus_client.parser import text_string_to_metric_families
from upstreams import FakeUpstream

pytestmark = pytest.mark.slow

_STREAMS = 20


def _admin(process: SidecarProcess, path: str, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{process.admin_port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())


def _json(process: SidecarProcess, path: str) -> Any:
    status, body = _admin(process, path)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture
def workers(upstream: FakeUpstream, tmp_path: Path) -> Iterator[tuple[SidecarProcess, Path]]:
    log = tmp_path / "streams.jsonl"
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--log-file", str(log),
                     "--drain-s", "5"], timeout_s=60)
    yield process, log
    assert process.stop() == 0


def _open_silent_streams(process: SidecarProcess, silence_s: float, prefix: str
                         ) -> dict[str, tuple[socket.socket, ResponseReader]]:
    opened = {}
    for i in range(_STREAMS):
        sock = connect(process.port)
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": str(silence_s),
                                            "X-Request-Id": f"{prefix}-{i}"}))
        reader = ResponseReader(sock)
        assert reader.read(head_only=True).status == 200
        opened[f"{prefix}-{i}"] = (sock, reader)
    return opened


def test_admin_port_lists_sums_and_cancels_across_workers(workers: tuple[SidecarProcess, Path]) -> None:
    process, _ = workers
    assert [w["alive"] for w in _json(process, "/workers")] == [True, True]
    for _ in range(6):
        with connect(process.port) as sock:
            sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
            assert read_response(sock).datas()[-1] == "[DONE]"
    opened = _open_silent_streams(process, 30, "held")
    streams = _json(process, "/streams")
    assert sorted(s["request_id"] for s in streams) == sorted(f"held-{i}" for i in range(_STREAMS))
    by_worker: dict[int, list[str]] = {}
    for entry in streams:
        by_worker.setdefault(entry["worker"], []).append(entry["request_id"])
    assert set(by_worker) == {0, 1}
    # /metrics: each worker's samples summed.
    _, metrics = _admin(process, "/metrics")
    samples = {(sample.name, sample.labels.get("reason")): sample.value
               for family in text_string_to_metric_families(metrics.decode())
               for sample in family.samples}
    assert samples[("tokenwire_streams_ended_total", "complete")] == 6
    assert samples[("tokenwire_active_streams", None)] == _STREAMS
    # DELETE finds the stream whichever worker holds it.
    for worker_streams in by_worker.values():
        status, _ = _admin(process, f"/streams/{worker_streams[0]}", method="DELETE")
        assert status == 200
    status, _ = _admin(process, "/streams/no-such-stream", method="DELETE")
    assert status == 404
    for worker_streams in by_worker.values():
        sock, reader = opened[worker_streams[0]]
        rest = reader.read()
        assert json.loads(rest.datas()[-1])["error"]["code"] == "cancelled"
    for sock, _ in opened.values():
        sock.close()


def test_admin_token_is_asked_by_the_supervisor_and_passed_to_the_workers(upstream: FakeUpstream) -> None:
    token = "s3cret-admin-token"
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--admin-token", token], timeout_s=60)
    try:
        for path in ("/streams", "/workers", "/metrics"):
            assert _admin(process, path)[0] == 401
        assert _admin(process, "/streams/x", method="DELETE")[0] == 401
        assert _admin(process, "/healthz")[0] == 200
        request = urllib.request.Request(f"http://127.0.0.1:{process.admin_port}/streams",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            # The workers asked for the token as well, and got it from the supervisor.
            assert response.status == 200 and json.loads(response.read()) == []
    finally:
        assert process.stop() == 0


def test_sigterm_drains_every_worker(upstream: FakeUpstream) -> None:
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--drain-s", "10"], timeout_s=60)
    opened = _open_silent_streams(process, 1.0, "drain")
    pids = [w["pid"] for w in _json(process, "/workers")]
    process.signal(signal.SIGTERM)
    for sock, reader in opened.values():
        finished = reader.read()
        assert finished.clean_end and finished.datas()[-1] == "[DONE]"
        sock.close()
    assert process.process.wait(20) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_dead_worker_is_restarted_and_its_streams_end_as_worker_lost(
        workers: tuple[SidecarProcess, Path]) -> None:
    process, log = workers
    opened = _open_silent_streams(process, 30, "lost")
    # The supervisor knows which worker holds which stream once it has polled them all.
    wait_for(lambda: sum(w["streams"] for w in _json(process, "/workers")) == _STREAMS, timeout_s=10)
    held = {entry["request_id"]: entry["worker"] for entry in _json(process, "/streams")}
    victim = _json(process, "/workers")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    lost = sorted(rid for rid, worker in held.items() if worker == victim["index"])
    assert lost

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    wait_for(lambda: sorted(r["request_id"] for r in records()
                            if r["end_reason"] == "worker_lost") == lost, timeout_s=10)
    wait_for(lambda: _json(process, "/workers")[0]["alive"]
             and _json(process, "/workers")[0]["restarts"] == 1, timeout_s=30)
    # The restarted worker serves: every new connection gets its answer.
    for _ in range(8):
        with connect(process.port) as sock:
            sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
            assert read_response(sock).datas()[-1] == "[DONE]"
    for sock, _ in opened.values():
        sock.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _cert_files(ca: trustme.CA, directory: Path) -> tuple[Path, Path]:
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    return cert_path, key_path


def _handshake(port: int, ca: trustme.CA) -> bool:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        with connect(port, ssl_context=context):
            return True
    except ssl.SSLError:
        return False


def test_sighup_reloads_tls_in_every_worker(upstream: FakeUpstream, ca: trustme.CA, tmp_path: Path) -> None:
    cert_path, key_path = _cert_files(ca, tmp_path)
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--tls-cert", str(cert_path),
                     "--tls-key", str(key_path)], timeout_s=60)
    try:
        assert all(_handshake(process.port, ca) for _ in range(_STREAMS))
        fresh = trustme.CA()
        _cert_files(fresh, tmp_path)
        process.signal(signal.SIGHUP)
        # Every connection, whichever worker takes it, ends up with the new certificate.
        wait_for(lambda: all(_handshake(process.port, fresh) for _ in range(_STREAMS)), timeout_s=10)
        assert not any(_handshake(process.port, ca) for _ in range(_STREAMS))
    finally:
        assert process.stop() == 0


def test_resume_with_the_memory_store_refuses_several_workers(upstream: FakeUpstream) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire.sidecar", "sidecar", "--listen", "127.0.0.1:0",
         "--upstream", upstream.url, "--resume", "--workers", "2"],
        capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "--resume-store" in result.stderr
    assert "workers" in result.stderr
