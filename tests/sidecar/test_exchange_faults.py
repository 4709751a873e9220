"""The review's second pass, over real sockets: retries that could double a
generation, a hung engine, many large uploads at once, forwarding headers.

(The wire rules behind the first two are tested with injected time in
tests/middleware/test_stream.py; here they are shown to hold end to end.)
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from clients import (
    StreamWatcher,
    chat_body,
    connect,
    exchange,
    read_response,
    sse_datas,
    wait_for,
)
from conftest import LoopThread, RunningSidecar
from upstreams import FakeUpstream, ScriptedUpstream

StartSidecar = Callable[..., RunningSidecar]


async def _read_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The request was read whole (the engine may be generating); the connection drops."""
    writer.transport.abort()


async def _read_then_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    writer.close()


# ------------------------------------------------------------------ retries


@pytest.mark.parametrize("answer", [_read_then_hang_up, _read_then_garbage], ids=["hang-up", "garbage"])
@pytest.mark.parametrize(("method", "headers", "sent"), [
    ("POST", {}, 1),  # a second send could be a second generation
    ("POST", {"Idempotency-Key": "k-1"}, 3),  # the client said a repeat is safe
    ("GET", {}, 3),  # idempotent by method
], ids=["post", "post-with-idempotency-key", "get"])
def test_retries_when_upstream_read_the_request_then_failed_then_repeated_only_if_safe(
        start_sidecar: StartSidecar, recorder: ScriptedUpstream, answer: object, method: str,
        headers: dict[str, str], sent: int) -> None:
    recorder.respond = answer  # type: ignore[assignment]
    sidecar = start_sidecar(recorder.url, retry_attempts=2, retry_backoff_s=0.0)
    response = exchange(sidecar.port, method, "/v1/chat/completions", headers=headers,
                        body=chat_body() if method == "POST" else b"")
    assert response.status == 502
    assert bytes(recorder.received).count(f"{method} /v1/chat/completions HTTP/1.1".encode()) == sent


def test_retries_when_upstream_answers_503_then_post_is_retried(
        start_sidecar: StartSidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(retry_attempts=2, retry_backoff_s=0.0)
    response = exchange(sidecar.port, "POST", "/status503/v1/chat/completions", body=chat_body(),
                        headers={"x-request-id": "r503", "x-fake-fail-first": "1"})
    assert response.status == 200
    assert len(upstream.requests_with("r503")) == 2


def test_retries_when_connection_refused_then_post_goes_to_the_next_upstream(
        start_sidecar: StartSidecar, upstream: FakeUpstream) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
        sidecar = start_sidecar([dead, upstream.url], retry_attempts=1, retry_backoff_s=0.0)
        response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                            headers={"x-request-id": "refused-next-1"})
    assert response.status == 200
    assert len(upstream.requests_with("refused-next-1")) == 1


# ------------------------------------------------------------------ a hung upstream


def test_hung_upstream_when_silent_after_first_event_then_in_band_timeout_and_upstream_closed(
        start_sidecar: StartSidecar, upstream: FakeUpstream) -> None:
    # Heartbeats every 50 ms keep the client's connection busy: they must not hide the hang.
    sidecar = start_sidecar(upstream_idle_timeout_s=0.5, heartbeat_s=0.05)
    response = exchange(sidecar.port, "POST", "/silent/v1/chat/completions", body=chat_body(),
                        headers={"x-request-id": "hung-1", "x-fake-silence-s": "3600"}, timeout_s=30.0)
    assert response.status == 200 and not response.clean_end
    assert b": keepalive" in response.body
    assert '"upstream_timeout"' in sse_datas(response.body)[-1]
    record = sidecar.record("hung-1", timeout_s=30.0)
    assert record.end_reason == "upstream_timeout"
    assert upstream.connection_of("hung-1").closed.wait(30.0), "the hung upstream was left open"


def test_max_stream_duration_when_reached_then_in_band_timeout_and_upstream_closed(
        start_sidecar: StartSidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(max_stream_duration_s=0.5)
    response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                        headers={"x-request-id": "long-1", "x-fake-tokens": "100000",
                                 "x-fake-delay-s": "0.01"}, timeout_s=30.0)
    datas = sse_datas(response.body)
    assert len(datas) > 2 and '"upstream_timeout"' in datas[-1]
    assert sidecar.record("long-1", timeout_s=30.0).end_reason == "upstream_timeout"
    assert upstream.connection_of("long-1").closed.wait(30.0)


# ------------------------------------------------------------------ many bodies at once


def _start_upload(port: int, size: int) -> tuple[socket.socket, int]:
    """Send a head that announces ``size`` bytes; the interim status it gets (100 or a refusal)."""
    sock = connect(port, timeout_s=30.0)
    sock.sendall(b"POST /models/v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Length: %d\r\n\r\n" % size)
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        assert data, "closed before any answer"
        head += data
    return sock, int(head.split(b" ", 2)[1])


def test_bodies_when_buffered_bytes_would_pass_the_cap_then_503_until_they_are_released(
        start_sidecar: StartSidecar) -> None:
    sidecar = start_sidecar(max_buffered_body_bytes=1_000_000)
    held, status = _start_upload(sidecar.port, 800_000)
    assert status == 100
    held.sendall(b"x" * 400_000)  # half of it: still being received, still counted
    refused = exchange(sidecar.port, "POST", "/models/v1/models", body=b"y" * 300_000)
    assert refused.status == 503 and refused.headers["retry-after"] == "1"
    assert "request bodies" in refused.json()["error"]["message"]
    small = exchange(sidecar.port, "POST", "/models/v1/models", body=b"z" * 100_000)
    assert small.status == 200  # what fits under the cap still goes through
    held.sendall(b"x" * 400_000)
    assert read_response(held).status == 200
    held.close()
    # Released when the answer ended: the same body is welcome now.
    wait_for(lambda: exchange(sidecar.port, "POST", "/models/v1/models", body=b"y" * 300_000).status == 200)


def test_bodies_when_chunked_body_grows_past_the_cap_then_503(start_sidecar: StartSidecar) -> None:
    sidecar = start_sidecar(max_buffered_body_bytes=1_000_000)
    held, status = _start_upload(sidecar.port, 900_000)
    assert status == 100
    with connect(sidecar.port, timeout_s=30.0) as sock:
        sock.sendall(b"POST /models/v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(10):
                sock.sendall(b"10000\r\n" + b"c" * 0x10000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while still sending
        assert read_response(sock).status == 503
    held.close()


# Uploads from another process: client threads in the test's own process would
# fight the sidecar's loop for the GIL, and their stall would be counted as its.
_UPLOADER = """
import json, socket, sys, threading
port, size, count = map(int, sys.argv[1:])
statuses = []

def upload():
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    with sock:
        sock.sendall(b"POST /models/v1/models HTTP/1.1\\r\\nHost: x\\r\\nExpect: 100-continue\\r\\n"
                     b"Content-Length: %d\\r\\n\\r\\n" % size)
        head = b""
        while b"\\r\\n\\r\\n" not in head:
            head += sock.recv(4096)
        status = int(head.split(b" ", 2)[1])
        if status == 100:
            piece = b"u" * (1 << 20)
            for _ in range(size >> 20):
                sock.sendall(piece)
            answer = head.partition(b"\\r\\n\\r\\n")[2]
            while answer.count(b" ") < 2:
                answer += sock.recv(4096)
            status = int(answer.split(b" ", 2)[1])
        statuses.append(status)

threads = [threading.Thread(target=upload) for _ in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(statuses))
"""


def _uploads(port: int, size: int, count: int) -> list[int]:
    """``count`` uploads of ``size`` bytes at once (each after its 100 Continue); their statuses."""
    done = subprocess.run([sys.executable, "-c", _UPLOADER, str(port), str(size), str(count)],
                          capture_output=True, text=True, timeout=300, check=True)
    return list(json.loads(done.stdout))


@pytest.fixture
def engine_apart() -> Iterator[FakeUpstream]:
    """The fake engine on its own event loop, as a real one is its own process:
    its work on 15 MiB bodies (reading, scanning) must not count as the sidecar's."""
    thread = LoopThread()
    fake = FakeUpstream()
    thread.run(fake.start())
    yield fake
    thread.run(fake.stop())
    thread.close()


@pytest.mark.slow
def test_bodies_when_many_large_uploads_at_once_then_cap_refuses_some_and_bystander_keeps_flowing(
        start_sidecar: StartSidecar, engine_apart: FakeUpstream) -> None:
    """8 x 15 MiB against the default 64 MiB cap (the 32-upload figure is bench/body_bench.py's).

    The bystander's bound is 0.25 s, or, on a machine too busy for that, three
    times what one such upload took on its own (measured first, in the same
    harness): eight uploads' work must not pile up into one stall. On a quiet
    box one upload takes about 0.1 s; with the test's process sharing two cores
    with others it took 0.3-0.9 s, and the bystander's longest gap was 1-1.7
    times that. bench/body_bench.py measures the sidecar alone, in its own
    process."""
    sidecar = start_sidecar(engine_apart.url, max_body_bytes=16 << 20)
    size = 15 << 20
    started = time.monotonic()
    assert _uploads(sidecar.port, size, 1) == [200]
    one_upload_s = time.monotonic() - started
    watcher = StreamWatcher(sidecar.port)
    watcher.start()
    assert watcher.first_event.wait(10)
    statuses = _uploads(sidecar.port, size, 8)
    gap_s = watcher.stop()
    assert sorted(set(statuses)) == [200, 503], statuses
    assert statuses.count(200) >= 4  # 4 fit in 64 MiB at once; later ones may follow
    bound_s = max(0.25, 3 * one_upload_s)
    assert gap_s < bound_s, f"the bystander stalled {gap_s:.3f} s (one upload alone: {one_upload_s:.3f} s)"


# ------------------------------------------------------------------ forwarding headers


def test_forwarding_when_client_sends_its_own_forwarding_headers_then_replaced_as_nginx_does(
        start_sidecar: StartSidecar) -> None:
    sidecar = start_sidecar()
    raw = (b"GET /echo/ HTTP/1.1\r\nHost: api.example:8443\r\n"
           b"X-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2, 10.0.0.3\r\n"
           b"Forwarded: for=6.6.6.6;proto=https\r\nX-Real-IP: 6.6.6.6\r\n"
           b"X-Forwarded-Host: evil.example\r\nX-Forwarded-Port: 1\r\nX-Forwarded-Proto: https\r\n"
           b"X-SSL-Client-Verify: SUCCESS\r\nClient-Cert: :AAAA:\r\nX-Forwarded-Client-Cert: Hash=1\r\n"
           b"X_Tenant: admin\r\nX-Tenant: user\r\n\r\n")
    with connect(sidecar.port) as sock:
        sock.sendall(raw)
        headers = read_response(sock).json()["headers"]
    assert headers["x-forwarded-for"] == "10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.1"
    assert headers["x-real-ip"] == "127.0.0.1"
    assert headers["x-forwarded-host"] == "api.example:8443"
    assert headers["x-forwarded-port"] == str(sidecar.port)
    assert headers["x-forwarded-proto"] == "http"
    assert headers["forwarded"] == 'for=127.0.0.1;host="api.example:8443";proto=http'
    for spoofable in ("x-ssl-client-verify", "client-cert", "x-forwarded-client-cert", "x_tenant"):
        assert spoofable not in headers, spoofable
    assert headers["x-tenant"] == "user"


def test_forwarding_when_underscore_headers_allowed_then_forwarded(start_sidecar: StartSidecar) -> None:
    sidecar = start_sidecar(drop_underscore_headers=False)
    response = exchange(sidecar.port, "GET", "/echo/", headers={"X_Tenant": "a"})
    assert response.json()["headers"]["x_tenant"] == "a"
