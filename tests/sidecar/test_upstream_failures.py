"""Upstreams that go silent, die, refuse, never answer or send garbage."""

from __future__ import annotations

import json
import socket

import openai
import pytest
from clients import chat_body, exchange
from upstreams import FakeUpstream, expected_text


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_silent_upstream_gets_heartbeats_then_completes(start_sidecar) -> None:
    sidecar = start_sidecar(heartbeat_s=0.1)
    response = exchange(sidecar.port, "POST", "/silent/v1/chat/completions", body=chat_body(),
                        headers={"x-fake-silence-s": "0.55", "X-Request-Id": "silent-1"})
    assert response.clean_end
    assert response.body.count(b": keepalive\n") >= 3
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in response.datas()[:-1])
    assert text == expected_text(5)
    assert sidecar.record("silent-1").heartbeats >= 3


def test_upstream_dying_mid_stream_is_an_in_band_error_and_a_cut_body(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(retry_attempts=2)
    response = exchange(sidecar.port, "POST", "/die/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "die-1"})
    assert response.status == 200
    assert not response.clean_end, "the chunked terminator must be missing"
    error = json.loads(response.datas()[-1])["error"]
    assert error["code"] == "upstream_failed"
    # Written for the caller: no class name of the proxy's client, no library's words.
    assert error["message"] == "upstream failed: the upstream closed the connection before its answer ended"
    assert len(upstream.requests_with("die-1")) == 1, "no retry after the first byte"
    record = sidecar.record("die-1")
    assert record.end_reason == "upstream_error" and record.retries == 0


def test_openai_sdk_raises_on_the_in_band_error(start_sidecar) -> None:
    sidecar = start_sidecar()
    client = openai.OpenAI(base_url=sidecar.url + "/die/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                            stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_refused_first_upstream_is_retried_on_the_next_and_the_client_never_notices(
        start_sidecar, upstream: FakeUpstream) -> None:
    # Round robin's first turn is the first listed: the refused one, so a retry is certain.
    sidecar = start_sidecar([f"http://127.0.0.1:{_closed_port()}", upstream.url], retry_backoff_s=0.01,
                            balance="round-robin")
    response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "refused-1"})
    assert response.status == 200 and response.clean_end
    assert response.datas()[-1] == "[DONE]"
    record = sidecar.record("refused-1")
    assert record.retries == 1 and record.end_reason == "complete" and record.upstream == upstream.url


def test_503_before_the_first_byte_is_retried(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(retry_backoff_s=0.01)
    response = exchange(sidecar.port, "POST", "/status503/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "s503-1", "x-fake-fail-first": "2"})
    assert response.status == 200 and response.clean_end
    assert len(upstream.requests_with("s503-1")) == 3
    assert sidecar.record("s503-1").retries == 2


def test_503_with_retry_after_when_retried_then_not_sooner_than_it_asks(
        start_sidecar, upstream: FakeUpstream) -> None:
    """``Retry-After: 1`` on a 503: the retry waits that second (the doubling
    backoff alone would have retried after 0.1 s), as an SDK reading the
    engine directly would. A lower bound: a loaded machine only makes it later."""
    sidecar = start_sidecar(retry_backoff_s=0.1)
    response = exchange(sidecar.port, "POST", "/status503/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "s503-ra", "x-fake-fail-first": "1",
                                 "x-fake-retry-after": "1"})
    assert response.status == 200 and response.clean_end
    refused, retried = upstream.requests_with("s503-ra")
    assert refused.finished_at is not None
    assert retried.received_at - refused.finished_at >= 1.0
    assert sidecar.record("s503-ra").retries == 1


def test_every_upstream_down_is_a_real_status(start_sidecar) -> None:
    sidecar = start_sidecar([f"http://127.0.0.1:{_closed_port()}"], retry_backoff_s=0.01)
    response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body())
    assert response.status == 502
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert "retry-after" in response.headers


def test_upstream_that_never_sends_headers_is_a_504_and_is_closed(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(upstream_headers_timeout_s=0.3, commit_deadline_s=5.0, retry_attempts=0)
    response = exchange(sidecar.port, "POST", "/noheaders/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "nohead-1"})
    assert response.status == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert upstream.connection_of("nohead-1").closed.wait(2)
    assert sidecar.record("nohead-1").end_reason == "upstream_timeout"


def test_malformed_sse_is_invalid_stream(start_sidecar) -> None:
    sidecar = start_sidecar(max_line_bytes=4096, max_event_bytes=8192)
    response = exchange(sidecar.port, "POST", "/malformed/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "bad-1"})
    assert not response.clean_end
    assert json.loads(response.datas()[-1])["error"]["code"] == "invalid_stream"
    assert sidecar.record("bad-1").error_code == "invalid_stream"
