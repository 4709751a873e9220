"""SSEParser and encode: the WHATWG EventSource algorithm, limits, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import SSEEvent, SSEParser, SSEProtocolError, encode

BOM = b"\xef\xbb\xbf"


def parse(*feeds: bytes, **limits: int) -> tuple[list[SSEEvent], SSEParser]:
    parser = SSEParser(**limits)
    events: list[SSEEvent] = []
    for feed in feeds:
        events.extend(parser.feed(feed))
    events.extend(parser.close())
    return events, parser


def parse_bytewise(data: bytes) -> list[SSEEvent]:
    return parse(*(data[i:i + 1] for i in range(len(data))))[0]


D = SSEEvent  # short for the tables

CASES: list[tuple[str, bytes, list[SSEEvent]]] = [
    ("lf", b"data: a\n\n", [D("a")]),
    ("crlf", b"data: a\r\n\r\n", [D("a")]),
    ("cr", b"data: a\r\r", [D("a")]),
    ("mixed_line_ends", b"data: a\rdata: b\r\ndata: c\n\n", [D("a\nb\nc")]),
    ("multi_line_data_joined_with_lf", b"data: one\ndata: two\n\n", [D("one\ntwo")]),
    ("two_events", b"data: 1\n\ndata: 2\n\n", [D("1"), D("2")]),
    ("one_space_after_colon_removed", b"data:  two spaces\n\n", [D(" two spaces")]),
    ("no_space_after_colon", b"data:x\n\n", [D("x")]),
    ("field_without_colon_is_empty_value", b"data\n\n", [D("")]),
    ("empty_data_line_dispatches_empty", b"data:\n\n", [D("")]),
    ("two_empty_data_lines", b"data\ndata\n\n", [D("\n")]),
    ("event_type", b"event: ping\ndata: x\n\n", [D("x", event="ping")]),
    ("event_type_reset_after_dispatch", b"event: a\ndata: 1\n\ndata: 2\n\n", [D("1", event="a"), D("2")]),
    ("event_without_data_not_dispatched", b"event: lonely\n\n", []),
    ("id_field", b"id: 7\ndata: x\n\n", [D("x", id="7")]),
    ("id_only_is_kept", b"id: 7\n\n", [D(None, id="7")]),
    ("id_with_nul_ignored", b"id: a\x00b\ndata: x\n\n", [D("x")]),
    ("id_is_per_block_not_sticky", b"id: 1\ndata: a\n\ndata: b\n\n", [D("a", id="1"), D("b")]),
    ("empty_id", b"id\ndata: x\n\n", [D("x", id="")]),
    ("retry_digits", b"retry: 1500\ndata: x\n\n", [D("x", retry=1500)]),
    ("retry_only_is_kept", b"retry: 10\n\n", [D(None, retry=10)]),
    ("retry_non_digits_ignored", b"retry: 15s\ndata: x\n\n", [D("x")]),
    ("retry_negative_ignored", b"retry: -1\ndata: x\n\n", [D("x")]),
    ("retry_non_ascii_digits_ignored", "retry: \u0661\u0662\ndata: x\n\n".encode(), [D("x")]),
    ("retry_empty_ignored", b"retry:\ndata: x\n\n", [D("x")]),
    ("comment_surfaced", b": keepalive\n\n", [D(comment=" keepalive")]),
    ("comment_inside_event", b"data: a\n:c\ndata: b\n\n", [D(comment="c"), D("a\nb")]),
    ("empty_comment", b":\n\n", [D(comment="")]),
    ("unknown_field_ignored", b"foo: bar\ndata: x\n\n", [D("x")]),
    ("field_names_case_sensitive", b"Data: x\n\n", []),
    ("leading_bom_stripped", BOM + b"data: x\n\n", [D("x")]),
    ("second_bom_is_a_field_name", BOM + BOM + b"data: x\n\n", []),
    ("bom_in_later_event_kept", b"data: a\n\n" + BOM + b"data: b\n\n", [D("a")]),
    ("invalid_utf8_replaced", b"data: \xff\xfe\n\n", [D("\ufffd\ufffd")]),
    ("non_ascii", "data: é数据🙂\n\n".encode(), [D("é数据🙂")]),
    ("colon_in_value_kept", b'data: {"a":1}\n\n', [D('{"a":1}')]),
    ("unterminated_last_event_dropped", b"data: a\n\ndata: b\n", [D("a")]),
    ("unterminated_last_line_dropped", b"data: a\n\ndata: b", [D("a")]),
    ("nul_in_data_kept", b"data: a\x00b\n\n", [D("a\x00b")]),
    ("blank_lines_alone_dispatch_nothing", b"\n\n\r\n\r\r", []),
]


@pytest.mark.parametrize(("stream", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_when_fed_at_once_then_events_per_whatwg(stream: bytes, expected: list[SSEEvent]) -> None:
    assert parse(stream)[0] == expected


@pytest.mark.parametrize(("stream", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_when_fed_byte_by_byte_then_same_events(stream: bytes, expected: list[SSEEvent]) -> None:
    assert parse_bytewise(stream) == expected


@pytest.mark.parametrize(("feeds", "expected"), [
    ((b"data: a\r", b"\ndata: b\r\n\r\n"), [D("a\nb")]),  # CR | LF is one line end
    ((b"data: a\r", b"\r"), [D("a")]),  # CR | CR is two
    ((b"data: a\r\n\r", b"\n"), [D("a")]),
    ((b"data: a\r", b"", b"\n\n"), [D("a")]),  # an empty feed keeps the pending CR
    ((b"\xef", b"\xbb\xbfdata: x\n\n"), [D("x")]),
    ((b"\xef\xbb", b"\xbf", b"data: x\n\n"), [D("x")]),
    ((b"\xef", b"\xbb", b"\xbf", b"data: x\n\n"), [D("x")]),
    ((b"data: \xe6\x95", b"\xb0\n\n"), [D("数")]),  # a character split across feeds
], ids=["cr_lf_split", "cr_cr_split", "crlf_then_split_crlf", "empty_feed_between", "bom_1_2",
        "bom_2_1", "bom_1_1_1", "utf8_split"])
def test_parse_when_split_at_awkward_places_then_same_as_whole(feeds: tuple[bytes, ...],
                                                        expected: list[SSEEvent]) -> None:
    assert parse(*feeds)[0] == expected
    assert parse(b"".join(feeds))[0] == expected


def test_close_when_event_unterminated_then_discarded_bytes_counted() -> None:
    _, parser = parse(b"data: a\n\ndata: bcd\n")
    assert parser.discarded_bytes == len(b"data: bcd\n")
    _, parser = parse(b"data: a\n\ndata: b")
    assert parser.discarded_bytes == len(b"data: b")
    _, parser = parse(b"id: 3\n")
    assert parser.discarded_bytes >= 1


def test_close_when_stream_ended_cleanly_then_nothing_discarded() -> None:
    _, parser = parse(b"data: a\n\n: comment\n")
    assert parser.discarded_bytes == 0


def test_feed_after_close_raises() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(RuntimeError):
        parser.feed(b"data: x\n\n")


def test_in_event_tracks_partial_events() -> None:
    parser = SSEParser()
    assert not parser.in_event
    parser.feed(b"data: a\n")
    assert parser.in_event
    parser.feed(b"\n")
    assert not parser.in_event


# ------------------------------------------------------------------ limits


@pytest.mark.parametrize(("feeds", "limits"), [
    ((b"data: " + b"x" * 100 + b"\n\n",), {"max_line_bytes": 64}),
    ((b"data: " + b"x" * 100,), {"max_line_bytes": 64}),  # no line end yet
    (tuple(b"x" for _ in range(100)), {"max_line_bytes": 64}),  # across many small feeds
    ((b"data: 1\n\n", b": " + b"c" * 80 + b"\r"), {"max_line_bytes": 64}),
    (((b"data: " + b"x" * 50 + b"\n") * 3 + b"\n",), {"max_line_bytes": 64, "max_event_bytes": 120}),
    (tuple(b"data: " + b"x" * 50 + b"\n" for _ in range(3)), {"max_line_bytes": 64,
                                                             "max_event_bytes": 120}),
], ids=["line_in_one_feed", "unterminated_line", "line_across_feeds", "comment_line",
        "event_in_one_feed", "event_across_feeds"])
def test_feed_when_over_size_limits_then_sse_protocol_error(feeds: tuple[bytes, ...],
                                                      limits: dict[str, int]) -> None:
    parser = SSEParser(**limits)
    with pytest.raises(SSEProtocolError) as raised:
        for feed in feeds:
            parser.feed(feed)
    assert raised.value.code.value == "invalid_stream"


def test_feed_when_line_exactly_at_limit_then_accepted() -> None:
    line = b"data: " + b"x" * 58
    assert len(line) == 64
    assert parse(line + b"\n\n", max_line_bytes=64)[0] == [D("x" * 58)]


def test_feed_when_line_too_long_across_feeds_then_buffer_never_grows_past_limit() -> None:
    parser = SSEParser(max_line_bytes=1000)
    with pytest.raises(SSEProtocolError):
        for _ in range(2000):
            parser.feed(b"y")
            assert len(parser._buffer) <= 1000


@pytest.mark.parametrize("limits", [{"max_line_bytes": 0}, {"max_event_bytes": -1}])
def test_parser_when_limits_not_positive_then_value_error(limits: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SSEParser(**limits)


# ------------------------------------------------------------------ encode


@pytest.mark.parametrize(("event", "wire"), [
    (D("x"), b"data: x\n\n"),
    (D("a\nb"), b"data: a\ndata: b\n\n"),
    (D(""), b"data: \n\n"),
    (D("x", event="e", id="1", retry=5), b"event: e\ndata: x\nid: 1\nretry: 5\n\n"),
    (D(None, id="9"), b"id: 9\n\n"),
    (D(comment=" keepalive"), b": keepalive\n\n"),
    (D("é"), "data: é\n\n".encode()),
])
def test_encode_writes_wire_bytes(event: SSEEvent, wire: bytes) -> None:
    assert encode(event) == wire
    assert parse(wire)[0] == [event]


@pytest.mark.parametrize("kwargs", [
    {"data": "a\rb"}, {"event": "a\nb"}, {"id": "a\nb"}, {"id": "a\x00b"}, {"retry": -1},
    {"comment": "x", "data": "y"}, {"comment": "a\nb"},
])
def test_event_when_not_representable_then_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SSEEvent(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ properties

line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"))
data_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"))


@st.composite
def parser_events(draw: st.DrawFn) -> SSEEvent:
    """Any event the parser can produce."""
    if draw(st.integers(0, 5)) == 0:
        return SSEEvent(comment=draw(line_text))
    data = draw(st.none() | data_text)
    ident = draw(st.none() | line_text.filter(lambda s: "\0" not in s))
    retry = draw(st.none() | st.integers(0, 10**12))
    if data is None and ident is None and retry is None:
        data = ""
    event = draw(st.none() | line_text)
    return SSEEvent(data=data, event=event, id=ident, retry=retry)


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@settings(deadline=None, max_examples=300)
@given(st.lists(parser_events(), max_size=8), st.data())
def test_encode_then_feed_round_trips_every_parser_event(events: list[SSEEvent], data: st.DataObject) -> None:
    wire = b"".join(encode(e) for e in events)
    assert parse(*data.draw(splits(wire)))[0] == events


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=300) | st.lists(st.sampled_from(
    [b"data: ", b"data", b":", b"\r", b"\n", b"\r\n", b"id: ", b"retry: 12", b"event: x", BOM, b"x",
     b"\x00", b"\xe6\x95\xb0", b"\xff"]), max_size=40).map(b"".join), st.data())
def test_feed_when_split_anywhere_then_same_events(stream: bytes, data: st.DataObject) -> None:
    whole, whole_parser = parse(stream)
    split, split_parser = parse(*data.draw(splits(stream)))
    assert split == whole
    assert split_parser.discarded_bytes == whole_parser.discarded_bytes


@settings(deadline=None, max_examples=300)
@given(st.lists(st.binary(max_size=64) | st.sampled_from([b"\n", b"\r", b"data: ", b":"]), max_size=60))
def test_feed_when_random_bytes_then_only_sse_protocol_error_and_bounded_memory(feeds: list[bytes]) -> None:
    parser = SSEParser(max_line_bytes=48, max_event_bytes=96)
    try:
        for feed in feeds:
            for event in parser.feed(feed):
                # The cap is on the bytes received: each becomes at most one
                # character (an invalid one U+FFFD, three bytes re-encoded).
                assert event.data is None or len(event.data) <= 96
            assert len(parser._buffer) <= 48
            assert parser._data_bytes <= 96
        parser.close()
    except SSEProtocolError:
        pass


def test_llamacpp_error_field_becomes_an_error_payload() -> None:
    """llama.cpp's ``error:`` field (then ``data: [DONE]``) must not vanish: a
    failed answer would look complete."""
    parser = SSEParser()
    events = parser.feed(b'error: {"code":500,"message":"too big"}\n\ndata: [DONE]\n\nerror: plain\n\n')
    assert [e.data for e in events] == ['{"error":{"code":500,"message":"too big"}}', "[DONE]",
                                        '{"error":"plain"}']
    assert events[0].event is None  # `event: error` stays an app's own named event
