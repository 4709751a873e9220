"""``upstream/head.py``: the upstream request written and the response head read as h11 does.

The sidecar speaks HTTP/1.1 to its pods itself; h11 stays the judge. Hypothesis
builds response heads from the grammar's pieces and from bytes that break it
(bare CR, NUL, VT, obs-fold, spaces before the colon, conflicting framing
headers, missing status lines), and the parse must agree with h11 reading the
same bytes as a client: refused by both, or the same status, version and
headers (names lower-cased, framing values as h11 normalises them).
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.upstream.errors import LocalProtocolFault, RemoteProtocolFault
from tokenwire.sidecar.upstream.head import (
    CHUNKED,
    NO_BODY,
    head_end,
    parse_response_head,
    request_head,
)

Header = tuple[bytes, bytes]

_VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1", b"http/1.1", b"HTTP/1.1 "])
_STATUSES = st.sampled_from([b"200", b"101", b"103", b"204", b"304", b"404", b"099", b"20", b"2000", b"abc"])
_REASON = st.sampled_from([b"", b" OK", b" Not Found", b" x\ty", b" \x80\xff", b" a\x0bb", b" a\x00b",
                           b" a\rb"])
_NAMES = st.sampled_from([b"content-type", b"Content-Length", b"transfer-encoding", b"Transfer-Encoding",
                          b"connection", b"x-a", b"X-B", b"x a", b"", b"x\x00", b"x:y"])
_VALUES = st.sampled_from([b"text/event-stream", b"5", b"05", b"5, 5", b"5,6", b" 7 ", b"-1", b"1" * 21,
                           b"chunked", b"Chunked", b"gzip", b"gzip, chunked", b"close", b"keep-alive, Close",
                           b"", b" ", b"a\tb", b"a\x0bb", b"\x80", b"a\rb", b"a\x00b"])
_SEPARATORS = st.sampled_from([b": ", b":", b":\t", b" : ", b": \t"])
_ENDINGS = st.sampled_from([b"\r\n", b"\n"])


@st.composite
def _heads(draw: st.DrawFn) -> bytes:
    end = draw(_ENDINGS)
    lines = [draw(_VERSIONS) + b" " + draw(_STATUSES) + draw(_REASON)]
    if draw(st.booleans()):
        lines = [b""] if draw(st.booleans()) else []  # a blank first line, or nothing
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.sampled_from([b" folded", b"\tfolded", b"no colon", b"  "])))
        else:
            lines.append(draw(_NAMES) + draw(_SEPARATORS) + draw(_VALUES))
    return b"".join(line + end for line in lines) + draw(_ENDINGS)


def _h11_reads(head: bytes, method: bytes) -> tuple[int, bytes, list[Header]] | None:
    """What h11, as the client of a ``method`` request, makes of ``head``; None if it refuses it."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"x")]))
    connection.send(h11.EndOfMessage())
    connection.receive_data(head)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    assert isinstance(event, (h11.Response, h11.InformationalResponse)), event
    headers = [(name.lower(), value) for name, value in event.headers.raw_items()]
    return event.status_code, event.http_version, headers


def _ours(head: bytes, method: bytes) -> tuple[int, bytes, list[Header]] | None:
    end = head_end(head)
    # A whole head ends where the strategy ended it, or at a blank first line.
    assert end == len(head) or head[:end] in (b"\n", b"\r\n")
    try:
        parsed = parse_response_head(head[:end], method)
    except RemoteProtocolFault:
        return None
    return parsed.status, parsed.http_version, list(parsed.headers)


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
@settings(max_examples=3000, deadline=None)
@given(_heads(), st.sampled_from([b"GET", b"POST", b"HEAD"]))
@example(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\ncontent-length: 5\r\n\r\n", b"POST")
@example(b"HTTP/1.1 200 OK\r\nx-a: one\r\n two\r\n\r\n", b"POST")
@example(b"HTTP/1.1 200 OK\r\n folded\r\n\r\n", b"POST")
@example(b"HTTP/1.1 200\r\n\r\n", b"POST")
@example(b"HTTP/1.1 200 \r\n\r\n", b"POST")
@example(b"\r\n", b"POST")
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n", b"POST")
@example(b"HTTP/1.1 200 OK\r\nx-a: a\rb\r\n\r\n", b"POST")
def test_the_response_head_is_read_as_h11_reads_it(head: bytes, method: bytes) -> None:
    assert _ours(head, method) == _h11_reads(head, method)


def test_the_heads_end_is_found_wherever_the_reads_cut_it() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    assert head_end(head) == len(head) - 2
    assert head_end(b"HTTP/1.1 200 OK\n\nok") == len(b"HTTP/1.1 200 OK\n\n")
    assert head_end(b"HTTP/1.1 200 OK\r\n\r") == -1  # the rest may come
    for cut in range(len(head) - 2):
        assert head_end(head[:cut]) == -1
        # Looking again from where the last look ended, less two, finds it as a whole look does.
        assert head_end(head, max(0, cut - 2)) == len(head) - 2


@pytest.mark.parametrize(("head", "method", "framing", "keep_alive"), [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"POST", CHUNKED, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n", b"POST", 12, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\ntransfer-encoding: chunked\r\n\r\n", b"POST", CHUNKED, True),
    (b"HTTP/1.1 200 OK\r\n\r\n", b"POST", None, False),  # to the close: never reused
    (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n", b"HEAD", NO_BODY, True),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b"POST", NO_BODY, True),
    (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n", b"GET", NO_BODY, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive, Close\r\n\r\n", b"POST", 2, False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n", b"POST", 2, False),
])
def test_the_head_says_how_the_body_ends_and_whether_the_connection_stays(
        head: bytes, method: bytes, framing: object, keep_alive: bool) -> None:
    parsed = parse_response_head(head, method)
    assert (parsed.framing, parsed.keep_alive) == (framing, keep_alive)


def _h11_writes(method: bytes, target: bytes, headers: list[Header], body: bytes) -> bytes:
    connection = h11.Connection(h11.CLIENT)
    out = connection.send(h11.Request(method=method, target=target, headers=headers)) or b""
    if body:
        out += connection.send(h11.Data(data=body)) or b""
    return out + (connection.send(h11.EndOfMessage()) or b"")


_HEADER_BYTES = st.sampled_from([*b"aZ09-_.~!|", *b" \t\n\r\x00\x7f\x80:"])


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from([b"POST", b"GET", b"P0ST", b"PO ST", b""]),
       st.sampled_from([b"/v1/chat/completions", b"/a?b=c", b"/a b", b"/\x7f", b"", b"*"]),
       st.lists(st.tuples(st.lists(_HEADER_BYTES, min_size=1, max_size=4).map(bytes),
                          st.lists(_HEADER_BYTES, max_size=4).map(bytes)), max_size=3),
       st.binary(max_size=8))
def test_the_request_head_is_the_bytes_h11_writes_or_refused_as_h11_refuses(
        method: bytes, target: bytes, headers: list[Header], body: bytes) -> None:
    headers = [(name, value) for name, value in headers
               if name.lower() not in (b"host", b"content-length", b"transfer-encoding")]
    complete = [(b"Host", b"pod:8000"), *headers, (b"Content-Length", b"%d" % len(body))]
    try:
        expected: bytes | None = _h11_writes(method, target, complete, body)
    except h11.LocalProtocolError:
        expected = None
    try:
        ours: bytes | None = request_head(method, target, b"pod:8000", headers, body)
    except LocalProtocolFault:
        ours = None
    assert ours == expected


def test_the_request_head_keeps_a_given_host_and_refuses_what_frames_the_body_wrongly() -> None:
    head = request_head(b"GET", b"/", b"pod", [(b"host", b"given"), (b"content-length", b"0")], b"")
    assert head == b"GET / HTTP/1.1\r\nhost: given\r\ncontent-length: 0\r\n\r\n"
    with pytest.raises(LocalProtocolFault, match="multiple Host"):
        request_head(b"GET", b"/", b"pod", [(b"host", b"a"), (b"Host", b"b")], b"")
    with pytest.raises(LocalProtocolFault, match="not the body's"):
        request_head(b"POST", b"/", b"pod", [(b"content-length", b"3")], b"{}")
    with pytest.raises(LocalProtocolFault, match="Content-Length"):
        request_head(b"POST", b"/", b"pod", [(b"transfer-encoding", b"chunked")], b"{}")
