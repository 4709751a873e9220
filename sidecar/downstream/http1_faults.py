"""What is wrong with an HTTP/1.1 request, in words: the limits and faults h11
lets through that an edge proxy must refuse, and h11's own refusals said for
the client. Pure functions of the bytes and the parsed head: the connection
(``http1.py``) asks them and sends the refusal."""

from __future__ import annotations

from typing import Final, Protocol

import h11
from tokenwire.middleware.core.headers import header_value

from .request_rules import HeadLimits, Problem, head_problem


class RequestLimits(HeadLimits, Protocol):
    """The limits an HTTP/1.1 request head is held to: the shared ones and its size."""

    @property
    def max_head_bytes(self) -> int: ...


def framing_problem(received: bytes | bytearray) -> str | None:
    """What is wrong with a request head h11 accepted but an edge proxy must not.

    ``received`` starts with the head as it came off the wire. h11 is lenient
    where RFC 9112 allows it (bare LF line ends, obsolete line folding, a
    repeated identical Content-Length, which it merges); the next hop may read
    such a head differently, which is what request smuggling exploits, so the
    sidecar refuses them as nginx and HAProxy do.
    """
    end = received.find(b"\n\r\n")
    bare_end = received.find(b"\n\n")
    if bare_end != -1 and (end == -1 or bare_end < end):
        return "bare LF in the request head"
    head = received[:end + 1]
    if head.count(b"\n") != head.count(b"\r\n"):
        return "bare LF in the request head"
    if head.find(b"\n ") != -1 or head.find(b"\n\t") != -1:
        return "obsolete line folding in the request head"
    lowered = head.lower()
    at = lowered.find(b"\ncontent-length:")
    if at != -1 and (lowered.find(b"\ncontent-length:", at + 1) != -1
                     or lowered.find(b",", at, lowered.find(b"\r", at + 1)) != -1):
        return "more than one Content-Length"
    return None


# What h11's messages say, in words for the client (they may quote the bytes
# as a Python repr, which names nothing a client can act on).
H11_FAULTS: Final = (
    ("illegal header name", "an invalid character in a header name"),
    ("illegal header value", "an invalid character in a header value"),
    ("illegal header line", "a malformed header line"),
    ("continuation line", "obsolete line folding in the request head"),
    ("request line", "a malformed request line"),
    ("illegal method", "an invalid character in the method"),
    ("illegal target", "an invalid character in the request target"),
    ("transfer-encoding", "an unsupported Transfer-Encoding (only chunked is accepted)"),
    ("chunk", "a malformed chunked body"),
    ("content-length", "a malformed or conflicting Content-Length"),
    ("missing mandatory host", "no Host header"),
    ("multiple host", "more than one Host header"),
    ("receive buffer too long", "a request head over the size limit"),
    ("peer closed", "the connection closed before the request was complete"),
    ("unexpectedly closed", "the connection closed before the request was complete"),
)


def h11_fault(error: h11.RemoteProtocolError) -> str:
    """The fault h11 found, in words (never h11's text, which may hold a repr)."""
    text = str(error).lower()
    for needle, words in H11_FAULTS:
        if needle in text:
            return words
    return "a malformed request"


def request_problem(method: bytes, target: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]],
                    received: bytes | bytearray | None, limits: RequestLimits) -> Problem | None:
    """Why a request head h11 parsed (or ``http1_plain`` read as h11 would) is
    refused (status, words), or None.

    ``headers``: the request's headers as a list (h11's ``Headers`` is a
    sequence written in Python: each item read from it is a call).
    ``received`` starts with the head as it came off the wire (for the
    framing faults h11 lets through: :func:`framing_problem`); None for a head
    ``http1_plain`` read, which has none of them (it declines any line end but
    CRLF, a folded line and all but one ``Content-Length`` of digits; a
    property test holds it to that). What only
    HTTP/1.1 can get wrong is checked here; the rest is
    :func:`~.request_rules.head_problem`'s, as for HTTP/2."""
    names = [name for name, _ in headers]
    # h11's buffer limit only catches a head still incomplete at the limit;
    # one that arrives whole in a single read is measured here.
    head_bytes = len(method) + len(target) + 12 + sum(
        len(name) + len(value) + 4 for name, value in headers)
    if head_bytes > limits.max_head_bytes:
        return 431, f"request head over {limits.max_head_bytes} bytes"
    if b"transfer-encoding" in names and b"content-length" in names:
        # Request smuggling: two framings, and two hops that may pick differently.
        return 400, "Content-Length and Transfer-Encoding together"
    problem = None if received is None else framing_problem(received)
    if problem is not None:
        return 400, problem
    if b"transfer-encoding" in names and http_version == b"1.0":
        # RFC 9112 section 6.1: chunked framing in HTTP/1.0 is faulty framing.
        return 400, "Transfer-Encoding in an HTTP/1.0 request"
    if b"upgrade" in names:
        # h2c (and WebSocket) upgrades are not served; refusing them rather
        # than dropping the header means no hop ever sees a half-upgraded
        # connection (h2c smuggling past a front proxy's rules).
        return 400, "protocol upgrades are not supported"
    if http_version not in (b"1.0", b"1.1"):
        return 505, "only HTTP/1.0 and HTTP/1.1 are supported"
    return head_problem(method, target, header_value(headers, b"host"), headers, limits)
