"""Header policy for streamed and passed-through responses."""

from __future__ import annotations

import pytest
from tokenwire.middleware.core.headers import (
    connection_tokens,
    is_compressed,
    is_event_stream,
    passthrough_headers,
    sse_response_headers,
    strip_hop_by_hop,
)


def test_sse_headers_set_the_streaming_headers_and_drop_framing() -> None:
    upstream = [(b"content-type", b"text/event-stream"), (b"content-length", b"10"),
                (b"content-encoding", b"gzip"), (b"transfer-encoding", b"chunked"),
                (b"connection", b"keep-alive, x-hop"), (b"x-hop", b"1"), (b"keep-alive", b"timeout=5"),
                (b"cache-control", b"max-age=60"), (b"x-request-id", b"r1"), (b"etag", b"e")]
    headers = sse_response_headers(upstream)
    assert headers[:3] == ((b"content-type", b"text/event-stream; charset=utf-8"),
                           (b"cache-control", b"no-cache, no-transform"), (b"x-accel-buffering", b"no"))
    assert headers[3:] == ((b"x-request-id", b"r1"),)


def test_sse_headers_when_no_upstream_then_just_the_streaming_set() -> None:
    assert [k for k, _ in sse_response_headers()] == [b"content-type", b"cache-control",
                                                      b"x-accel-buffering"]


def test_passthrough_headers_keep_end_to_end_only() -> None:
    upstream = [(b"content-type", b"application/json"), (b"content-length", b"2"),
                (b"connection", b"close"), (b"upgrade", b"h2c"), (b"retry-after", b"3")]
    assert passthrough_headers(upstream) == ((b"content-type", b"application/json"),
                                             (b"content-length", b"2"), (b"retry-after", b"3"))


def test_connection_tokens_are_hop_by_hop() -> None:
    headers = [(b"connection", b" X-A , ,x-b"), (b"x-a", b"1"), (b"x-b", b"2"), (b"x-c", b"3")]
    assert connection_tokens(headers) == {b"x-a", b"x-b"}
    assert strip_hop_by_hop(headers) == [(b"x-c", b"3")]


@pytest.mark.parametrize(("value", "expected"), [
    (b"text/event-stream", True), (b"text/event-stream; charset=utf-8", True),
    (b"Text/Event-Stream", True), (b" text/event-stream ;x=1", True), (b"application/json", False),
    (b"text/event-streams", False), (None, False)])
def test_is_event_stream(value: bytes | None, expected: bool) -> None:
    headers = [] if value is None else [(b"content-type", value)]
    assert is_event_stream(headers) is expected


@pytest.mark.parametrize(("value", "expected"), [
    (b"gzip", True), (b"br", True), (b"identity", False), (b" Identity ", False), (b"", False),
    (None, False)])
def test_is_compressed(value: bytes | None, expected: bool) -> None:
    headers = [] if value is None else [(b"content-encoding", value)]
    assert is_compressed(headers) is expected
