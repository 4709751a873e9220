"""What is wrong with an HTTP/1.1 request, in words: faults h11 lets through
that an edge proxy must refuse, and h11's own refusals said for the client."""

from __future__ import annotations

import h11


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
    if b"\n " in head or b"\n\t" in head:
        return "obsolete line folding in the request head"
    lowered = head.lower()
    at = lowered.find(b"\ncontent-length:")
    if at != -1 and (lowered.find(b"\ncontent-length:", at + 1) != -1
                     or b"," in lowered[at:lowered.find(b"\r", at + 1)]):
        return "more than one Content-Length"
    return None


# What h11's messages say, in words for the client (they may quote the bytes
# as a Python repr, which names nothing a client can act on).
H11_FAULTS = (
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
