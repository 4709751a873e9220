"""A UTF-16 surrogate pair split across chunks, over gRPC.

A gateway that slices UTF-16 strings (JavaScript's) may end one chunk's text
with ``"\\ud83d"`` and start the next with ``"\\ude00"``. Over SSE the escapes
pass through and the client's JSON parser joins them; a protobuf string must
be UTF-8, so the transcoder holds the high half back and joins it with the
low half (U+1F600), and turns a surrogate nothing completes into U+FFFD --
never a killed call. Sans-IO through the real wire core (``CoreCall``), then
one real grpcio client through a real sidecar.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
from clients import sse_datas
from conftest import RunningSidecar
from test_grpc_sansio import CHAT, COMPLETIONS, CoreCall
from tokenwire.middleware import (
    SocketPaused,
    SocketResumed,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
)
from tokenwire.middleware.core.events import FailureKind
from tokenwire.sidecar.grpc_gateway.framing import MessageReader, valid_text
from tokenwire.sidecar.grpc_gateway.metadata import percent_decode, percent_encode

from tests.middleware.wire_harness import SSE_HEADERS, chunk, completion_chunk, event
from tokenwire.v1 import streaming_pb2 as pb
from tokenwire.v1 import streaming_pb2_grpc as pbg

HIGH, LOW = "\ud83d", "\ude00"  # U+1F600 as UTF-16
FACE = "\U0001f600"
FFFD = "\ufffd"


def _escaped(data: str) -> str:
    """``data`` as it comes on the wire: every non-ASCII character (and so every
    surrogate) a ``\\uXXXX`` escape, as json.dumps and JavaScript write them."""
    return json.dumps(json.loads(data), separators=(",", ":"))


def _say(text: str, **fields: Any) -> object:
    return event(_escaped(chunk(text, **fields)))


def _tool(arguments: str, *, call: int = 0, **fields: Any) -> object:
    """A tool-call chunk: ``fields`` (``id``, ``type``, ``name``) make it the call's first."""
    name = {"name": fields.pop("name")} if "name" in fields else {}
    return event(_escaped(chunk(extra_delta={"tool_calls": [{
        "index": call, **fields, "function": {**name, "arguments": arguments}}]})))


def _contents(call: CoreCall) -> list[str]:
    return [m.choices[0].content if m.choices else "" for m in call.messages()]


def _utf16(text: str) -> str:
    """Adjacent surrogate code points joined, as a JavaScript string holds them."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")


def _started(method: object = CHAT) -> CoreCall:
    call = CoreCall(method)
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    return call


def _finish(call: CoreCall) -> None:
    call.feed(event(chunk(finish="stop")))
    call.feed(event("[DONE]"))
    call.feed(UpstreamEnded())


def _status(call: CoreCall) -> bytes:
    assert call.ending is not None
    return dict(call.ending.headers)[b"grpc-status"]


# ---------------------------------------------------------------- a pair split across chunks


def test_a_pair_split_across_two_chunks_is_joined_into_its_character() -> None:
    call = _started()
    call.feed(event(chunk(role="assistant")))
    call.feed(_say("Hi " + HIGH))
    call.feed(_say(LOW + " there"))
    _finish(call)
    messages = call.messages()
    assert _contents(call) == ["", "Hi ", FACE + " there", ""]
    assert messages[-1].choices[0].finish_reason == "stop"
    assert _status(call) == b"0" and call.ending is not None and call.ending.data == b""
    # chunk_json stays the engine's, escapes and all: joined, it is the same text.
    raw = "".join(json.loads(m.chunk_json)["choices"][0]["delta"].get("content", "") for m in messages)
    assert _utf16(raw) == "Hi " + FACE + " there"
    assert '"Hi \\ud83d"' in messages[1].chunk_json


def test_a_pair_split_inside_chunks_the_core_merged_is_joined() -> None:
    call = _started()
    call.feed(_say("first"))
    call.paused = True
    call.feed(SocketPaused())
    for text in ("a", "b" + HIGH, LOW + "c", "d"):  # merged: the escapes meet in one string
        call.feed(_say(text))
    call.paused = False
    call.feed(SocketResumed())
    _finish(call)
    assert call.record.coalesced_events > 0
    assert "".join(_contents(call)) == "firstab" + FACE + "cd"
    assert len(call.messages()) < 6


def test_a_pair_split_between_two_merged_chunks_is_joined() -> None:
    """The high half ends one merged message, the low half starts the next."""
    call = _started()
    call.feed(_say("first"))
    for batch in (("a", "b" + HIGH), (LOW + "c", "d")):
        call.paused = True
        call.feed(SocketPaused())
        for text in batch:
            call.feed(_say(text))
        call.paused = False
        call.feed(SocketResumed())
    _finish(call)
    assert call.record.coalesced_events > 0
    assert _contents(call) == ["first", "ab", FACE + "cd", ""]
    assert _status(call) == b"0"


def test_a_pair_split_in_tool_call_arguments_and_in_completions_text_is_joined() -> None:
    call = _started()
    call.feed(_tool('{"e":"' + HIGH, id="c1", type="function", name="f"))
    call.feed(_say("beside"))  # another field's text in between: the arguments still wait
    call.feed(_tool(LOW + '"}'))
    _finish(call)
    arguments = "".join(t.function_arguments for m in call.messages()
                        for c in m.choices for t in c.tool_calls)
    assert arguments == '{"e":"' + FACE + '"}'
    assert "".join(_contents(call)) == "beside"

    call = _started(COMPLETIONS)
    call.feed(event(_escaped(completion_chunk("x" + HIGH))))
    call.feed(event(_escaped(completion_chunk(LOW + "y"))))
    call.feed(event("[DONE]"))
    assert [m.choices[0].text for m in call.messages(pb.CompletionChunk)] == ["x", FACE + "y"]


# ---------------------------------------------------------------- lone surrogates: U+FFFD


@pytest.mark.parametrize(("texts", "expected"), [
    (["a" + HIGH, "b"], ["a", FFFD + "b"]),  # a high half, then ordinary text
    (["a" + HIGH, HIGH + LOW + "b"], ["a", FFFD + FACE + "b"]),  # then a whole pair
    (["a" + HIGH, HIGH, LOW], ["a", FFFD, FACE]),  # a second high half: the first is lone
    ([LOW + "b"], [FFFD + "b"]),  # a lone low half
    (["a" + LOW + "b", "c"], ["a" + FFFD + "b", "c"]),  # a lone low half inside the text
    (["a" + HIGH + "b"], ["a" + FFFD + "b"]),  # a lone high half inside the text
])
def test_a_lone_surrogate_becomes_fffd_and_the_call_goes_on(texts: list[str], expected: list[str]) -> None:
    call = _started()
    for text in texts:
        call.feed(_say(text))
    _finish(call)
    assert _contents(call) == [*expected, ""]
    assert _status(call) == b"0"


def test_a_high_half_before_a_message_without_text_goes_out_first_as_fffd() -> None:
    call = _started()
    call.feed(_say("a" + HIGH))
    _finish(call)  # the finish chunk has no text
    messages = call.messages()
    assert _contents(call) == ["a", FFFD, ""]
    flushed = messages[1]
    assert (flushed.id, flushed.model, flushed.chunk_json, flushed.choices[0].finish_reason) == (
        "chatcmpl-1", "m", "", "")
    assert messages[2].choices[0].finish_reason == "stop"
    assert call.ending is not None and call.ending.data == b""


@pytest.mark.parametrize("end", ["done", "broken"])
def test_a_high_half_at_the_end_of_the_stream_is_fffd_before_the_trailers(end: str) -> None:
    call = _started()
    call.feed(_say("a" + HIGH))
    if end == "done":
        call.feed(event("[DONE]"))
        call.feed(UpstreamEnded())
    else:
        call.feed(UpstreamFailed(FailureKind.PROTOCOL, "connection reset"))
    assert _contents(call) == ["a"]
    assert call.ending is not None and not call.ending.trailers_only
    (raw,) = MessageReader().feed(call.ending.data)
    last = pb.ChatCompletionChunk.FromString(raw)
    assert last.choices[0].content == FFFD and last.choices[0].index == 0
    assert _status(call) == (b"0" if end == "done" else b"%d" % grpc.StatusCode.UNAVAILABLE.value[0])


def test_each_field_holds_its_own_half_and_a_flush_carries_them_all() -> None:
    call = _started()
    call.feed(_say("a" + HIGH, index=0))
    call.feed(_say("b" + HIGH, index=1))
    call.feed(_tool("{" + HIGH, call=2))
    call.feed(_say(LOW, index=1))  # completes choice 1's pair only
    _finish(call)
    messages = call.messages()
    assert [m.choices[0].content for m in messages[:2]] == ["a", "b"]
    assert messages[3].choices[0].content == FACE
    flushed = messages[4]  # before the finish chunk: choice 0's text, its tool call's arguments
    assert [(c.index, c.content, [(t.index, t.function_arguments) for t in c.tool_calls])
            for c in flushed.choices] == [(0, FFFD, [(2, FFFD)])]


# ---------------------------------------------------------------- other strings from JSON


def test_lone_surrogates_in_ids_names_and_the_whole_answer_are_fffd() -> None:
    call = _started()
    call.feed(event(_escaped(chunk(ident="id" + HIGH, extra={"model": "m" + LOW}, extra_delta={
        "tool_calls": [{"index": 0, "id": "c" + LOW, "type": "function" + HIGH,
                        "function": {"name": "f" + HIGH, "arguments": ""}}]}))))
    _finish(call)
    first = call.messages()[0]
    tool = first.choices[0].tool_calls[0]
    assert (first.id, first.model, tool.id, tool.type, tool.function_name) == (
        "id" + FFFD, "m" + FFFD, "c" + FFFD, "function" + FFFD, "f" + FFFD)
    assert _status(call) == b"0"

    whole = CoreCall(expect_stream=False)  # a call that asked for no stream: one JSON object
    whole.feed(UpstreamHeaders(200, ((b"content-type", b"application/json"),)))
    answer = {"id": "x", "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "a" + HIGH}}]}
    whole.feed(UpstreamData(json.dumps(answer).encode()))
    whole.feed(UpstreamEnded())
    assert whole.ending is not None
    (raw,) = MessageReader().feed(whole.ending.data)
    assert pb.ChatCompletionChunk.FromString(raw).choices[0].content == "a" + FFFD


def test_a_lone_surrogate_in_an_error_message_is_fffd_in_grpc_message() -> None:
    call = _started()  # the engine's error event after the first message: in-band
    call.feed(_say("a"))
    call.feed(event(json.dumps({"error": {"message": "bad " + HIGH + " input"}})))
    assert _contents(call) == ["a"]  # the error event is the trailers, not a message
    assert call.ending is not None
    assert percent_decode(dict(call.ending.headers)[b"grpc-message"]) == "bad " + FFFD + " input"
    assert dict(call.ending.headers)[b"tokenwire-error-code"] == b"upstream_failed"

    call = CoreCall()  # the engine's error answer before the first byte
    call.feed(UpstreamHeaders(400, ((b"content-type", b"application/json"),)))
    call.feed(UpstreamData(json.dumps({"error": {"message": HIGH + " no"}}).encode()))
    call.feed(UpstreamEnded())
    assert call.ending is not None and call.ending.trailers_only
    assert percent_decode(dict(call.ending.headers)[b"grpc-message"]) == FFFD + " no"
    assert percent_decode(percent_encode("x" + LOW)) == "x" + FFFD


def test_valid_text() -> None:
    assert valid_text("plain") == "plain"
    assert valid_text("naïve ✓ " + FACE) == "naïve ✓ " + FACE
    assert valid_text(HIGH + LOW) == FACE
    assert valid_text(HIGH) == valid_text(LOW) == FFFD
    assert valid_text(LOW + HIGH) == FFFD + FFFD


# ---------------------------------------------------------------- end to end


def test_grpc_when_engine_splits_a_surrogate_pair_then_call_is_ok_with_the_sse_text(
        start_sidecar: Callable[..., RunningSidecar], recorder: Any) -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for data in (chunk(role="assistant"), chunk("Hi " + HIGH), chunk(LOW + " there"),
                     chunk(finish="stop"), "[DONE]"):
            payload = b"data: " + (data if data == "[DONE]" else _escaped(data)).encode() + b"\n\n"
            await recorder.send(writer, b"%x\r\n%b\r\n" % (len(payload), payload))
        await recorder.send(writer, b"0\r\n\r\n")

    recorder.respond = respond
    sidecar = start_sidecar(upstreams=recorder.url)
    with httpx.Client(http2=True, http1=False, base_url=sidecar.url, timeout=30) as client:
        sse = client.post("/v1/chat/completions", headers={"content-type": "application/json"},
                          content=json.dumps({"model": "m", "stream": True, "messages": []}))
    assert sse.status_code == 200 and b'"Hi \\ud83d"' in sse.content  # SSE keeps the escapes
    sse_text = _utf16("".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                              for d in sse_datas(sse.content) if d != "[DONE]"))
    assert sse_text == "Hi " + FACE + " there"

    request = pb.ChatCompletionRequest(model="m", messages=[pb.ChatMessage(role="user", content="hi")],
                                       extra_json='{"user": "u\\ud83d"}')  # a lone one going up, too
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(request, timeout=30)
        messages = list(call)
        assert call.code() is grpc.StatusCode.OK
    assert "".join(c.content for m in messages for c in m.choices) == sse_text
    assert b'"user":"u\\ud83d"' in recorder.received  # escaped as the client wrote it
