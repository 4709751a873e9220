"""The engine's probes: ``/healthz`` (alive) answers from the moment its socket
exists, ``/readyz`` is 503 while the model loads and 200 once it serves
(``engine/loading.py``, then the app's routes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenwire.engine.loading import LoadingServer, bind_unix, loading_answer


def _status_and_body(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_while_loading_healthz_is_200_readyz_and_health_503_and_the_api_503_with_retry_after() -> None:
    assert _status_and_body(loading_answer(b"GET /healthz HTTP/1.1\r\n\r\n")) == (200, {"status": "ok"})
    for path in (b"/readyz", b"/health", b"/readyz?verbose=1"):
        answer = loading_answer(b"GET " + path + b" HTTP/1.1\r\n\r\n")
        assert _status_and_body(answer) == (503, {"status": "loading"})
    answer = loading_answer(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
    status, body = _status_and_body(answer)
    assert status == 503 and b"\r\nretry-after: 1\r\n" in answer
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "upstream_unavailable"


def _ask(address: str | tuple[str, int], path: str, timeout_s: float = 5.0) -> tuple[int, dict[str, object]]:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family) as conn:
        conn.settimeout(timeout_s)
        conn.connect(address)
        conn.sendall(f"GET {path} HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n".encode())
        answer = b""
        while data := conn.recv(65536):
            answer += data
    return _status_and_body(answer)


def test_the_loading_server_answers_on_the_socket_and_hands_it_over_without_a_refused_connect(
        tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    sock = bind_unix(path)
    try:
        server = LoadingServer(sock).start()
        assert _ask(path, "/healthz") == (200, {"status": "ok"})
        assert _ask(path, "/readyz") == (503, {"status": "loading"})
        server.stop()
        # After the handover a connection waits in the backlog for whoever serves next.
        with socket.socket(socket.AF_UNIX) as late:
            late.connect(path)
            late.sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
            sock.setblocking(True)
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.recv(64).startswith(b"GET /readyz")
    finally:
        sock.close()


def test_bind_unix_replaces_a_stale_socket_and_refuses_to_replace_a_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    stale = bind_unix(str(path))
    stale.close()  # the file stays, as after a crash
    bind_unix(str(path)).close()
    other = tmp_path / "notes.txt"
    other.write_text("not a socket")
    with pytest.raises(FileExistsError):
        bind_unix(str(other))
    assert other.read_text() == "not a socket"


@pytest.mark.slow
def test_a_real_engine_is_alive_and_not_ready_while_it_loads_then_ready(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    engine = subprocess.Popen(
        [sys.executable, "-m", "tokenwire.engine.server", "--model", str(tiny_model_dir),
         "--listen", f"unix:{path}", "--device", "cpu", "--served-model-name", "tiny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen: list[tuple[int, int]] = []  # (healthz, readyz) while polling
        socket_at = ready_at = None
        deadline = time.monotonic() + 180
        while ready_at is None:
            assert engine.poll() is None, engine.stderr.read() if engine.stderr else b""
            assert time.monotonic() < deadline, f"not ready in 180 s: {seen[-3:]}"
            try:
                health, ready = _ask(path, "/healthz")[0], _ask(path, "/readyz")[0]
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.01)
                continue
            socket_at = socket_at or time.monotonic()
            seen.append((health, ready))
            if ready == 200:
                ready_at = time.monotonic()
            time.sleep(0.02)
        print(f"\n[readiness] engine socket -> readyz 200: {ready_at - socket_at:.1f} s "
              f"({len(seen)} polls)")
        # The socket answers before the model is loaded (torch alone takes seconds to import).
        assert seen[0] == (200, 503), seen[:3]
        assert all(health == 200 for health, _ in seen)
        assert {ready for _, ready in seen} == {503, 200}
        assert _ask(path, "/readyz") == (200, {"status": "ready"})
        assert _ask(path, "/healthz")[0] == 200
    finally:
        engine.terminate()
        engine.wait(30)
    assert engine.stderr is not None
    assert b"Uvicorn running on socket" in engine.stderr.read()
