"""Clients that read slowly, stop reading, or reset: the upstream must not pay for them."""

from __future__ import annotations

import json
import time

from clients import chat_body, connect, read_response, request_bytes, reset, wait_for
from upstreams import FakeUpstream, expected_text

from tokenwire.tools.sse_client import parse_response


def _text(datas: list[str]) -> str:
    text = []
    for data in datas:
        if data != "[DONE]":
            choices = json.loads(data)["choices"]
            if choices:
                text.append(choices[0]["delta"].get("content") or "")
    return "".join(text)


def test_slow_reader_gets_exact_text_coalesced_with_bounded_memory(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(socket_send_buffer_bytes=8192, write_high_water_bytes=8192)
    tokens = 3000
    with connect(sidecar.port, receive_buffer_bytes=4096) as sock:
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-tokens": str(tokens), "X-Request-Id": "slow-1"}))
        body = bytearray()
        started = time.monotonic()
        while True:
            data = sock.recv(4096)
            if not data:
                break
            body += data
            if body.endswith(b"0\r\n\r\n"):
                break
            time.sleep(0.01)  # ~400 KB/s at best, far below what the upstream sends
        read_s = time.monotonic() - started
    response = parse_response(bytes(body))
    assert response.datas()[-1] == "[DONE]"
    assert _text(response.datas()) == expected_text(tokens)
    record = sidecar.record("slow-1")
    assert record.end_reason == "complete"
    assert record.coalesced_events > 0
    assert record.events_out < record.events_in
    assert record.pending_high_water_bytes <= sidecar.sidecar.config.wire.max_pending_bytes
    request = upstream.requests_with("slow-1")[0]
    assert request.finished_at is not None
    # The upstream ran at its own speed, not the reader's.
    assert request.finished_at - started < read_s


def test_client_that_stops_reading_hits_the_write_deadline_and_the_upstream_is_closed(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(write_deadline_s=0.4, socket_send_buffer_bytes=4096, write_high_water_bytes=4096)
    with connect(sidecar.port, receive_buffer_bytes=4096) as sock:
        # The upstream would take 50 s to finish: a close within the bound below is the abort
        # (the bound is generous: on a loaded machine, in a long run, the cut came after 10 s).
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-tokens": "100000", "x-fake-delay-s": "0.0005",
                                            "X-Request-Id": "stalled-1"}))
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        wait_for(lambda: bool(upstream.requests_with("stalled-1")))
        connection = upstream.connection_of("stalled-1")
        assert connection.closed.wait(30), "the upstream was never aborted"
    assert connection.peer_closed_at is not None
    record = sidecar.record("stalled-1")
    assert record.end_reason == "slow_client"
    assert record.error_code == "send_timeout"
    assert upstream.requests_with("stalled-1")[0].finished_at is None


def test_client_reset_mid_stream_closes_the_upstream_at_once(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    sock = connect(sidecar.port)
    sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                               headers={"x-fake-silence-s": "30", "X-Request-Id": "reset-1"}))
    head = read_response(sock, head_only=True)
    assert head.status == 200
    wait_for(lambda: bool(upstream.requests_with("reset-1")))
    connection = upstream.connection_of("reset-1")
    reset_at = time.monotonic()
    reset(sock)
    assert connection.closed.wait(2)
    assert connection.peer_closed_at is not None
    assert connection.peer_closed_at - reset_at < 0.5
    record = sidecar.record("reset-1")
    assert record.end_reason == "client_gone"


def test_client_gone_before_any_upstream_byte_aborts_the_upstream(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(commit_deadline_s=30.0)
    sock = connect(sidecar.port)
    sock.sendall(request_bytes("POST", "/noheaders/v1/chat/completions", body=chat_body(),
                               headers={"X-Request-Id": "gone-early"}))
    wait_for(lambda: bool(upstream.requests_with("gone-early")))
    sock.close()
    assert upstream.connection_of("gone-early").closed.wait(2)
    assert sidecar.record("gone-early").end_reason == "client_gone"
