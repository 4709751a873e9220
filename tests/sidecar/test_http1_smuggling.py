"""Request smuggling and malformed HTTP at the client side: refused, nothing forwarded.

Each request below is one that two HTTP parsers may read differently (the
classic CL.TE / TE.CL desyncs, obfuscated Transfer-Encoding, bare LF, obs-fold,
duplicate lengths) or that no hop should act on (NUL/CR in a header value, an
h2c upgrade). The upstream is a :class:`ScriptedUpstream` that records every
byte it receives; after each refusal a well-formed request goes through as a
barrier, so "nothing forwarded" is checked without sleeping: once the barrier
arrived, anything forwarded before it would have arrived too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from clients import connect, exchange, read_response
from conftest import RunningSidecar
from upstreams import ScriptedUpstream


def _head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_POST = "POST /v1/chat/completions HTTP/1.1"
_CHUNKED = (_POST, "Host: x", "Transfer-Encoding: chunked")

# (case, raw request): each must be answered 400 and the connection closed.
REFUSED: list[tuple[str, bytes]] = [
    ("te-then-cl", _head(*_CHUNKED, "Content-Length: 5") + b"0\r\n\r\n"),
    ("cl-twice-same", _head(_POST, "Host: x", "Content-Length: 5", "Content-Length: 5") + b"hello"),
    ("cl-list-same", _head(_POST, "Host: x", "Content-Length: 5, 5") + b"hello"),
    ("cl-differing", _head(_POST, "Host: x", "Content-Length: 5", "Content-Length: 6") + b"hello!"),
    ("cl-signed", _head(_POST, "Host: x", "Content-Length: +5") + b"hello"),
    ("te-xchunked", _head(_POST, "Host: x", "Transfer-Encoding: xchunked") + b"0\r\n\r\n"),
    ("te-list", _head(_POST, "Host: x", "Transfer-Encoding: chunked, identity") + b"0\r\n\r\n"),
    ("te-twice", _head(*_CHUNKED, "Transfer-Encoding: identity") + b"0\r\n\r\n"),
    ("te-space-before-colon", _head(_POST, "Host: x", "Transfer-Encoding : chunked") + b"0\r\n\r\n"),
    ("te-vertical-tab", _head(_POST, "Host: x", "Transfer-Encoding:\x0bchunked") + b"0\r\n\r\n"),
    ("te-in-http-1.0", _head("POST /v1/chat/completions HTTP/1.0", "Transfer-Encoding: chunked")
     + b"0\r\n\r\n"),
    ("chunk-size-not-hex", _head(*_CHUNKED) + b"zz\r\nhello\r\n0\r\n\r\n"),
    ("chunk-size-negative", _head(*_CHUNKED) + b"-5\r\nhello\r\n0\r\n\r\n"),
    ("chunk-size-0x", _head(*_CHUNKED) + b"0x5\r\nhello\r\n0\r\n\r\n"),
    ("chunk-extension-with-lf", _head(*_CHUNKED) + b"5;a\nb\r\nhello\r\n0\r\n\r\n"),
    ("chunk-data-longer-than-size", _head(*_CHUNKED) + b"5\r\nhelloXX\r\n0\r\n\r\n"),
    ("nul-in-value", _head("GET /v1/models HTTP/1.1", "Host: x", "X-A: a\x00b")),
    ("cr-in-value", _head("GET /v1/models HTTP/1.1", "Host: x", "X-A: a\rb")),
    ("lf-in-value", _head("GET /v1/models HTTP/1.1", "Host: x", "X-A: a\nX-Injected: b")),
    ("obs-fold", _head("GET /v1/models HTTP/1.1", "Host: x", "X-A: a", " b")),
    ("bare-lf-everywhere", b"GET /v1/models HTTP/1.1\nHost: x\n\n"),
    ("bare-lf-ending-the-head", b"GET /v1/models HTTP/1.1\r\nHost: x\n\n"),
    ("h2c-upgrade", _head("GET /v1/models HTTP/1.1", "Host: x", "Connection: Upgrade, HTTP2-Settings",
                          "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")),
    ("websocket-upgrade", _head("GET /v1/models HTTP/1.1", "Host: x", "Connection: Upgrade",
                                "Upgrade: websocket")),
    ("two-hosts", _head("GET /v1/models HTTP/1.1", "Host: x", "Host: y")),
]


def _assert_nothing_forwarded(sidecar: RunningSidecar, recorder: ScriptedUpstream) -> None:
    barrier = exchange(sidecar.port, "GET", "/barrier")
    assert barrier.status == 200
    received = bytes(recorder.received)
    assert received.startswith(b"GET /barrier HTTP/1.1\r\n"), received[:300]
    assert received.count(b"HTTP/1.1\r\n") == 1, received


@pytest.mark.parametrize("raw", [raw for _, raw in REFUSED], ids=[case for case, _ in REFUSED])
def test_smuggling_when_ambiguous_or_malformed_then_400_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], recorder: ScriptedUpstream, raw: bytes) -> None:
    sidecar = start_sidecar(recorder.url)
    with connect(sidecar.port, timeout_s=3.0) as sock:
        sock.sendall(raw)
        response = read_response(sock, timeout_s=3.0)
        assert response.status == 400, response
        assert response.headers["connection"] == "close"
        assert response.json()["error"]["message"]
        assert sock.recv(100) == b"", "the connection must be closed after the refusal"
    _assert_nothing_forwarded(sidecar, recorder)


# Requests h11 would wait on until a timeout (a chunk that announces more than
# will ever come, bare-LF chunk lines, a request line with no version) or let
# through (other HTTP versions, TRACE, control characters in a chunk
# extension): answered at once, as nginx answers them, with the fault in words.
AT_ONCE: list[tuple[str, bytes, int, str]] = [
    ("chunk-size-huge", _head(*_CHUNKED) + b"fffffffffffffffffff\r\nhello\r\n", 400, "impossible chunk size"),
    ("chunk-size-2^64+1", _head(*_CHUNKED) + b"10000000000000001\r\nhello\r\n", 400, "impossible chunk size"),
    ("chunk-lines-bare-lf", _head(*_CHUNKED) + b"5\nhello\n0\n\n", 400, "bare LF"),
    ("last-chunk-bare-lf", _head(*_CHUNKED) + b"0\n\n", 400, "bare LF"),
    ("chunk-extension-bare-cr", _head(*_CHUNKED) + b"5;a\rb\r\nhello\r\n0\r\n\r\n", 400, "chunk extension"),
    ("chunk-extension-nul", _head(*_CHUNKED) + b"5;a\x00\r\nhello\r\n0\r\n\r\n", 400, "chunk extension"),
    ("http-0.9", b"GET /v1/models\r\n", 400, "HTTP/0.9"),
    ("http-2.0", _head("GET /v1/models HTTP/2.0", "Host: x"), 505, "HTTP/1.0 and HTTP/1.1"),
    ("http-9.9", _head("GET /v1/models HTTP/9.9", "Host: x"), 505, "HTTP/1.0 and HTTP/1.1"),
    ("h2-prior-knowledge", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1"),
    ("trace", _head("TRACE /v1/models HTTP/1.1", "Host: x"), 405, "TRACE"),
    ("header-vertical-tab", _head("GET /v1/models HTTP/1.1", "Host: x", "X-A: a\x0bb"), 400,
     "malformed header line"),
]


@pytest.mark.parametrize(("raw", "status", "words"), [case[1:] for case in AT_ONCE],
                         ids=[case[0] for case in AT_ONCE])
def test_smuggling_when_nginx_would_answer_at_once_then_answered_before_any_timeout_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], recorder: ScriptedUpstream, raw: bytes, status: int,
        words: str) -> None:
    # Timeouts far beyond the read's: an answer can only come from the check itself.
    # The HTTP/2 preface is HTTP/2 while http2 is on (test_http2*.py); off, it is a
    # version HTTP/1.1 does not serve.
    sidecar = start_sidecar(recorder.url, body_read_timeout_s=60.0, header_read_timeout_s=60.0,
                            http2=not raw.startswith(b"PRI * HTTP/2.0"))
    with connect(sidecar.port, timeout_s=10.0) as sock:
        sock.sendall(raw)
        response = read_response(sock, timeout_s=10.0)
    assert response.status == status, response
    message = response.json()["error"]["message"]
    assert words in message, message
    assert "b'" not in message and "bytearray" not in message and "\\x" not in message
    _assert_nothing_forwarded(sidecar, recorder)


def test_smuggling_when_chunked_body_with_extensions_then_upstream_gets_content_length_only(
        start_sidecar: Callable[..., Any], recorder: ScriptedUpstream) -> None:
    """Whatever framing the client used, the upstream sees one Content-Length and
    the decoded body: chunk extensions (odd but valid ones: quoted, valueless) and the
    client's Transfer-Encoding never reach the next parser."""
    sidecar = start_sidecar(recorder.url)
    with connect(sidecar.port, timeout_s=3.0) as sock:
        sock.sendall(_head("POST /v1/models HTTP/1.1", "Host: x", "Transfer-Encoding: chunked")
                     + b'5;name=value\r\nhello\r\n6;odd="q\\"ext";b\r\n world\r\n0\r\n\r\n')
        assert read_response(sock, timeout_s=3.0).status == 200
    head, _, body = bytes(recorder.received).partition(b"\r\n\r\n")
    lowered = head.lower()
    assert body == b"hello world"
    assert b"transfer-encoding" not in lowered and b"ext" not in lowered
    assert lowered.count(b"\r\ncontent-length: 11") == 1
