"""PendingBuffer: which chunks merge, which are barriers, and what the merge writes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import SSEEvent, encode
from tokenwire.middleware.pending import PendingBuffer

from .wire_harness import chunk, completion_chunk, parse_all, texts


def buffer_of(*datas: str | SSEEvent, merge: bool = True, drop: bool = False) -> PendingBuffer:
    buffer = PendingBuffer(merge=merge, drop=drop)
    for data in datas:
        event = data if isinstance(data, SSEEvent) else SSEEvent(data)
        buffer.add_event(event, encode(event))
    return buffer


MERGES = [
    ("content", chunk("a"), chunk("b"), "content"),
    ("reasoning", chunk("a", field="reasoning_content"), chunk("b", field="reasoning_content"),
     "reasoning_content"),
    ("completions_text", completion_chunk("a"), completion_chunk("b"), "text"),
    ("created_differs", chunk("a"), chunk("b", extra={"created": 2}), "content"),
    ("null_fields_allowed", chunk("a", extra_delta={"role": None, "tool_calls": None}), chunk("b"),
     "content"),
    ("usage_null", chunk("a", extra={"usage": None}), chunk("b", extra={"usage": None}), "content"),
    ("spaced_json", json.dumps(json.loads(chunk("a"))), json.dumps(json.loads(chunk("b"))), "content"),
    ("ascii_escaped_json", json.dumps(json.loads(chunk("é"))), json.dumps(json.loads(chunk("数"))),
     "content"),
]


@pytest.mark.parametrize(("first", "second", "field"), [m[1:] for m in MERGES], ids=[m[0] for m in MERGES])
def test_merge_whenTextOnlyChunksOfSameIdAndChoice_thenOneChunkWithConcatenatedText(
        first: str, second: str, field: str) -> None:
    buffer = buffer_of(first, second)
    data, count = buffer.take()
    events = parse_all(data)
    assert count == 1 and len(events) == 1
    assert texts(events, field) == texts([SSEEvent(first), SSEEvent(second)], field)
    merged = json.loads(events[0].data or "")
    original = json.loads(first)
    # Everything but the text is the first chunk's.
    holder = merged["choices"][0].get("delta", merged["choices"][0])
    holder.pop(field)
    original_holder = original["choices"][0].get("delta", original["choices"][0])
    original_holder.pop(field)
    assert merged == original
    assert buffer.coalesced_events == 1


BARRIERS = [
    ("different_field", chunk("a"), chunk("b", field="reasoning_content")),
    ("different_id", chunk("a"), chunk("b", ident="chatcmpl-2")),
    ("different_choice", chunk("a"), chunk("b", index=1)),
    ("role_first", chunk(role="assistant", text=""), chunk("b")),
    ("role_second", chunk("a"), chunk(role="assistant", text="b")),
    ("tool_calls", chunk("a"), chunk(extra_delta={"tool_calls": [{"index": 0}]})),
    ("tool_calls_with_content", chunk("a"), chunk("b", extra_delta={"tool_calls": [{"index": 0}]})),
    ("finish_reason", chunk("a"), chunk("b", finish="stop")),
    ("usage", chunk("a"), chunk("b", usage={"total_tokens": 1})),
    ("logprobs", chunk("a"), chunk("b", logprobs={"content": []})),
    ("unknown_top_level_key", chunk("a"), chunk("b", extra={"x_custom": 1})),
    ("unknown_delta_key", chunk("a"), chunk("b", extra_delta={"audio": {"id": "x"}})),
    ("two_choices", chunk("a"), json.dumps({"id": "chatcmpl-1", "choices": [
        {"index": 0, "delta": {"content": "b"}}, {"index": 1, "delta": {"content": "c"}}]})),
    ("non_json", chunk("a"), "plain text"),
    ("invalid_json", chunk("a"), '{"id": "chatcmpl-1", "choices": [' ),
    ("done", chunk("a"), "[DONE]"),
    ("named_event", chunk("a"), SSEEvent(chunk("b"), event="delta")),
    ("retry_field", chunk("a"), SSEEvent(chunk("b"), retry=5)),
    ("non_string_text", chunk("a"), chunk(None, extra_delta={"content": 5})),
    ("completion_vs_chat", completion_chunk("a", ident="chatcmpl-1"), chunk("b")),
]


@pytest.mark.parametrize(("first", "second"), [b[1:] for b in BARRIERS], ids=[b[0] for b in BARRIERS])
def test_merge_whenAnythingButTextOfSameKey_thenBarrierKeptAsItsOwnEvent(
        first: str, second: str | SSEEvent) -> None:
    buffer = buffer_of(first, second)
    data, count = buffer.take()
    second_event = second if isinstance(second, SSEEvent) else SSEEvent(second)
    assert data == encode(SSEEvent(first)) + encode(second_event)
    assert count == 2 and buffer.coalesced_events == 0


def test_merge_whenBarrierBetween_thenNeverMergedAcross() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), chunk(finish="stop"), chunk("c"), chunk("d"))
    events = parse_all(buffer.take()[0])
    assert [texts([e]) for e in events] == ["ab", "", "cd"]


def test_merge_whenSurrogatePairSplitAcrossChunks_thenJoinedExactly() -> None:
    first = chunk("x").replace('"x"', '"\\ud83d"')
    second = chunk("x").replace('"x"', '"\\ude42"')
    data, _ = buffer_of(first, second).take()
    data.decode("utf-8")  # valid UTF-8 on the wire
    assert texts(parse_all(data)) == "🙂"


def test_merge_whenLoneSurrogateEscapeOnSlowPath_thenStillValidUtf8() -> None:
    first = json.dumps(json.loads(chunk("a")), indent=None).replace('"a"', '"\\ud83d"')
    second = chunk("b", extra={"created": 9})  # another shape: the re-serialising path
    data, _ = buffer_of(first, second).take()
    data.decode("utf-8")
    assert json.loads(parse_all(data)[0].data or "")["choices"][0]["delta"]["content"] == "\ud83db"


def test_merge_whenNewestHasId_thenMergedEventKeepsNewestId() -> None:
    buffer = buffer_of(SSEEvent(chunk("a"), id="1"), SSEEvent(chunk("b"), id="2"))
    events = parse_all(buffer.take()[0])
    assert [(e.id, texts([e])) for e in events] == [("2", "ab")]


def test_merge_whenMergeOff_thenEverythingKept() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), merge=False)
    assert buffer.take()[1] == 2


def test_drop_whenSameEventType_thenNewestReplacesButNotDroppables() -> None:
    buffer = PendingBuffer(merge=False, drop=True)
    for e in (SSEEvent("1", event="p"), SSEEvent("x"), SSEEvent("2", event="p"), SSEEvent("y")):
        buffer.add_event(e, encode(e))
    done = SSEEvent("[DONE]")
    buffer.add_event(done, encode(done), droppable=False)
    buffer.add_event(SSEEvent("z"), encode(SSEEvent("z")))
    buffer.add_bytes(b": keepalive\n\n")
    data, count = buffer.take()
    assert [e.data for e in parse_all(data) if e.comment is None] == ["2", "[DONE]", "z"]
    assert buffer.dropped_events == 3 and count == 3


def test_pendingBytes_whenAddedAndTaken_thenMatchesBytesWritten() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), chunk(finish="stop"))
    buffer.add_bytes(b": keepalive\n\n")
    size = buffer.pending_bytes
    data, _ = buffer.take()
    assert size == len(data)
    assert buffer.pending_bytes == 0 and not buffer
    assert buffer.take() == (b"", 0)


def test_clear_forgetsEverything() -> None:
    buffer = buffer_of(chunk("a"), "x")
    buffer.clear()
    assert buffer.pending_bytes == 0 and buffer.take() == (b"", 0)


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)


@settings(deadline=None, max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["content", "reasoning", "role", "choice1", "finish"]), TEXT),
                max_size=20), st.booleans())
def test_property_mergedTextEqualsConcatenationAndSizeIsExact(pieces: list[tuple[str, str]],
                                                             spaced: bool) -> None:
    buffer = PendingBuffer(merge=True, drop=False)
    datas = []
    for kind, text in pieces:
        data = {"content": lambda t: chunk(t), "reasoning": lambda t: chunk(t, field="reasoning_content"),
                "role": lambda t: chunk(role="assistant", text=t), "choice1": lambda t: chunk(t, index=1),
                "finish": lambda t: chunk(t, finish="stop")}[kind](text)
        if spaced:
            data = json.dumps(json.loads(data))  # another formatting, \\u escapes for non-ASCII
        datas.append(data)
        buffer.add_event(SSEEvent(data), encode(SSEEvent(data)))
    size = buffer.pending_bytes
    data, count = buffer.take()
    events = parse_all(data)
    originals = [SSEEvent(d) for d in datas]
    assert size == len(data)
    assert count == len(events) == len(datas) - buffer.coalesced_events
    for field in ("content", "reasoning_content"):
        assert texts(events, field) == texts(originals, field)
    assert [json.loads(e.data or "")["choices"][0].get("finish_reason") for e in events].count("stop") == \
        [k for k, _ in pieces].count("finish")
