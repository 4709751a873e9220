"""The stream dialects in the wire core: each API's end, errors, usage, merging
and keepalives, in virtual time (fixtures written from the public API
references of OpenAI Responses and Anthropic Messages streaming)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenwire.middleware import (
    CloseClient,
    ConfigError,
    EndReason,
    ErrorCode,
    FailureKind,
    SocketPaused,
    SocketResumed,
    SSEEvent,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    WireConfig,
)
from tokenwire.middleware.core.dialects import DialectTable, parse_route
from tokenwire.middleware.core.sse import encode

from .wire_harness import Driver, chunk, parse_all, proxy_config

TABLE = DialectTable()


def driver(path: str, config: WireConfig | None = None, **kwargs: Any) -> Driver:
    config = config or proxy_config()
    table = DialectTable(config.dialect_routes, config.terminal_marker)
    d = Driver(config, dialect=table.for_path(path), **kwargs)
    d.sse_headers()
    return d


def named(name: str, body: dict[str, Any]) -> bytes:
    return encode(SSEEvent(data=json.dumps(body, separators=(",", ":")), event=name))


# ---------------------------------------------------------------- Responses


def response_obj(status: str, text: str = "", usage: dict[str, int] | None = None) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "model": "m",
            "output": [{"type": "message", "id": "msg_1", "status": status, "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": usage}


class ResponsesScript:
    """A Responses stream, numbered as the API numbers it."""

    def __init__(self) -> None:
        self.seq = 0
        self.frames: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> bytes:
        frame = named(kind, {"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1
        self.frames.append(frame)
        return frame

    def opening(self) -> list[bytes]:
        return [self.add("response.created", response=response_obj("in_progress")),
                self.add("response.output_item.added", output_index=0,
                         item={"type": "message", "id": "msg_1", "status": "in_progress",
                               "role": "assistant", "content": []}),
                self.add("response.content_part.added", item_id="msg_1", output_index=0,
                         content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def delta(self, text: str) -> bytes:
        return self.add("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
                        delta=text, logprobs=[])

    def completed(self, text: str, kind: str = "response.completed") -> bytes:
        status = {"response.completed": "completed", "response.incomplete": "incomplete",
                  "response.failed": "failed"}[kind]
        return self.add(kind, response=response_obj(status, text, {"input_tokens": 3, "output_tokens": 7,
                                                                   "total_tokens": 10}))


def responses_text(events: list[SSEEvent]) -> str:
    return "".join(json.loads(e.data or "{}").get("delta", "") for e in events
                   if e.event == "response.output_text.delta")


def test_responses_when_complete_then_passed_exactly_with_usage_and_ttft() -> None:
    d = driver("/v1/responses")
    script = ResponsesScript()
    for frame in [*script.opening(), script.delta("Hel"), script.delta("lo"), script.completed("Hello")]:
        d.send(UpstreamData(frame), at=d.now + 0.1)
    d.send(UpstreamEnded())
    assert d.written == b"".join(script.frames)
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    record = d.finished.record
    assert (record.end_reason, record.dialect) == (EndReason.COMPLETE, "responses")
    assert record.tokens_out == (7, "usage")
    assert record.ttft_s == pytest.approx(0.4)  # the first delta, not response.created


@pytest.mark.parametrize("kind", ["response.incomplete", "response.completed"])
def test_responses_when_incomplete_or_completed_then_finished(kind: str) -> None:
    d = driver("/v1/responses")
    script = ResponsesScript()
    for frame in [*script.opening(), script.delta("a"), script.completed("a", kind)]:
        d.send(UpstreamData(frame))
    d.send(UpstreamEnded())
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_responses_when_failed_event_then_forwarded_and_ended_cleanly_but_recorded_as_upstream_error() -> None:  # noqa: E501
    d = driver("/v1/responses")
    script = ResponsesScript()
    for frame in [*script.opening(), script.delta("a"), script.completed("a", "response.failed")]:
        d.send(UpstreamData(frame))
    d.send(UpstreamEnded())
    assert d.written == b"".join(script.frames)
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    record = d.finished.record
    assert (record.end_reason, record.error_code) == (EndReason.UPSTREAM_ERROR, ErrorCode.UPSTREAM_FAILED)


def test_responses_when_eof_without_terminal_then_error_event_in_the_dialects_shape_and_cut() -> None:
    d = driver("/v1/responses")
    script = ResponsesScript()
    for frame in [*script.opening(), script.delta("a")]:
        d.send(UpstreamData(frame))
    d.send(UpstreamEnded())
    last = parse_all(d.written)[-1]
    assert last.event == "error"
    body = json.loads(last.data or "")
    assert body["type"] == "error" and body["code"] == "upstream_failed"
    assert body["sequence_number"] == script.seq  # the next number after the last event
    assert "response.completed" in body["message"]
    assert body["error"]["tokenwire"]["number"] == "E7307"
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]


def test_responses_when_upstream_error_event_then_forwarded_as_it_came_and_ended_as_the_engine_ended_it() -> None:  # noqa: E501
    d = driver("/v1/responses")
    script = ResponsesScript()
    for frame in script.opening():
        d.send(UpstreamData(frame))
    error = script.add("error", code="server_error", message="the engine fell over", param=None)
    d.send(UpstreamData(error))
    assert d.written == b"".join(script.frames)
    # The API's error event is its own terminal failure: the SDKs read it there,
    # and a cut body after it would turn it into a connection error.
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


def test_responses_when_slow_reader_then_deltas_merge_and_numbers_stay_contiguous() -> None:
    d = driver("/v1/responses")
    script = ResponsesScript()
    d.send(UpstreamData(b"".join(script.opening())))
    d.send(SocketPaused())
    words = [f"w{i} " for i in range(50)]
    for word in words:
        d.send(UpstreamData(script.delta(word)))
    d.send(UpstreamData(script.add("response.output_text.done", item_id="msg_1", output_index=0,
                                   content_index=0, text="".join(words))))
    d.send(UpstreamData(script.completed("".join(words))))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    events = parse_all(d.written)
    numbers = [json.loads(e.data or "")["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))
    assert responses_text(events) == "".join(words)
    assert len([e for e in events if e.event == "response.output_text.delta"]) == 1
    assert d.finished.record.coalesced_events == 49
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_responses_when_deltas_of_two_parts_then_each_merges_apart() -> None:
    d = driver("/v1/responses")
    script = ResponsesScript()
    d.send(UpstreamData(b"".join(script.opening())))
    d.send(SocketPaused())
    for i in range(4):
        d.send(UpstreamData(script.add("response.output_text.delta", item_id="msg_1", output_index=0,
                                       content_index=i // 2, delta=f"{i}", logprobs=[])))
    d.send(UpstreamData(script.completed("")))
    d.send(SocketResumed())
    deltas = [json.loads(e.data or "") for e in parse_all(d.written)
              if e.event == "response.output_text.delta"]
    assert [(x["content_index"], x["delta"]) for x in deltas] == [(0, "01"), (1, "23")]


def test_responses_when_slow_client_cut_after_merges_then_error_carries_the_next_client_number() -> None:
    d = driver("/v1/responses", proxy_config(max_pending_bytes=400_000))
    script = ResponsesScript()
    d.send(UpstreamData(b"".join(script.opening())))
    d.send(SocketPaused())
    for _ in range(10):
        d.send(UpstreamData(script.delta("x")))
    d.send(UpstreamFailed(FailureKind.PROTOCOL, "connection reset"))
    d.send(SocketResumed())
    events = parse_all(d.written)
    numbers = [json.loads(e.data or "")["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))
    assert events[-1].event == "error"


# ---------------------------------------------------------------- Anthropic Messages


class MessagesScript:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> bytes:
        frame = named(kind, {"type": kind, **fields})
        self.frames.append(frame)
        return frame

    def opening(self) -> list[bytes]:
        return [self.add("message_start", message={
                    "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": 25, "output_tokens": 1}}),
                self.add("content_block_start", index=0, content_block={"type": "text", "text": ""})]

    def text(self, text: str, index: int = 0) -> bytes:
        return self.add("content_block_delta", index=index, delta={"type": "text_delta", "text": text})

    def closing(self) -> list[bytes]:
        return [self.add("content_block_stop", index=0),
                self.add("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                         usage={"output_tokens": 15}),
                self.add("message_stop")]


def messages_text(events: list[SSEEvent], index: int = 0) -> str:
    out = []
    for e in events:
        if e.event == "content_block_delta":
            body = json.loads(e.data or "")
            if body["index"] == index:
                out.append(body["delta"].get("text") or body["delta"].get("partial_json") or "")
    return "".join(out)


def test_messages_when_complete_then_passed_exactly_with_usage_merged() -> None:
    d = driver("/v1/messages")
    script = MessagesScript()
    for frame in [*script.opening(), script.add("ping"), script.text("Hi"), *script.closing()]:
        d.send(UpstreamData(frame), at=d.now + 0.1)
    d.send(UpstreamEnded())
    assert d.written == b"".join(script.frames)
    record = d.finished.record
    assert (record.end_reason, record.dialect) == (EndReason.COMPLETE, "anthropic.messages")
    assert record.usage == {"input_tokens": 25, "output_tokens": 15}
    assert record.tokens_out == (15, "usage")
    assert record.ttft_s == pytest.approx(0.4)
    assert record.upstream_keepalives == 1


def test_messages_when_eof_without_message_stop_then_anthropic_error_event_and_cut() -> None:
    d = driver("/v1/messages")
    script = MessagesScript()
    for frame in [*script.opening(), script.text("Hi")]:
        d.send(UpstreamData(frame))
    d.send(UpstreamEnded())
    last = parse_all(d.written)[-1]
    assert last.event == "error"
    body = json.loads(last.data or "")
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "message_stop" in body["error"]["message"]
    assert body["error"]["tokenwire"]["code"] == "upstream_failed"
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]


@pytest.mark.parametrize("first", [True, False])
def test_messages_when_upstream_error_event_then_forwarded_in_band_with_its_name_even_first(
        first: bool) -> None:
    d = driver("/v1/messages")
    script = MessagesScript()
    if not first:
        for frame in script.opening():
            d.send(UpstreamData(frame))
    error = script.add("error", error={"type": "overloaded_error", "message": "Overloaded"})
    d.send(UpstreamData(error))
    assert d.commit.status == 200
    assert d.written == b"".join(script.frames)
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


def test_messages_when_upstream_dies_while_waiting_then_real_status_as_today() -> None:
    d = driver("/v1/messages", proxy_config(retry_attempts=0))
    d.send(UpstreamEnded())
    assert d.commit.status == 502


def test_messages_when_slow_reader_then_deltas_of_one_block_merge_and_others_are_barriers() -> None:
    d = driver("/v1/messages")
    script = MessagesScript()
    d.send(UpstreamData(b"".join(script.opening())))
    d.send(SocketPaused())
    for i in range(20):
        d.send(UpstreamData(script.text(f"t{i} ")))
    d.send(UpstreamData(script.add("content_block_stop", index=0)))
    d.send(UpstreamData(script.add("content_block_start", index=1, content_block={
        "type": "tool_use", "id": "toolu_1", "name": "get", "input": {}})))
    for part in ['{"ci', 'ty": ', '"Paris"}']:
        d.send(UpstreamData(script.add("content_block_delta", index=1,
                                       delta={"type": "input_json_delta", "partial_json": part})))
    d.send(UpstreamData(script.add("content_block_stop", index=1)))
    d.send(UpstreamData(script.add("message_delta", delta={"stop_reason": "tool_use"},
                                   usage={"output_tokens": 30})))
    d.send(UpstreamData(script.add("message_stop")))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    events = parse_all(d.written)
    assert messages_text(events, 0) == "".join(f"t{i} " for i in range(20))
    assert json.loads(messages_text(events, 1)) == {"city": "Paris"}
    assert len([e for e in events if e.event == "content_block_delta"]) == 2
    assert [e.event for e in events if e.event != "content_block_delta"] == [
        e.event for e in parse_all(b"".join(script.frames)) if e.event != "content_block_delta"]
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_messages_when_only_pings_after_the_first_token_then_content_inactivity_timeout() -> None:
    d = driver("/v1/messages", proxy_config(upstream_idle_timeout_s=2.0, heartbeat_s=0.5))
    script = MessagesScript()
    for frame in [*script.opening(), script.text("Hi")]:
        d.send(UpstreamData(frame), at=1.0)
    for i in range(1, 12):
        d.send(UpstreamData(named("ping", {"type": "ping"})), at=1.0 + i * 0.25)
        d.send(UpstreamData(b": keepalive\n\n"), at=1.0 + i * 0.25)
        if d.stream.finished:
            break
    d.send(Tick(), at=3.1)
    record = d.finished.record
    assert (record.end_reason, record.error_code) == (EndReason.UPSTREAM_TIMEOUT, ErrorCode.UPSTREAM_TIMEOUT)
    assert record.upstream_keepalives >= 14
    body = json.loads(parse_all(d.written)[-1].data or "")
    assert body["error"]["type"] == "timeout_error"
    assert "keepalives only" in body["error"]["message"]


def test_chat_when_only_comments_after_the_first_token_then_content_inactivity_timeout() -> None:
    d = driver("/v1/chat/completions", proxy_config(upstream_idle_timeout_s=2.0))
    d.send(UpstreamData(f"data: {chunk('a')}\n\n".encode()), at=1.0)
    for i in range(1, 20):
        if d.stream.finished:
            break
        d.send(UpstreamData(b": ping\n\n"), at=1.0 + i * 0.5)
    assert d.finished.record.end_reason is EndReason.UPSTREAM_TIMEOUT


# ---------------------------------------------------------------- Chat, generic, routes


def test_chat_when_eof_without_done_then_still_an_in_band_error_and_cut() -> None:
    d = driver("/v1/chat/completions")
    d.send(UpstreamData(f"data: {chunk('a')}\n\n".encode()))
    d.send(UpstreamEnded())
    body = json.loads(parse_all(d.written)[-1].data or "")
    assert body["error"]["code"] == "upstream_failed" and "[DONE]" in body["error"]["message"]
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]


def test_generic_when_unknown_route_then_passed_exactly_nothing_merged_clean_eof_complete() -> None:
    d = driver("/my/app/stream")
    frames = [f"data: {chunk(f'w{i}')}\n\n".encode() for i in range(5)]
    frames.append(b'data: {"error": {"message": "an app\'s own event"}}\n\n')
    d.send(UpstreamData(frames[0]))
    d.send(SocketPaused())
    for frame in frames[1:]:
        d.send(UpstreamData(frame))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    assert d.written == b"".join(frames)
    record = d.finished.record
    assert (record.end_reason, record.dialect, record.coalesced_events) == (EndReason.COMPLETE, "generic", 0)


def test_route_when_first_event_does_not_fit_its_dialect_then_generic_and_passed_exactly() -> None:
    d = driver("/v1/chat/completions")
    frames = [named("message_start", {"type": "message_start"}), b"data: plain text\n\n"]
    for frame in frames:
        d.send(UpstreamData(frame))
    d.send(UpstreamEnded())
    assert d.written == b"".join(frames)
    assert (d.finished.record.end_reason, d.finished.record.dialect) == (EndReason.COMPLETE, "generic")


def test_route_when_the_first_event_carries_no_data_then_the_first_with_data_confirms() -> None:
    d = driver("/v1/chat/completions")
    d.send(UpstreamData(b"retry: 1000\n\n"))
    d.send(UpstreamData(f"data: {chunk('a')}\n\n".encode()))
    d.send(UpstreamEnded())
    assert d.finished.record.dialect == "chat.completions"
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR  # no [DONE]: the chat rule holds


def test_generic_when_operator_named_a_marker_then_it_is_required() -> None:
    d = driver("/stream", proxy_config(terminal_marker="END"))
    d.send(UpstreamData(b"data: a\n\n"))
    d.send(UpstreamEnded())
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


def test_table_routes() -> None:
    assert TABLE.for_path("/v1/chat/completions?x=1").name == "chat.completions"
    assert TABLE.for_path("/openai/deployments/d/chat/completions").name == "chat.completions"
    assert TABLE.for_path("/v1/completions").name == "completions"
    assert TABLE.for_path("/v1/responses").name == "responses"
    assert TABLE.for_path("/v1/messages").name == "anthropic.messages"
    assert TABLE.for_path("/v1/messages/count_tokens").name == "generic"
    own = DialectTable(("/gen=anthropic.messages", "*=responses"))
    assert own.for_path("/gen").name == "anthropic.messages"
    assert own.for_path("/anything").name == "responses"
    assert parse_route(" /a = generic ") == ("/a", "generic")


@pytest.mark.parametrize("routes", [("nope",), ("/a=klingon",), ("=generic",)])
def test_config_when_route_is_bad_then_config_error_names_the_key(routes: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="dialect_routes"):
        WireConfig(dialect_routes=routes)


def test_chat_when_every_chunk_carries_cumulative_usage_then_a_slow_reader_still_gets_merged_chunks() -> None:
    """vLLM's continuous_usage_stats: usage in every chunk used to make each a barrier."""
    d = driver("/v1/chat/completions")
    d.send(UpstreamData(f"data: {chunk(role='assistant', text='')}\n\n".encode()))
    d.send(SocketPaused())
    frames = [f"data: {chunk(f'w{i} ', usage={'prompt_tokens': 3, 'completion_tokens': i + 1})}\n\n"
              for i in range(5000)]
    for frame in frames:
        d.send(UpstreamData(frame.encode()))
    final = {"prompt_tokens": 3, "completion_tokens": 5000, "total_tokens": 5003}
    d.send(UpstreamData(f"data: {chunk(finish='stop', usage=final)}\n\ndata: [DONE]\n\n".encode()))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    events = parse_all(d.written)
    bodies = [json.loads(e.data or "") for e in events if e.data != "[DONE]"]
    text = "".join(b["choices"][0]["delta"].get("content") or "" for b in bodies)
    assert text == "".join(f"w{i} " for i in range(5000))
    # The merged chunk carries the usage as of its last text; the final usage is forwarded exactly.
    assert bodies[1]["usage"]["completion_tokens"] == 5000 and bodies[-1]["usage"] == final
    record = d.finished.record
    assert record.coalesced_events == 4999 and record.end_reason is EndReason.COMPLETE
    assert record.pending_high_water_bytes < proxy_config().max_pending_bytes
    assert record.tokens_out == (5000, "usage")


@pytest.mark.parametrize(("body", "asked"), [
    # No stream_options: spliced in before the closing brace, the client's bytes kept.
    (b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "h\\u00e9"}]}\n',
     b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "h\\u00e9"}]'
     b',"stream_options":{"include_usage":true}}\n'),
    (b'{"stream":true}', b'{"stream":true,"stream_options":{"include_usage":true}}'),
    # stream_options there (null, or a dict without include_usage): merged, the body dumped.
    (b'{"stream": true, "stream_options": null}', b'{"stream":true,"stream_options":{"include_usage":true}}'),
    (b'{"stream":true,"stream_options":{"x":1},"n":2}',
     b'{"stream":true,"stream_options":{"x":1,"include_usage":true},"n":2}'),
    # The client said something about usage, or does not stream: left as it is.
    (b'{"stream":true,"stream_options":{"include_usage":false}}', None),
    (b'{"stream":true,"stream_options":"yes"}', None),
    (b'{"stream":false}', None),
    (b'{"stream":"true"}', None),
    (b'["stream"]', None),
    (b'{"stream":true', None),
])
def test_chat_asks_the_engine_for_usage_only_where_the_client_did_not_say(body: bytes,
                                                                         asked: bytes | None) -> None:
    chat = DialectTable().for_path("/v1/chat/completions")
    assert chat.name == "chat.completions"
    got = chat.ask_usage(body)
    assert got == asked
    if got is not None:
        given = json.loads(body)
        options = given.get("stream_options") or {}
        assert json.loads(got) == {**given, "stream_options": {**options, "include_usage": True}}
