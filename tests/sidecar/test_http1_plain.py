"""``http1_plain`` reads a request exactly as h11 reads it, or leaves it to h11.

The same bytes go to :func:`read_head` and to a fresh h11 server connection:
whatever ``read_head`` reads (not declined) h11 must read the same way (method,
target, version, the lower-cased stripped fields in order), with the same body
and the same bytes left over, no 100-continue and keep-alive; and a response
written the plain way (:func:`plain_response_head`, chunks, :data:`CHUNKED_END`)
must be h11's own bytes, leaving h11 ready for the next request. A request
``read_head`` declines is served through h11 as before, so declining is always
safe; the explicit cases below hold it to reading what clients really send.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.downstream.framing import request_line_problem
from tokenwire.sidecar.downstream.h11_layout import CHUNKED_END, chunk_size_line, plain_response_head
from tokenwire.sidecar.downstream.http1_faults import framing_problem
from tokenwire.sidecar.downstream.http1_plain import adopted, read_head

Header = tuple[bytes, bytes]
MAX_HEAD_BYTES = 16 * 1024

# Each list: what a plain request may hold, then what it may not (or h11 reads otherwise).
_METHODS = ([b"GET", b"POST", b"HEAD", b"OPTIONS", b"DELETE", b"get"],
            [b"CONNECT", b"P@ST", b"", b"PO ST"])
_TARGETS = ([b"/", b"/v1/chat/completions", b"/v1/streams/abc?tokenwire_frames=open", b"*", b"http://h/x",
             b"/%0a", b"/a~b"],
            [b"/a b", b"/\x80", b"/\x7f", b""])
_VERSIONS = ([b"HTTP/1.1"], [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b"HTTP/1.11"])
_NAMES = ([b"Content-Type", b"Authorization", b"Accept", b"X-Request-Id", b"TE", b"x_y", b"A~b", b"Host",
           b"Connection", b"connection"],
          [b"Transfer-Encoding", b"Expect", b"Upgrade", b"x foo", b"", b"x\x00y",
           b" leading", b"\tfold", b"Content-Length", b"HOST"])
_VALUES = ([b"application/json", b"Bearer sk-x", b"a, b;q=0.5", b"", b"\x01\x7f\x80\xff", b"  padded\t",
            b"in  ner\tx", b"chunked", b"close", b"keep-alive", b"Keep-Alive", b"keep-alive, close"],
           [b"a\x00b", b"a\rb", b"a\nb", b"a\x0bb", b"a\x0cb"])
_COLONS = ([b": ", b":", b":\t", b":  "], [b" : ", b" :", b"", b" "])
_LINE_ENDS = ([b"\r\n"], [b"\n", b"\r", b"\r\r\n"])
_LENGTHS = ([b"%d"], [b"%d, %d", b"+%d", b"%d %d", b"1" * 21 + b"%d", b"x%d"])
_AFTER = [b"", b"", b"GET / HTTP/1.1\r\nhost: h\r\n\r\n", b"garbage", b"\r\n"]


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """A request, mostly plain: each part is drawn from what a plain request may
    hold, and at ~3 % of the draws from what it may not."""
    def pick(choices: tuple[list[bytes], list[bytes]]) -> bytes:
        good, bad = choices
        return draw(st.sampled_from(bad if draw(st.integers(0, 32)) == 0 else good))

    lines = [pick(_METHODS) + b" " + pick(_TARGETS) + b" " + pick(_VERSIONS)]
    if draw(st.integers(0, 16)):
        lines.append(draw(st.sampled_from([b"Host", b"host"])) + pick(_COLONS) + b"sidecar")
    body = draw(st.binary(max_size=24))
    if draw(st.booleans()):
        length = len(body) + draw(st.sampled_from([0, 0, 0, -1, 3]))
        lines.append(b"Content-Length" + pick(_COLONS) + pick(_LENGTHS).replace(b"%d", b"%d" % length))
    for _ in range(draw(st.integers(0, 5))):
        lines.insert(draw(st.integers(1, len(lines))), pick(_NAMES) + pick(_COLONS) + pick(_VALUES))
    raw = b"".join(line + pick(_LINE_ENDS) for line in lines) + pick(_LINE_ENDS)
    prefix = draw(st.sampled_from([b""] * 8 + [b"\r\n"]))
    return prefix + raw + body[:draw(st.integers(0, len(body)))] + draw(st.sampled_from(_AFTER))


def _h11_read(raw: bytes) -> tuple[h11.Connection, list[object]]:
    """What h11 reads of ``raw`` as a server: its events until it needs more."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.receive_data(raw)
    events: list[object] = []
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as error:
            events.append(error)
            return conn, events
        events.append(event)
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.EndOfMessage):
            return conn, events


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
@settings(max_examples=1200, deadline=None)
@given(raw=_requests(),
       status=st.sampled_from([200, 200, 201, 204, 304, 400, 404, 429, 500, 502, 503]),
       headers=st.lists(st.sampled_from([
           (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
           (b"x-request-id", b"abc"), (b"Content-Length", b"5"), (b"connection", b"close"),
           (b"transfer-encoding", b"chunked"), (b"x-bad", b"a\r\nb"), (b"bad name", b"v")]), max_size=4),
       chunks=st.lists(st.binary(min_size=1, max_size=8), max_size=3))
def test_a_plain_request_is_read_as_h11_reads_it_and_answered_with_h11s_bytes(
        raw: bytes, status: int, headers: list[Header], chunks: list[bytes]) -> None:
    head = read_head(raw)
    if head is None:
        return  # h11 reads it: nothing of this module's is involved
    # What a plain head skips: its request line and framing checks (none can fail).
    assert request_line_problem(raw) is None
    assert framing_problem(raw) is None
    conn, events = _h11_read(raw)
    request = events[0]
    assert isinstance(request, h11.Request), events
    assert (request.method, request.target, request.http_version, list(request.headers)) == (
        head.method, head.target, b"1.1", head.headers)
    assert all(type(part) is bytes for header in head.headers for part in header)
    assert not conn.they_are_waiting_for_100_continue
    body = b"".join(bytes(event.data) for event in events if isinstance(event, h11.Data))
    available = raw[head.head_bytes:]
    assert body == available[:head.body_bytes]
    if len(available) < head.body_bytes:
        assert events[-1] is h11.NEED_DATA
        return
    assert isinstance(events[-1], h11.EndOfMessage), events
    after = available[head.body_bytes:]
    assert conn.trailing_data == (after, False)
    again = adopted(MAX_HEAD_BYTES, raw[:head.head_bytes + head.body_bytes], after)
    assert (again.our_state, again.their_state, again.trailing_data) == (h11.SEND_RESPONSE, h11.DONE,
                                                                         (after, False))
    plain = plain_response_head(status, headers)
    if plain is None or head.method == b"HEAD":
        return  # h11 writes that response
    assert conn.send(h11.Response(status_code=status, headers=headers)) == plain
    for chunk in chunks:
        assert conn.send(h11.Data(data=chunk)) == chunk_size_line(len(chunk)) + chunk + b"\r\n"
    assert conn.send(h11.EndOfMessage()) == CHUNKED_END
    assert (conn.our_state, conn.their_state) == (h11.DONE, h11.DONE)  # keep-alive, as plain serves it
    conn.start_next_cycle()


@pytest.mark.parametrize("raw", [
    # httpx's request (openai-python, anthropic-sdk-python, litellm, LangChain), as captured
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\n"
    b"Accept: application/json\r\nContent-Type: application/json\r\nUser-Agent: OpenAI/Python 1.99.0\r\n"
    b"Authorization: Bearer sk-test\r\nX-Stainless-Retry-Count: 0\r\nContent-Length: 2\r\n\r\n{}",
    # undici's (openai-node, the Vercel AI SDK), curl's
    b"POST /v1/messages HTTP/1.1\r\nhost: localhost:8000\r\nconnection: keep-alive\r\n"
    b"content-type: application/json\r\n"
    b"anthropic-version: 2023-06-01\r\naccept: */*\r\nuser-agent: node\r\nsec-fetch-mode: cors\r\n"
    b"content-length: 2\r\n\r\n{}",
    b"GET /v1/streams/0123?tokenwire_frames=open,done HTTP/1.1\r\nHost: sidecar\r\nUser-Agent: curl/8.5.0"
    b"\r\nAccept: text/event-stream\r\nLast-Event-ID: 0123.5\r\n\r\n",
])
def test_what_clients_send_is_plain(raw: bytes) -> None:
    head = read_head(raw)
    assert head is not None
    assert head.head_bytes + head.body_bytes == len(raw)
    assert request_line_problem(raw) is None and framing_problem(raw) is None


@settings(max_examples=300, deadline=None)
@given(raw=_requests())
def test_a_plain_head_needs_neither_the_request_line_nor_the_framing_check(raw: bytes) -> None:
    """``http1.py`` serves a head ``read_head`` reads without those two checks
    (the quick run's share of the slow property test's assertion)."""
    if read_head(raw) is not None:
        assert request_line_problem(raw) is None
        assert framing_problem(raw) is None


@pytest.mark.parametrize("raw", [
    b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, Upgrade\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: h\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
    b"GET / HTTP/1.1\r\nHost: h\r\n",  # not whole yet
])
def test_what_changes_h11s_state_or_is_incomplete_is_left_to_h11(raw: bytes) -> None:
    assert read_head(raw) is None
