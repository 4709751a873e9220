"""``tokenwire drain``, the Kubernetes side of the hand-off: the engine's preStop
asks the sidecar to drain (``POST /drain``) and waits until no stream is open,
so the engine is still there to finish (or, with a shared store, to go on
generating into the store for) the streams the drain hands off; the sidecar
stays up, draining, until its own SIGTERM, which then has nothing to wait for."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from clients import chat_body
from conftest import LoopThread, make_config
from processes import spawn
from resume_client import request_bytes
from test_resume import PATH, text_of
from tokenwire.middleware import SSEEvent
from tokenwire.sidecar.process.server import Sidecar
from upstreams import FakeUpstream, expected_text

from tokenwire.tools.sse_client import SSEResponse, read_response

SECRET = "replicas-share-this"


def _drain_command(admin_port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tokenwire.sidecar", "drain", "--admin", f"127.0.0.1:{admin_port}", *flags]


def _admin(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _stream(port: int, request_id: str, tokens: int, *, stop: object = None) -> SSEResponse:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_bytes("POST", PATH, body=chat_body(), headers={
            "x-request-id": request_id, "x-fake-tokens": str(tokens), "x-fake-delay-s": "0.01"}))
        return read_response(sock, timeout_s=20, stop=stop)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_drain_command_hands_a_stream_off_and_the_sidecar_stays_up_until_sigterm(
        loop_thread: LoopThread, upstream: FakeUpstream, redis_url: str) -> None:
    def sidecar() -> Sidecar:
        running = Sidecar(make_config(upstream.url, resume=True, resume_store=redis_url,
                                      resume_owner_secret=SECRET, drain_s=15.0))
        loop_thread.run(running.start())
        return running

    first, second = sidecar(), sidecar()
    stopped = False
    try:
        admin_port = first.admin_address[1] if first.admin_address else 0
        tokens = 150
        commands: list[subprocess.Popen[str]] = []

        def drain_after_five(response: SSEResponse, event: SSEEvent) -> bool:
            if len(response.data_events) == 5 and not commands:
                commands.append(subprocess.Popen(_drain_command(admin_port, "--wait-s", "15"),
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            return False

        proxy_port = first.address[1]
        part = _stream(proxy_port, "drained-1", tokens, stop=drain_after_five)
        # Handed off: cut without its terminal event, no in-band error.
        assert part.status == 200 and not part.clean_end and commands
        assert part.data_events[-1].data != "[DONE]" and "error" not in (part.data_events[-1].data or "")
        with socket.create_connection(second.address, timeout=10) as sock:
            sock.sendall(request_bytes("GET", f"/v1/streams/{part.stream_id}", headers={
                "Accept": "text/event-stream", "Last-Event-ID": part.data_events[-1].id or ""}))
            rest = read_response(sock, timeout_s=20)
        assert rest.status == 200 and rest.clean_end
        events = part.data_events + rest.data_events
        assert [e.id for e in events] == [f"{part.stream_id}.{n}" for n in range(1, tokens + 5)]
        assert text_of(events) == expected_text(tokens)
        assert len(upstream.requests_with("drained-1")) == 1  # generated once, by the drained one

        out, err = commands[0].communicate(timeout=30)
        assert commands[0].returncode == 0, err
        assert "draining 127.0.0.1:" in out and "drained in" in out, out
        # Up and draining: the probes answer, the proxy port takes no one.
        assert _admin(admin_port, "/healthz")[0] == 200
        assert _admin(admin_port, "/readyz") == (503, {"status": "draining"})
        assert _admin(admin_port, "/drain") == (200, {"draining": True, "open_streams": 0})
        assert _refused(proxy_port)
        began = time.monotonic()
        loop_thread.run(first.shutdown())
        stopped = True
        assert time.monotonic() - began < 2.0  # SIGTERM's shutdown finds nothing left to drain
    finally:
        if not stopped:
            loop_thread.run(first.shutdown())
        loop_thread.run(second.shutdown())


@pytest.mark.slow
def test_drain_under_workers_waits_for_every_workers_streams(upstream: FakeUpstream) -> None:
    sidecar = spawn(["--workers", "2", "--upstream", upstream.url, "--drain-s", "30"])
    try:
        assert sidecar.admin_port is not None
        first_events = threading.Barrier(5)
        answers: list[SSEResponse] = []

        def client(number: int) -> None:
            def first(response: SSEResponse, event: SSEEvent) -> bool:
                if len(response.data_events) == 1:
                    first_events.wait(15)
                return False
            answers.append(_stream(sidecar.port, f"workers-drain-{number}", 80, stop=first))

        clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in clients:
            thread.start()
        first_events.wait(15)  # four streams open, on either worker
        done = subprocess.run(_drain_command(sidecar.admin_port, "--wait-s", "30"),
                              capture_output=True, text=True, timeout=60)
        for thread in clients:
            thread.join(30)
        # No shared store: the plain drain, every answer whole, and the command
        # returned only once none was open.
        assert len(answers) == 4 and all(a.clean_end and a.data_events[-1].data == "[DONE]"
                                         for a in answers)
        assert all(text_of(a.data_events) == expected_text(80) for a in answers)
        assert done.returncode == 0 and "draining" in done.stdout and "drained in" in done.stdout, done
        assert _admin(sidecar.admin_port, "/drain") == (200, {"draining": True, "open_streams": 0})
        assert sidecar.process.poll() is None  # still up: Kubernetes sends the SIGTERM
        began = time.monotonic()
        assert sidecar.stop() == 0
        assert time.monotonic() - began < 5.0
    finally:
        sidecar.stop()


def test_drain_says_why_it_could_not_ask(loop_thread: LoopThread, upstream: FakeUpstream,
                                         tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    nobody = subprocess.run(_drain_command(closed_port), capture_output=True, text=True, timeout=30)
    assert nobody.returncode == 2 and "cannot reach the admin port" in nobody.stderr

    guarded = Sidecar(make_config(upstream.url, admin_token="s3cret-admin-token"))
    loop_thread.run(guarded.start())
    try:
        admin_port = guarded.admin_address[1] if guarded.admin_address else 0
        refused = subprocess.run(_drain_command(admin_port), capture_output=True, text=True, timeout=30)
        assert refused.returncode == 2 and "refused the token" in refused.stderr
        assert _admin(admin_port, "/readyz")[0] == 200  # not drained by a refused request
        (tmp_path / "token").write_text("s3cret-admin-token\n")
        allowed = subprocess.run(_drain_command(admin_port, "--token-file", str(tmp_path / "token")),
                                 capture_output=True, text=True, timeout=30)
        assert allowed.returncode == 0 and "0 open streams" in allowed.stdout, allowed
        assert _admin(admin_port, "/readyz") == (503, {"status": "draining"})
        missing = subprocess.run(_drain_command(admin_port, "--token-file", str(tmp_path / "none")),
                                 capture_output=True, text=True, timeout=30)
        assert missing.returncode == 2 and "cannot read the token file" in missing.stderr
    finally:
        loop_thread.run(guarded.shutdown())
