"""Request limits: clear statuses, nothing forwarded upstream."""

from __future__ import annotations

import time

from clients import chat_body, connect, exchange, read_response, request_bytes
from upstreams import FakeUpstream


def _forwarded(upstream: FakeUpstream, marker: str) -> bool:
    return any(r.headers.get("x-marker") == marker for r in upstream.requests)


def test_oversized_head_is_431(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(max_head_bytes=4096)
    response = exchange(sidecar.port, "GET", "/echo/", headers={"X-Marker": "431", "X-Big": "a" * 8000})
    assert response.status == 431
    assert response.headers["connection"] == "close"
    assert not _forwarded(upstream, "431")


def test_oversized_head_arriving_in_pieces_is_431(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(max_head_bytes=4096)
    with connect(sidecar.port) as sock:
        sock.sendall(b"GET /echo/ HTTP/1.1\r\nHost: x\r\nX-Marker: 431p\r\n")
        for _ in range(10):
            sock.sendall(b"X-Filler: " + b"f" * 1000 + b"\r\n")
            time.sleep(0.005)
        assert read_response(sock).status == 431
    assert not _forwarded(upstream, "431p")


def test_too_many_headers_is_400(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(max_header_count=20)
    headers = {f"X-H{i}": "v" for i in range(30)} | {"X-Marker": "400h"}
    response = exchange(sidecar.port, "GET", "/echo/", headers=headers)
    assert response.status == 400
    assert not _forwarded(upstream, "400h")


def test_body_over_the_limit_is_413_by_length_and_by_chunks(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(max_body_bytes=1000)
    response = exchange(sidecar.port, "POST", "/echo/", body=b"x" * 5000, headers={"X-Marker": "413"})
    assert response.status == 413
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/echo/", headers={"Transfer-Encoding": "chunked",
                                                              "X-Marker": "413c"}))
        for _ in range(3):
            sock.sendall(b"200\r\n" + b"y" * 512 + b"\r\n")
        assert read_response(sock).status == 413
    assert not _forwarded(upstream, "413") and not _forwarded(upstream, "413c")


def test_expect_100_continue_over_the_limit_gets_413_not_100(start_sidecar) -> None:
    sidecar = start_sidecar(max_body_bytes=1000)
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/echo/", headers={"Content-Length": "5000",
                                                              "Expect": "100-continue"}))
        assert read_response(sock).status == 413


def test_slowloris_head_is_408(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(header_read_timeout_s=0.3)
    with connect(sidecar.port) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /echo/ HTTP/1.1\r\nHost: x\r\nX-Marker: slow\r\n")
        time.sleep(0.1)
        sock.sendall(b"X-More: 1\r\n")  # still trickling, still not done
        response = read_response(sock)
        assert response.status == 408
        assert time.monotonic() - started < 2
    assert not _forwarded(upstream, "slow")


def test_idle_keep_alive_connection_is_closed(start_sidecar) -> None:
    sidecar = start_sidecar(keepalive_timeout_s=0.2)
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("GET", "/models/v1/models"))
        assert read_response(sock).status == 200
        started = time.monotonic()
        assert sock.recv(10) == b""  # closed by the server, silently
        assert 0.1 < time.monotonic() - started < 2


def test_connections_over_the_limit_get_503_with_retry_after(start_sidecar) -> None:
    sidecar = start_sidecar(max_connections=2)
    held = [connect(sidecar.port), connect(sidecar.port)]
    try:
        time.sleep(0.05)
        response = exchange(sidecar.port, "GET", "/models/v1/models")
        assert response.status == 503
        assert response.headers["retry-after"] == "1"
        # The held ones are still served.
        held[0].sendall(request_bytes("GET", "/models/v1/models"))
        assert read_response(held[0]).status == 200
    finally:
        for sock in held:
            sock.close()


def test_content_length_with_transfer_encoding_is_400_and_nothing_forwarded(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    smuggled = b"0\r\n\r\nGET /echo/smuggled HTTP/1.1\r\nHost: x\r\nX-Marker: smuggled\r\n\r\n"
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/echo/", body=smuggled, headers={
            "Content-Length": str(len(smuggled)), "Transfer-Encoding": "chunked", "X-Marker": "clte"}))
        response = read_response(sock)
        assert response.status == 400
        assert sock.recv(100) == b""  # and the connection is closed
    time.sleep(0.05)
    assert not _forwarded(upstream, "clte") and not _forwarded(upstream, "smuggled")


def test_malformed_request_and_absolute_target_are_400(start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with connect(sidecar.port) as sock:
        sock.sendall(b"GET /echo/ HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n")
        assert read_response(sock).status == 400
    response = exchange(sidecar.port, "GET", "http://evil.example/echo/", headers={"X-Marker": "abs"})
    assert response.status == 400
    assert not _forwarded(upstream, "abs")


def test_a_request_after_a_refused_one_is_not_read(start_sidecar) -> None:
    sidecar = start_sidecar(max_body_bytes=10)
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/echo/", body=chat_body()) + request_bytes("GET", "/models/"))
        assert read_response(sock).status == 413
        assert sock.recv(100) == b""
