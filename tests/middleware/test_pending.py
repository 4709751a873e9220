"""PendingBuffer: which chunks merge, which are barriers, and what the merge writes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import SSEEvent, encode
from tokenwire.middleware.core.pending import PendingBuffer

from .wire_harness import chunk, completion_chunk, parse_all, texts, tool_args


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
def test_merge_when_text_only_chunks_of_same_id_and_choice_then_one_chunk_with_concatenated_text(
        first: str, second: str, field: str) -> None:
    buffer = buffer_of(first, second)
    data, count = buffer.take()
    events = parse_all(data)
    assert count == 1 and len(events) == 1
    assert texts(events, field) == texts([SSEEvent(first), SSEEvent(second)], field)
    merged = json.loads(events[0].data or "")
    newest = json.loads(second)
    # Everything but the text is the newest chunk's (what may differ carries no content).
    holder = merged["choices"][0].get("delta", merged["choices"][0])
    holder.pop(field)
    newest_holder = newest["choices"][0].get("delta", newest["choices"][0])
    newest_holder.pop(field)
    assert merged == newest
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
    ("model_differs", chunk("a"), chunk("b", extra={"model": "other"})),
    ("fingerprint_differs", chunk("a", extra={"system_fingerprint": "x"}),
     chunk("b", extra={"system_fingerprint": "y"})),
    ("tool_call_first_chunk", tool_args("{"),
     chunk(extra_delta={"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})),
    ("tool_call_other_index", tool_args("{", call=0), tool_args("}", call=1)),
    ("tool_call_with_text", tool_args("{"), tool_args("}", extra_delta={"content": "x"})),
    ("two_tool_calls", tool_args("{"), chunk(extra_delta={"tool_calls": [
        {"index": 0, "function": {"arguments": "a"}}, {"index": 1, "function": {"arguments": "b"}}]})),
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
def test_merge_when_anything_but_text_of_same_key_then_barrier_kept_as_its_own_event(
        first: str, second: str | SSEEvent) -> None:
    buffer = buffer_of(first, second)
    data, count = buffer.take()
    second_event = second if isinstance(second, SSEEvent) else SSEEvent(second)
    assert data == encode(SSEEvent(first)) + encode(second_event)
    assert count == 2 and buffer.coalesced_events == 0


def test_merge_when_barrier_between_then_never_merged_across() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), chunk(finish="stop"), chunk("c"), chunk("d"))
    events = parse_all(buffer.take()[0])
    assert [texts([e]) for e in events] == ["ab", "", "cd"]


def test_merge_when_surrogate_pair_split_across_chunks_then_joined_exactly() -> None:
    first = chunk("x").replace('"x"', '"\\ud83d"')
    second = chunk("x").replace('"x"', '"\\ude42"')
    data, _ = buffer_of(first, second).take()
    data.decode("utf-8")  # valid UTF-8 on the wire
    assert texts(parse_all(data)) == "🙂"


def test_merge_when_lone_surrogate_escape_on_slow_path_then_still_valid_utf8() -> None:
    first = json.dumps(json.loads(chunk("a")), indent=None).replace('"a"', '"\\ud83d"')
    second = chunk("b", extra={"created": 9})  # another shape: the re-serialising path
    data, _ = buffer_of(first, second).take()
    data.decode("utf-8")
    assert json.loads(parse_all(data)[0].data or "")["choices"][0]["delta"]["content"] == "\ud83db"


def test_merge_when_newest_has_id_then_merged_event_keeps_newest_id() -> None:
    buffer = buffer_of(SSEEvent(chunk("a"), id="1"), SSEEvent(chunk("b"), id="2"))
    events = parse_all(buffer.take()[0])
    assert [(e.id, texts([e])) for e in events] == [("2", "ab")]


def test_merge_when_merge_off_then_everything_kept() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), merge=False)
    assert buffer.take()[1] == 2


def test_drop_when_listed_event_type_then_newest_replaces_and_the_reader_is_told() -> None:
    buffer = PendingBuffer(merge=True, drop=True, droppable_types=frozenset({"p"}))
    for e in (SSEEvent("1", event="p"), SSEEvent("x"), SSEEvent("2", event="p"), SSEEvent("3", event="p"),
              SSEEvent("y"), SSEEvent("s1", event="status"), SSEEvent("s2", event="status")):
        buffer.add_event(e, encode(e))
    done = SSEEvent("[DONE]")
    buffer.add_event(done, encode(done), droppable=False)
    size = buffer.pending_bytes
    data, count = buffer.take()
    assert size == len(data)
    events = [(e.event, e.data) for e in parse_all(data)]
    # Unnamed events (answer text) and unlisted types are never dropped.
    assert events == [(None, "x"), ("tokenwire.dropped", '{"dropped":2}'), ("p", "3"), (None, "y"),
                      ("status", "s1"), ("status", "s2"), (None, "[DONE]")]
    assert buffer.dropped_events == 2 and count == 6


def test_drop_when_openai_chunks_then_text_merges_and_nothing_is_lost() -> None:
    buffer = PendingBuffer(merge=True, drop=True, droppable_types=frozenset({"p"}))
    for text in "abc":
        buffer.add_event(SSEEvent(chunk(text)))
    data, _ = buffer.take()
    assert texts(parse_all(data)) == "abc" and buffer.dropped_events == 0


def test_merge_when_tool_call_argument_fragments_then_one_fragment_with_the_exact_arguments() -> None:
    first = chunk(role="assistant", text=None, extra_delta={"content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write", "arguments": ""}}]})
    fragments = ['{"path": "a.txt", ', '"text": "line \\"one\\"\\n', 'é数', '😀"}']
    buffer = buffer_of(first, *(tool_args(f) for f in fragments), tool_args("{", call=1))
    data, count = buffer.take()
    events = parse_all(data)
    assert count == 3 and buffer.coalesced_events == len(fragments) - 1
    calls = [json.loads(e.data or "")["choices"][0]["delta"]["tool_calls"][0] for e in events]
    assert calls[0]["id"] == "call_1" and calls[0]["function"]["name"] == "write"
    assert calls[1] == {"index": 0, "function": {"arguments": "".join(fragments)}}
    assert calls[2]["index"] == 1


@pytest.mark.parametrize("volatile", [frozenset({"obfuscation"}), frozenset({"ts", "seq"})])
def test_merge_when_only_volatile_fields_differ_then_merged_with_the_newest_values(
        volatile: frozenset[str]) -> None:
    field = sorted(volatile)[0]
    buffer = PendingBuffer(merge=True, drop=False, volatile=volatile)
    for i, text in enumerate(["a", "bb", "ccc"]):
        data = chunk(text, extra={field: "x" * (i * 7 + 1)})
        buffer.add_event(SSEEvent(data), encode(SSEEvent(data)))
    size = buffer.pending_bytes
    data, count = buffer.take()
    assert size == len(data) and count == 1
    (merged,) = [json.loads(e.data or "") for e in parse_all(data)]
    assert merged["choices"][0]["delta"]["content"] == "abbccc"
    assert merged[field] == "x" * 15


def test_merge_when_volatile_values_vary_and_another_field_differs_then_still_a_barrier() -> None:
    buffer = PendingBuffer(merge=True, drop=False, volatile=frozenset({"ts"}))
    datas = [chunk("a", extra={"ts": 1.5}), chunk("b", extra={"ts": '2 "q"'}),
             chunk("c", extra={"ts": 3, "model": "other"}), chunk("d", extra={"ts": None, "model": "other"})]
    for data in datas:
        buffer.add_event(SSEEvent(data), encode(SSEEvent(data)))
    data, count = buffer.take()
    merged = [json.loads(e.data or "") for e in parse_all(data)]
    assert count == 2 and [m["choices"][0]["delta"]["content"] for m in merged] == ["ab", "cd"]
    assert [(m["ts"], m["model"]) for m in merged] == [('2 "q"', "m"), (None, "other")]


def test_merge_when_unlisted_field_differs_then_barrier() -> None:
    buffer = PendingBuffer(merge=True, drop=False)
    for i, text in enumerate(["a", "b"]):
        data = chunk(text, extra={"ts": i})
        buffer.add_event(SSEEvent(data), encode(SSEEvent(data)))
    assert buffer.take()[1] == 2 and buffer.coalesced_events == 0


def test_pending_bytes_when_added_and_taken_then_matches_bytes_written() -> None:
    buffer = buffer_of(chunk("a"), chunk("b"), chunk(finish="stop"))
    buffer.add_bytes(b": keepalive\n\n")
    size = buffer.pending_bytes
    data, _ = buffer.take()
    assert size == len(data)
    assert buffer.pending_bytes == 0 and not buffer
    assert buffer.take() == (b"", 0)


def test_clear_forgets_everything() -> None:
    buffer = buffer_of(chunk("a"), "x")
    buffer.clear()
    assert buffer.pending_bytes == 0 and buffer.take() == (b"", 0)


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)


@settings(deadline=None, max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["content", "reasoning", "role", "choice1", "finish"]), TEXT),
                max_size=20), st.booleans())
def test_property_merged_text_equals_concatenation_and_size_is_exact(pieces: list[tuple[str, str]],
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
