"""The proxy's happy paths with real clients: OpenAI SDK, curl -N, raw sockets."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest
from clients import chat_body, connect, exchange, read_response, read_responses, request_bytes
from tokenwire.sidecar import wants_stream
from upstreams import FakeUpstream, expected_text


def test_openai_sdk_streams_the_exact_text_through_the_sidecar(start_sidecar) -> None:
    sidecar = start_sidecar()
    client = openai.OpenAI(base_url=sidecar.url + "/normal/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_headers={"x-fake-tokens": "20"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(20)


def test_openai_sdk_non_streaming_answer_is_passed_through(start_sidecar) -> None:
    sidecar = start_sidecar()
    client = openai.OpenAI(base_url=sidecar.url + "/normal/v1", api_key="none", max_retries=0)
    completion = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                extra_headers={"x-fake-tokens": "7"})
    assert completion.choices[0].message.content == expected_text(7)
    models = openai.OpenAI(base_url=sidecar.url + "/models/v1", api_key="none").models.list()
    assert [m.id for m in models] == ["fake"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_no_buffer_gets_every_event_and_done(start_sidecar) -> None:
    sidecar = start_sidecar()
    result = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "10", "-H", "content-type: application/json",
         "-H", "x-fake-tokens: 12", "-d", chat_body().decode(), sidecar.url + "/normal/v1/chat/completions"],
        capture_output=True, check=True, timeout=20)
    datas = [line[6:] for line in result.stdout.decode().splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in datas[:-1])
    assert text == expected_text(12)


def test_stream_response_has_sse_headers_request_id_and_a_clean_end(start_sidecar) -> None:
    sidecar = start_sidecar()
    response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "req-abc"})
    assert response.status == 200
    assert response.clean_end
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache, no-transform"
    assert response.headers["x-request-id"] == "req-abc"
    assert response.headers["x-engine"] == "fake"  # end-to-end upstream headers survive
    assert "content-length" not in response.headers
    assert response.datas()[-1] == "[DONE]"
    record = sidecar.record("req-abc")
    assert record.end_reason == "complete" and record.usage == {
        "prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}


def test_forwarded_request_headers_and_body(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    response = exchange(sidecar.port, "POST", "/echo/v1/x?q=1", body=b'{"a": 1}', headers={
        "Connection": "keep-alive, X-Private", "X-Private": "secret", "Keep-Alive": "timeout=5",
        "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Proto": "https", "Accept-Encoding": "gzip",
        "Authorization": "Bearer k"})
    echoed = response.json()
    headers = echoed["headers"]
    assert echoed["path"] == "/echo/v1/x?q=1" and echoed["body"] == '{"a": 1}'
    assert "x-private" not in headers and "keep-alive" not in headers
    assert headers["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
    assert headers["x-forwarded-proto"] == "http"  # what the client really used
    assert headers["accept-encoding"] == "identity"
    assert headers["authorization"] == "Bearer k"
    generated = headers["x-request-id"]
    assert len(generated) == 32 and response.headers["x-request-id"] == generated


def test_keep_alive_pipelining_chunked_body_and_100_continue(start_sidecar) -> None:
    sidecar = start_sidecar()
    with connect(sidecar.port) as sock:
        # Two pipelined requests in one write: answered in order, on one connection.
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-tokens": "3"})
                     + request_bytes("GET", "/models/v1/models"))
        first, second = read_responses(sock, 2)
        assert first.clean_end and first.datas()[-1] == "[DONE]"
        assert second.status == 200 and second.json()["data"][0]["id"] == "fake"
        # A chunked request body behind Expect: 100-continue.
        body = b'{"chunked": true}'
        sock.sendall(request_bytes("POST", "/echo/v1/x", headers={
            "Transfer-Encoding": "chunked", "Expect": "100-continue"}))
        interim = sock.recv(100)
        assert interim.startswith(b"HTTP/1.1 100 ")
        sock.sendall(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
        third = read_response(sock)
        assert third.json()["body"] == body.decode()
        assert third.json()["headers"]["content-length"] == str(len(body))


def test_completed_streams_reuse_the_pooled_upstream_connection(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    ids = ["pool-1", "pool-2", "pool-3"]
    for request_id in ids:
        response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                            headers={"X-Request-Id": request_id})
        assert response.clean_end
    connections = {id(upstream.connection_of(r)) for r in ids}
    assert len(connections) == 1


def test_httpx_client_reads_stream_incrementally(start_sidecar) -> None:
    sidecar = start_sidecar()
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", sidecar.url + "/normal/v1/chat/completions", content=chat_body(),
            headers={"x-fake-tokens": "30", "x-fake-delay-s": "0.002"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 30 + 4


@pytest.mark.parametrize(("headers", "body", "expected"), [
    ([], b'{"stream": true}', True),
    ([], b'{"stream": false}', False),
    ([], b'{"messages": [{"content": "\\"stream\\": true"}]}', False),
    ([(b"accept", b"text/event-stream")], b"", True),
    ([], b"not json \"stream\"", False),
    ([], b"", False),
])
def test_wants_stream_classifies_requests(headers: list[tuple[bytes, bytes]], body: bytes,
                                          expected: bool) -> None:
    assert wants_stream(headers, body) is expected
