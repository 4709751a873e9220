"""A connection read the plain way (``http1_plain.py``), over real sockets: it
serves keep-alive and pipelined requests in order across the hand-over to h11,
and keeps nothing of a request once its exchange is over (the body is counted
against ``max_buffered_body_bytes`` only while the exchange holds it)."""

from __future__ import annotations

import json
from typing import Any

from clients import chat_body, connect, read_responses, request_bytes, wait_for
from tokenwire.sidecar.downstream.http1 import ClientConnection


def _only_connection(sidecar: Any) -> ClientConnection:
    (conn,) = [c for c in sidecar.sidecar.context.connections if isinstance(c, ClientConnection)]
    return conn


def _holds_no_request(conn: ClientConnection) -> bool:
    return (conn.idle and not conn._plain_head_bytes and not conn._request_body and not conn._body
            and not conn._pending)


def test_a_plain_post_answered_and_its_connection_kept_holds_none_of_it(start_sidecar: Any) -> None:
    sidecar = start_sidecar()
    body = chat_body(note="x" * 1_000_000)
    with connect(sidecar.port) as sock:
        for _ in range(2):
            sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=body))
            (response,) = read_responses(sock, 1)
            assert response.status == 200 and b"data: [DONE]" in response.body
            conn = _only_connection(sidecar)
            wait_for(lambda c=conn: _holds_no_request(c))
            assert conn._conn is None  # still plain: h11 was never needed
            assert sidecar.sidecar.context.buffered_body_bytes == 0


def test_a_response_h11_must_write_hands_the_connection_over_and_keeps_nothing(start_sidecar: Any) -> None:
    sidecar = start_sidecar()
    with connect(sidecar.port) as sock:
        # A JSON answer with a Content-Length: h11 writes it, after reading the request again.
        sock.sendall(request_bytes("POST", "/models/v1/models", body=b'{"pad": "' + b"y" * 500_000 + b'"}'))
        (response,) = read_responses(sock, 1)
        assert response.status == 200
        conn = _only_connection(sidecar)
        wait_for(lambda: _holds_no_request(conn))
        assert conn._conn is not None
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
        (again,) = read_responses(sock, 1)
        assert again.status == 200 and b"data: [DONE]" in again.body


def test_pipelined_requests_are_answered_in_order_across_the_hand_over(start_sidecar: Any) -> None:
    sidecar = start_sidecar()
    requests = [
        request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()),  # plain
        request_bytes("GET", "/models/v1/models"),  # plain, but its answer takes h11 on
        request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(),
                      headers={"Connection": "keep-alive"}),  # not plain
        request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()),
    ]
    with connect(sidecar.port) as sock:
        sock.sendall(b"".join(requests))
        responses = read_responses(sock, len(requests))
    assert [r.status for r in responses] == [200, 200, 200, 200]
    assert b"data: [DONE]" in responses[0].body and json.loads(responses[1].body)["object"] == "list"
    assert all(b"data: [DONE]" in r.body for r in responses[2:])
