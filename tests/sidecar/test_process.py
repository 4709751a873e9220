"""The sidecar as a process: ready line, graceful SIGTERM drain, abort calls."""

from __future__ import annotations

import json
import signal
import time

import pytest
from clients import ResponseReader, chat_body, connect, read_response, request_bytes, reset, wait_for
from processes import spawn
from upstreams import FakeUpstream

pytestmark = pytest.mark.slow


def test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_shutdown(upstream: FakeUpstream) -> None:
    process = spawn(["--upstream", upstream.url, "--drain-s", "0.6", "--heartbeat-s", "0.2"])
    short = connect(process.port)
    short.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                headers={"x-fake-silence-s": "0.3"}))
    long = connect(process.port)
    long.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                               headers={"x-fake-silence-s": "30", "X-Request-Id": "long-1"}))
    short_reader, long_reader = ResponseReader(short), ResponseReader(long)
    assert short_reader.read(head_only=True).status == 200
    assert long_reader.read(head_only=True).status == 200
    started = time.monotonic()
    process.signal(signal.SIGTERM)
    time.sleep(0.1)
    with pytest.raises(ConnectionRefusedError):
        connect(process.port)  # no longer accepting
    finished = short_reader.read()
    assert finished.clean_end and finished.datas()[-1] == "[DONE]"
    ended = long_reader.read()
    assert not ended.clean_end
    assert json.loads(ended.datas()[-1])["error"]["code"] == "shutdown"
    assert 0.5 < time.monotonic() - started < 5
    assert upstream.connection_of("long-1").closed.wait(2)
    assert process.process.wait(10) == 0
    short.close()
    long.close()


def test_abort_url_is_called_when_a_client_leaves(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(abort_url=upstream.url + "/abort/{request_id}")
    sock = connect(sidecar.port)
    sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                               headers={"x-fake-silence-s": "30", "X-Request-Id": "abort-me"}))
    assert read_response(sock, head_only=True).status == 200
    # The call names the id the engine was sent, the sidecar's own (never the client's).
    upstream_id = upstream.requests_with("abort-me")[-1].headers["x-request-id"]
    reset(sock)
    wait_for(lambda: any(r.path == f"/abort/{upstream_id}" for r in upstream.requests))
    assert upstream.connection_of("abort-me").closed.wait(2)


def test_unix_socket_upstream(start_sidecar, loop_thread, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeUpstream()
    path = str(tmp_path / "engine.sock")

    async def start_unix() -> None:
        import asyncio

        fake._server = await asyncio.start_unix_server(fake._serve, path)

    loop_thread.run(start_unix())
    try:
        sidecar = start_sidecar(f"unix:{path}")
        with connect(sidecar.port) as sock:
            sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
            response = read_response(sock)
        assert response.clean_end and response.datas()[-1] == "[DONE]"
    finally:
        loop_thread.run(fake.stop())
