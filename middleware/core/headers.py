"""Header policy: what a streamed response carries, what a proxy strips.

Header names are lower-case bytes throughout, as h11 and ASGI give them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

Header = tuple[bytes, bytes]

# RFC 9110 section 7.6.1 plus the de-facto ones every proxy strips.
HOP_BY_HOP: Final = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

SSE_HEADERS: Final[tuple[Header, ...]] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),
)

STREAM_ID_HEADER: Final = b"x-tokenwire-stream-id"
"""Response header naming the stream a client can resume (``config.resume``)."""

# Replaced by SSE_HEADERS or meaningless on a re-framed event stream.
_DROPPED_ON_SSE: Final = frozenset({
    b"content-type", b"cache-control", b"x-accel-buffering", b"content-length",
    b"content-encoding", b"etag", b"last-modified", b"accept-ranges",
})


SUMMARY_HEADER: Final = b"tokenwire-summary"
"""A request header: ``true`` asks for the stream's figures as a last named event
(``frames.py``)."""


def header_value(headers: Iterable[Header], name: bytes) -> bytes | None:
    """The first value of ``name`` (lower-case), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def connection_tokens(headers: Iterable[Header]) -> frozenset[bytes]:
    """Header names listed in ``Connection`` (they are hop-by-hop too)."""
    tokens: set[bytes] = set()
    for key, value in headers:
        if key == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def strip_hop_by_hop(headers: Iterable[Header]) -> list[Header]:
    """Drop hop-by-hop headers and any named by ``Connection``."""
    headers = list(headers)
    extra = connection_tokens(headers)
    return [(k, v) for k, v in headers if k not in HOP_BY_HOP and k not in extra]


def is_event_stream(headers: Iterable[Header]) -> bool:
    """True if ``Content-Type`` is ``text/event-stream`` (parameters allowed)."""
    value = header_value(headers, b"content-type")
    if value is None:
        return False
    return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"


def is_compressed(headers: Iterable[Header]) -> bool:
    """True if the body carries a ``Content-Encoding`` other than identity."""
    value = header_value(headers, b"content-encoding")
    return value is not None and value.strip().lower() not in (b"", b"identity")


def sse_response_headers(upstream: Iterable[Header] = ()) -> tuple[Header, ...]:
    """Headers for the client of an event stream: the SSE set plus the
    upstream's end-to-end headers (request ids, rate-limit hints...)."""
    kept = [(k, v) for k, v in strip_hop_by_hop(upstream) if k not in _DROPPED_ON_SSE]
    return SSE_HEADERS + tuple(kept)


def passthrough_headers(upstream: Iterable[Header]) -> tuple[Header, ...]:
    """Headers for a response forwarded unchanged: only hop-by-hop ones go."""
    return tuple(strip_hop_by_hop(upstream))
