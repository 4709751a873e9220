"""HTTP/2 on the proxy port: prior knowledge and ALPN, the same answers as over
HTTP/1.1, flow control as backpressure, how streams end, resets and GOAWAY.

Real clients on 127.0.0.1: httpx with ``http2=True`` and a raw h2 client
(h2client.py) for what a polite client never does.
"""

from __future__ import annotations

import itertools
import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from clients import sse_datas, tls_client_context, tls_server_files, wait_for
from conftest import LoopThread, RecordingLog, RunningSidecar, make_config
from h2client import H2Client, chat_headers
from tokenwire.sidecar import Sidecar
from tokenwire.sidecar.downstream.http2_request import RequestHead
from tokenwire.sidecar.downstream.http2_stream import Http2Stream, StreamHandler
from upstreams import FakeUpstream, expected_text

CHAT = b'{"model":"m","stream":true,"messages":[]}'
CHAT_PATH = "/normal/v1/chat/completions"


def _text(body: bytes) -> str:
    """The generated text of an OpenAI SSE body."""
    text = ""
    for data in sse_datas(body):
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(tmp_path: Path, ca: trustme.CA) -> dict[str, str]:
    return tls_server_files(ca, tmp_path)


def test_http2_when_prior_knowledge_then_same_body_as_http11_and_record_says_version(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    bodies = {}
    for http2 in (False, True):
        with httpx.Client(http1=not http2, http2=http2, base_url=sidecar.url) as client:
            response = client.post(CHAT_PATH, content=CHAT, headers={
                "x-fake-tokens": "7", "content-type": "application/json",
                "x-request-id": f"same-{http2}"})
        assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == f"same-{http2}"
        bodies[http2] = response.content
    assert _text(bodies[True]) == _text(bodies[False]) == expected_text(7)
    assert bodies[True].replace(b"same-True", b"") == bodies[False].replace(b"same-False", b"")
    sidecar.record("same-True")
    assert sidecar.log.extras["same-True"]["http_version"] == "2"
    assert sidecar.log.extras["same-False"]["http_version"] == "1.1"
    metrics = httpx.get(sidecar.admin_url + "/metrics").text
    assert 'tokenwire_client_requests_total{protocol="h2"} 1.0' in metrics
    assert 'tokenwire_client_requests_total{protocol="http/1.1"} 1.0' in metrics


def test_http2_when_tls_then_alpn_picks_h2_or_http11(start_sidecar: Callable[..., RunningSidecar],
                                               ca: trustme.CA, tls_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=tls_files["tls_cert"], tls_key=tls_files["tls_key"])
    for http2, version in ((True, "HTTP/2"), (False, "HTTP/1.1")):
        with httpx.Client(http2=http2, verify=tls_client_context(ca),
                          base_url=f"https://localhost:{sidecar.port}") as client:
            response = client.post(CHAT_PATH, content=CHAT, headers={"x-fake-tokens": "3"})
        assert response.http_version == version
        assert _text(response.content) == expected_text(3)


def test_http2_when_http2_off_then_tls_offers_only_http11(start_sidecar: Callable[..., RunningSidecar],
                                                    ca: trustme.CA, tls_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=tls_files["tls_cert"], tls_key=tls_files["tls_key"], http2=False)
    with httpx.Client(http2=True, verify=tls_client_context(ca),
                      base_url=f"https://localhost:{sidecar.port}") as client:
        assert client.get("/models/v1/models").http_version == "HTTP/1.1"


def test_http2_when_twenty_streams_on_one_connection_then_all_flow_at_once(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """Over HTTP/1.1 a browser's seventh stream waits; here 20 share one connection."""
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        ids = [client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(20, 0.05))
               for _ in range(20)]
        # Every stream has its first event before any could have finished (20 x 50 ms).
        assert client.read_until(lambda: all(client.streams[i].first_data_at for i in ids), 10)
        firsts = [client.streams[i].first_data_at or 0.0 for i in ids]
        assert not any(client.streams[i].ended for i in ids)
        assert max(firsts) - min(firsts) < 0.5
        for stream_id in ids:
            state = client.response(stream_id)
            assert state.ended and state.status == 200
            assert _text(bytes(state.body)) == expected_text(20)


def test_http2_when_stream_finishes_then_end_stream_when_upstream_dies_then_error_trailers(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    """A finished answer ends with END_STREAM; one cut after its first byte gets
    its in-band error event, then trailers naming the error on END_STREAM
    (test_http2_error_ending.py: why not RST_STREAM)."""
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        good = client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(3))
        dead = client.request("/die/v1/chat/completions", method="POST", body=CHAT,
                              headers=chat_headers(5))
        finished, died = client.response(good), client.response(dead)
    assert finished.ended and finished.reset_code is None and finished.trailers == []
    assert died.ended and died.reset_code is None
    assert dict(died.trailers) == {b"tokenwire-error-code": b"upstream_failed",
                                   b"tokenwire-error-number": b"E7307"}
    events = sse_datas(bytes(died.body))
    assert json.loads(events[-1])["error"]["code"] == "upstream_failed"


def test_http2_when_client_resets_stream_then_its_upstream_is_aborted_and_others_go_on(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        cancelled = client.request(CHAT_PATH, method="POST", body=CHAT,
                                   headers=[*chat_headers(100, 0.05), (b"x-request-id", b"h2-cancel")])
        other = client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(10, 0.05))
        assert client.read_until(lambda: client.streams[cancelled].first_data_at is not None)
        wait_for(lambda: upstream.requests_with("h2-cancel"))
        reset_at = time.monotonic()
        client.reset(cancelled)
        connection = upstream.connection_of("h2-cancel")
        assert connection.closed.wait(5)
        assert connection.peer_closed_at is not None and connection.peer_closed_at - reset_at < 1.0
        state = client.response(other)
        assert state.ended and _text(bytes(state.body)) == expected_text(10)
    assert sidecar.record("h2-cancel").end_reason.value == "client_gone"


def test_http2_when_client_never_opens_its_window_then_others_flow_and_write_deadline_ends_it(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """The zero-window hold: a stream whose window stays shut is paused for the
    core (its events coalesce) and ends at ``write_deadline_s``; its neighbours
    on the same connection are not held up."""
    sidecar = start_sidecar(write_deadline_s=1.0, heartbeat_s=0.0)
    # Initial stream window 16 bytes: the first event cannot go out whole.
    with H2Client(sidecar.port, settings={4: 16}) as client:
        stuck = client.request(CHAT_PATH, method="POST", body=CHAT,
                               headers=[*chat_headers(1000, 0.01), (b"x-request-id", b"h2-stuck")])
        flowing = client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(30, 0.02))
        client.credits = lambda stream_id: stream_id != stuck
        client.conn.increment_flow_control_window(1 << 20, stream_id=flowing)
        client.flush()
        started = time.monotonic()
        state = client.response(flowing)
        gaps = [b - a for a, b in itertools.pairwise(state.data_times)]
        assert state.ended and _text(bytes(state.body)) == expected_text(30)
        assert max(gaps) < 0.5
        assert client.read_until(lambda: client.streams[stuck].reset_code is not None, 10)
        assert client.streams[stuck].reset_code == 2  # INTERNAL_ERROR: never a clean end
        assert time.monotonic() - started >= 0.9
        assert len(client.streams[stuck].body) <= 16
    record = sidecar.record("h2-stuck")
    assert record.end_reason.value in ("slow_client", "client_gone")
    assert upstream.connection_of("h2-stuck").closed.wait(5)


def test_http2_when_client_sends_goaway_then_its_streams_end_and_upstreams_abort(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        client.request(CHAT_PATH, method="POST", body=CHAT,
                       headers=[*chat_headers(100, 0.05), (b"x-request-id", b"h2-goaway")])
        wait_for(lambda: upstream.requests_with("h2-goaway"))
        client.conn.close_connection()
        client.flush()
        assert upstream.connection_of("h2-goaway").closed.wait(5)
    assert sidecar.record("h2-goaway").end_reason.value == "client_gone"


def test_http2_when_shutdown_then_goaway_with_last_stream_and_open_streams_finish(
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread) -> None:
    sidecar = start_sidecar(drain_s=10.0)
    with H2Client(sidecar.port) as client:
        open_id = client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(10, 0.05))
        assert client.read_until(lambda: client.streams[open_id].first_data_at is not None)
        loop_thread.loop.call_soon_threadsafe(
            lambda: loop_thread.loop.create_task(sidecar.sidecar.shutdown()))
        # GOAWAY (NO_ERROR) names the open stream as the last one served.
        assert client.read_until(lambda: client.goaway is not None, 5)
        assert client.goaway is not None and client.goaway.last_stream_id == open_id
        assert client.goaway.error_code == 0
        state = client.response(open_id)
        assert state.ended and _text(bytes(state.body)) == expected_text(10)
        assert client.read_until(lambda: client.closed, 5)


def test_http2_when_cors_origin_then_preflight_answered_and_headers_added(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(cors_allow_origins=("https://app.example",))
    origin = (b"origin", b"https://app.example")
    with H2Client(sidecar.port) as client:
        preflight = client.request("/normal/v1/chat/completions", method="OPTIONS", headers=[
            origin, (b"access-control-request-method", b"POST")])
        answer = client.response(preflight)
        assert answer.status == 204 and answer.ended
        plain = client.response(client.request("/models/v1/models", headers=[origin]))
        assert dict(plain.headers)[b"access-control-allow-origin"] == b"https://app.example"


def test_http2_when_request_body_then_forwarded_whole_with_authority_as_host(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    body = b"x" * 300_000  # beyond the default 64 KiB window: the sidecar credits as it reads
    with httpx.Client(http1=False, http2=True, base_url=sidecar.url) as client:
        echoed: dict[str, Any] = client.post("/echo/v1/x", content=body,
                                             headers={"cookie": "a=1", "x-a": "b"}).json()
    assert echoed["body"] == body.decode()
    assert echoed["headers"]["x-forwarded-host"] == f"{sidecar.host}:{sidecar.port}"  # from :authority
    assert echoed["headers"]["content-length"] == str(len(body))
    assert echoed["headers"]["cookie"] == "a=1"


def test_http2_when_tls_client_resets_then_same_abort_path(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, ca: trustme.CA,
        tls_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=tls_files["tls_cert"], tls_key=tls_files["tls_key"])
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with H2Client(sidecar.port, tls=context) as client:
        stream = client.request(CHAT_PATH, method="POST", body=CHAT,
                                headers=[*chat_headers(100, 0.05), (b"x-request-id", b"h2-tls-cancel")])
        assert client.read_until(lambda: client.streams[stream].first_data_at is not None)
        client.reset(stream)
        assert upstream.connection_of("h2-tls-cancel").closed.wait(5)


class _EchoHandler:
    """A stream handler beside the exchange (what gRPC plugs in): echoes the
    body as it comes, then ends with trailers."""

    def __init__(self, stream: Http2Stream) -> None:
        self.stream = stream
        stream.respond_head(200, [(b"content-type", b"application/grpc")])

    def data_received(self, data: bytes) -> None:
        self.stream.send_body(data)

    def request_ended(self) -> None:
        self.stream.send_trailers([(b"grpc-status", b"0")])
        self.stream.exchange_finished(None)

    def stream_reset(self) -> None:
        self.stream.exchange_finished(None)


def test_http2_when_route_claims_a_stream_then_its_handler_answers_and_nothing_is_proxied(
        loop_thread: LoopThread, upstream: FakeUpstream) -> None:
    def route(head: RequestHead, stream: Http2Stream) -> StreamHandler | None:
        if head.header(b"content-type") == b"application/grpc":
            return _EchoHandler(stream)
        return None

    config = make_config(upstream.url)
    sidecar = Sidecar(config, log=RecordingLog(), http2_route=route)
    loop_thread.run(sidecar.start())
    try:
        before = len(upstream.requests)
        with H2Client(sidecar.address[1]) as client:
            stream_id = client.request("/pkg.Service/Method", method="POST",
                                       headers=[(b"content-type", b"application/grpc")], end=False)
            client.conn.send_data(stream_id, b"\x00\x00\x00\x00\x02hi", end_stream=True)
            client.flush()
            state = client.response(stream_id)
            assert state.status == 200 and state.ended
            assert bytes(state.body) == b"\x00\x00\x00\x00\x02hi"
            assert state.trailers == [(b"grpc-status", b"0")]
            assert len(upstream.requests) == before  # the handler answered, not the upstream
            # Anything else on the same connection is proxied as usual.
            plain = client.response(client.request("/models/v1/models"))
            assert plain.status == 200 and len(upstream.requests) == before + 1
    finally:
        loop_thread.run(sidecar.shutdown())


def test_http2_when_body_too_slow_or_too_large_then_stream_408_or_413_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(body_read_timeout_s=0.3, max_body_bytes=1000)
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        slow = client.request("/echo/v1/x", method="POST", end=False)
        client.conn.send_data(slow, b"partial")
        client.flush()
        large = client.request("/echo/v1/x", method="POST", body=b"x" * 2000)
        announced = client.request("/echo/v1/x", method="POST", end=False,
                                   headers=[(b"content-length", b"5000")])
        assert client.response(large).status == 413
        assert client.response(announced).status == 413
        timed_out = client.response(slow)
        assert timed_out.status == 408 and timed_out.ended
        # The connection serves on.
        assert client.response(client.request("/models/v1/models")).status == 200
    assert len(upstream.requests) == before + 1
