"""The gRPC transcoder's sans-IO parts: framing, timeouts, statuses, messages.

The response side is driven by the real wire core (WireStream) with injected
time, exactly as the sidecar's exchange drives it: what the core writes goes
through the ResponseTranscoder, so every wire rule (coalescing, in-band
errors, the slow-client cut) is the core's, and these tests check only the
translation. No sockets, no sleeps.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from tokenwire.middleware import (
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    Finished,
    SocketPaused,
    SocketResumed,
    StopRequested,
    Tick,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
    WireStream,
    WriteCompleted,
)
from tokenwire.middleware.core.errors import ErrorCode, GrpcStatus, grpc_status_of
from tokenwire.middleware.core.events import AbortUpstream, FailureKind
from tokenwire.sidecar.grpc_gateway import health, reflection
from tokenwire.sidecar.grpc_gateway.call import Deadline, Ending, ResponseTranscoder
from tokenwire.sidecar.grpc_gateway.framing import (
    GrpcCallError,
    MessageReader,
    encode_message,
    is_grpc_content_type,
    parse_timeout,
)
from tokenwire.sidecar.grpc_gateway.metadata import CallStatus, percent_decode, percent_encode
from tokenwire.sidecar.grpc_gateway.routing import STREAM_METHODS, is_grpc_path
from tokenwire.sidecar.grpc_gateway.transcode import (
    chat_request_body,
    completion_request_body,
    decode_request,
)
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

from tests.middleware.wire_harness import SSE_HEADERS, chunk, completion_chunk, event
from tokenwire.v1 import streaming_pb2 as pb

CHAT = STREAM_METHODS[b"/tokenwire.v1.ChatCompletions/Create"]
COMPLETIONS = STREAM_METHODS[b"/tokenwire.v1.Completions/Create"]


# ---------------------------------------------------------------- framing


def test_messages_split_across_any_feed_boundaries() -> None:
    payloads = [b"", b"a", b"x" * 70_000, bytes(range(256))]
    wire = b"".join(encode_message(p) for p in payloads)
    for step in (1, 3, 5, 4096, len(wire)):
        reader = MessageReader()
        got: list[bytes] = []
        for i in range(0, len(wire), step):
            got += reader.feed(wire[i:i + step])
        reader.close()
        assert got == payloads


def test_a_message_over_the_limit_is_refused_from_its_header_alone() -> None:
    reader = MessageReader(max_message_bytes=4 * 1024 * 1024)
    header = struct.pack(">BI", 0, 4 * 1024 * 1024 + 1)
    with pytest.raises(GrpcCallError) as error:
        reader.feed(header)  # no payload byte has come yet
    assert error.value.status is GrpcStatus.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("wire", "status"), [
    (struct.pack(">BI", 1, 3) + b"abc", GrpcStatus.UNIMPLEMENTED),  # compressed
    (struct.pack(">BI", 7, 3) + b"abc", GrpcStatus.INTERNAL),  # not a flag
])
def test_bad_message_flags(wire: bytes, status: GrpcStatus) -> None:
    with pytest.raises(GrpcCallError) as error:
        MessageReader().feed(wire)
    assert error.value.status is status


def test_a_body_that_ends_inside_a_message_is_internal() -> None:
    reader = MessageReader()
    assert reader.feed(encode_message(b"hello")[:-1]) == []
    with pytest.raises(GrpcCallError) as error:
        reader.close()
    assert error.value.status is GrpcStatus.INTERNAL


@pytest.mark.parametrize(("value", "seconds"), [
    (b"1H", 3600.0), (b"2M", 120.0), (b"30S", 30.0), (b"250m", 0.25), (b"99999999u", 99.999999),
    (b"5n", 5e-9),
])
def test_grpc_timeout_values(value: bytes, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"", b"S", b"1", b"123456789S", b"1s", b"-1S", b"1.5S", b"1 S"])
def test_malformed_grpc_timeouts(value: bytes) -> None:
    with pytest.raises(GrpcCallError):
        parse_timeout(value)


def test_deadline_from_headers_uses_injected_time() -> None:
    deadline = Deadline.from_headers([(b"grpc-timeout", b"100m")], now=50.0)
    assert deadline is not None and deadline.at == pytest.approx(50.1)
    assert not deadline.passed(50.09) and deadline.passed(50.1)
    assert Deadline.from_headers([], now=0.0) is None


@pytest.mark.parametrize(("value", "ok"), [
    (b"application/grpc", True), (b"application/grpc+proto", True), (b"Application/GRPC; x=1", True),
    (b"application/grpc+json", False), (b"application/json", False), (None, False),
])
def test_content_types(value: bytes | None, ok: bool) -> None:
    assert is_grpc_content_type(value) is ok


def test_grpc_paths() -> None:
    assert is_grpc_path(b"/tokenwire.v1.ChatCompletions/Create")
    assert is_grpc_path(b"/grpc.health.v1.Health/Check")
    assert is_grpc_path(b"/tokenwire.v1.Nope/Create")
    assert not is_grpc_path(b"/v1/chat/completions")


# ---------------------------------------------------------------- statuses


@pytest.mark.parametrize("text", ["plain", "100% done", "naïve - ✓", "line\nbreak", ""])
def test_grpc_message_percent_encoding_round_trips(text: str) -> None:
    encoded = percent_encode(text)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert percent_decode(encoded) == text


@pytest.mark.parametrize(("code", "http_status", "status"), [
    (ErrorCode.BACKPRESSURE_EXCEEDED, None, GrpcStatus.RESOURCE_EXHAUSTED),
    (ErrorCode.SEND_TIMEOUT, None, GrpcStatus.RESOURCE_EXHAUSTED),
    (ErrorCode.UPSTREAM_FAILED, None, GrpcStatus.UNAVAILABLE),
    (ErrorCode.SHUTDOWN, None, GrpcStatus.UNAVAILABLE),
    (ErrorCode.CANCELLED, None, GrpcStatus.CANCELLED),
    (ErrorCode.STREAM_NOT_FOUND, 404, GrpcStatus.NOT_FOUND),
    (ErrorCode.UPSTREAM_FAILED, 400, GrpcStatus.INVALID_ARGUMENT),  # the engine's own 400
    (ErrorCode.UPSTREAM_UNAVAILABLE, 502, GrpcStatus.UNAVAILABLE),
    (ErrorCode.BAD_REQUEST, 503, GrpcStatus.UNAVAILABLE),  # draining
    (None, 418, GrpcStatus.INVALID_ARGUMENT),
    (None, None, GrpcStatus.UNKNOWN),
])
def test_status_mapping(code: ErrorCode | None, http_status: int | None, status: GrpcStatus) -> None:
    assert grpc_status_of(code, http_status) is status


def test_every_error_code_maps_to_a_non_ok_status() -> None:
    for code in ErrorCode:
        assert grpc_status_of(code) not in (GrpcStatus.OK, GrpcStatus.UNKNOWN), code


def test_trailers_carry_the_code_name_and_number() -> None:
    trailers = dict(CallStatus(GrpcStatus.RESOURCE_EXHAUSTED, "slow", ErrorCode.BACKPRESSURE_EXCEEDED)
                    .trailers())
    assert trailers == {b"grpc-status": b"8", b"grpc-message": b"slow",
                        b"tokenwire-error-code": b"backpressure_exceeded",
                        b"tokenwire-error-number": b"E7302"}
    assert dict(CallStatus(GrpcStatus.OK).trailers()) == {b"grpc-status": b"0"}
    with pytest.raises(ValueError):
        CallStatus(GrpcStatus.OK, code=ErrorCode.CANCELLED)


# ---------------------------------------------------------------- requests


def test_chat_request_typed_fields_and_passthrough_json() -> None:
    request = pb.ChatCompletionRequest(
        model="m", max_tokens=5, temperature=0.0, seed=7, stop=["\n"],
        stream_options=pb.StreamOptions(include_usage=True),
        messages=[pb.ChatMessage(role="user", content="hi"),
                  pb.ChatMessage(role="tool", content="",
                                 extra_json='{"tool_call_id": "c1", "content": "42"}')],
        extra_json='{"logprobs": true, "top_logprobs": 2, "stream": false}')
    body = chat_request_body(decode_request(pb.ChatCompletionRequest, request.SerializeToString()))
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0.0, "seed": 7, "stop": ["\n"],
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "hi"},
                                 {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                    "logprobs": True, "top_logprobs": 2, "stream": True}


def test_unset_optional_fields_are_not_sent() -> None:
    body = completion_request_body(pb.CompletionRequest(model="m", prompt="p"))
    assert body == {"model": "m", "prompt": "p", "stream": True}


@pytest.mark.parametrize("extra", ["not json", "[1, 2]"])
def test_bad_extra_json_is_invalid_argument(extra: str) -> None:
    with pytest.raises(GrpcCallError) as error:
        chat_request_body(pb.ChatCompletionRequest(model="m", extra_json=extra))
    assert error.value.status is GrpcStatus.INVALID_ARGUMENT


def test_a_malformed_request_message_is_internal() -> None:
    with pytest.raises(GrpcCallError) as error:
        decode_request(pb.ChatCompletionRequest, b"\x12\xff\xff\xff")
    assert error.value.status is GrpcStatus.INTERNAL


# ---------------------------------------------------------------- responses, driven by the core


class CoreCall:
    """The wire core and a transcoder wired as the sidecar's exchange wires them."""

    def __init__(self, method: object = CHAT, *, expect_stream: bool = True, **config: object) -> None:
        self.now = 0.0
        wire = replace(SIDECAR_WIRE_DEFAULTS, **{"heartbeat_s": 0.0, **config})  # type: ignore[arg-type]
        self.core = WireStream(wire, now=0.0, request_id="r1", expect_stream=expect_stream)
        self.transcoder = ResponseTranscoder(method)  # type: ignore[arg-type]
        self.initial: list[tuple[bytes, bytes]] | None = None
        self.wire = bytearray()
        self.ending: Ending | None = None
        self.aborted = False
        self.paused = False

    def feed(self, item: object) -> None:
        self._run(self.core.handle(item, self.now))  # type: ignore[arg-type]

    def _run(self, actions: list[object]) -> None:
        for action in actions:
            if isinstance(action, CommitHeaders):
                self.initial = self.transcoder.on_headers(action.status, action.headers)
            elif isinstance(action, CloseClient):
                self.ending = self.transcoder.on_end(self.core, abrupt=action.abrupt, reset=action.reset)
            elif isinstance(action, AbortUpstream):
                self.aborted = True
            elif isinstance(action, Finished):
                self.record = action.record
        while not self.paused:
            data = self.core.data_to_send(self.now)
            if not data:
                break
            self.wire += self.transcoder.on_body(data, self.core)
            self._run(self.core.handle(WriteCompleted(), self.now))

    def messages(self, kind: type = pb.ChatCompletionChunk) -> list:  # type: ignore[type-arg]
        out = []
        for raw in MessageReader().feed(bytes(self.wire)):
            message = kind()
            message.ParseFromString(raw)
            out.append(message)
        return out


def _status(ending: Ending | None) -> dict[bytes, bytes]:
    assert ending is not None
    return dict(ending.headers)


def test_a_finished_answer_is_one_message_per_chunk_and_status_0() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk(role="assistant")))
    for word in ("Hello", ", ", "wörld"):
        call.feed(event(chunk(word)))
    call.feed(event(chunk(finish="stop")))
    call.feed(event("[DONE]"))
    call.feed(UpstreamEnded())
    assert call.initial is not None and (b"content-type", b"application/grpc") in call.initial
    messages = call.messages()
    assert [m.choices[0].content for m in messages] == ["", "Hello", ", ", "wörld", ""]
    assert messages[0].choices[0].role == "assistant"
    assert messages[-1].choices[0].finish_reason == "stop"
    assert json.loads(messages[1].chunk_json)["choices"][0]["delta"]["content"] == "Hello"
    assert call.ending is not None and not call.ending.trailers_only
    assert _status(call.ending) == {b"grpc-status": b"0"}


def test_chunks_merged_under_backpressure_become_one_message_with_exact_text() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("first")))
    call.paused = True
    call.feed(SocketPaused())
    words = [f" w{i}" for i in range(50)]
    for word in words:
        call.feed(event(chunk(word)))
    call.paused = False
    call.feed(SocketResumed())
    call.feed(event("[DONE]"))
    messages = call.messages()
    assert "".join(m.choices[0].content for m in messages) == "first" + "".join(words)
    assert len(messages) < 1 + len(words)  # merged: fewer messages than chunks
    assert call.record.coalesced_events > 0
    assert _status(call.ending)[b"grpc-status"] == b"0"


def test_tool_call_deltas_and_usage_are_typed() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk(extra_delta={"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                        "function": {"name": "f", "arguments": "{\"a"}}]})))
    call.feed(event(json.dumps({"id": "x", "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})))
    call.feed(event("[DONE]"))
    first, usage = call.messages()
    tool = first.choices[0].tool_calls[0]
    assert (tool.id, tool.type, tool.function_name, tool.function_arguments) == ("c1", "function", "f", '{"a')
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (3, 4, 7)


def test_completions_chunks() -> None:
    call = CoreCall(COMPLETIONS)
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(completion_chunk("abc")))
    call.feed(event("[DONE]"))
    (message,) = call.messages(pb.CompletionChunk)
    assert message.choices[0].text == "abc" and message.id == "cmpl-1"


def test_upstream_death_after_the_first_message_is_unavailable_never_0() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("partial")))
    call.feed(UpstreamFailed(FailureKind.PROTOCOL, "connection reset"))
    assert len(call.messages()) == 1
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.UNAVAILABLE
    assert trailers[b"tokenwire-error-code"] == b"upstream_failed"


def test_an_eof_without_the_terminal_marker_is_never_0() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("partial")))
    call.feed(UpstreamEnded())
    assert _status(call.ending)[b"grpc-status"] != b"0"


def test_the_engines_400_before_the_first_byte_is_invalid_argument_trailers_only() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(400, ((b"content-type", b"application/json"),)))
    from tokenwire.middleware import UpstreamData
    call.feed(UpstreamData(b'{"error":{"message":"max_tokens too large","type":"invalid_request_error",'
                           b'"code":400}}'))
    call.feed(UpstreamEnded())
    assert call.initial is None
    assert call.ending is not None and call.ending.trailers_only
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.INVALID_ARGUMENT
    assert percent_decode(trailers[b"grpc-message"]) == "max_tokens too large"
    assert trailers[b"tokenwire-error-code"] == b"upstream_failed"
    assert call.wire == b""


def test_a_slow_client_is_cut_with_resource_exhausted_and_the_upstream_aborted() -> None:
    call = CoreCall(max_pending_bytes=2048)
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("x")))
    call.paused = True
    call.feed(SocketPaused())
    for i in range(200):
        call.feed(event(chunk(f"distinct-{i}", index=i % 7)))  # other choices: they cannot merge
        if call.ending is not None:
            break
    assert call.aborted
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.RESOURCE_EXHAUSTED


# The call's ending is the core's typed one (WireStream.error, .error_code), never
# a parse of the JSON the core wrote: each of these would mislead such a parse.


def test_a_chunk_with_a_null_error_field_is_an_answer_not_an_ending() -> None:
    """Some engines put ``"error": null`` in every chunk: the core reads them as
    chunks (an error is a non-null ``error`` without ``choices``), so they are
    messages and the finished call is OK, whatever their text starts with."""
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    for text in ("Hel", "lo"):
        call.feed(event(json.dumps({"error": None, **json.loads(chunk(text))})))
    call.feed(event(json.dumps({"error": None, "id": "x", "choices": [], "usage": {
        "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})))
    call.feed(event("[DONE]"))
    call.feed(UpstreamEnded())
    messages = call.messages()
    assert [m.choices[0].content for m in messages[:2]] == ["Hel", "lo"]
    assert messages[2].usage.total_tokens == 3
    assert _status(call.ending) == {b"grpc-status": b"0"}


def test_an_engine_error_event_that_reads_like_a_chunk_ends_the_call_with_its_own_message() -> None:
    """An in-band error event whose text names ``"choices"`` (its ``param``) and
    does not start with ``{"error"``: the core ended the stream with it, so it is
    the trailers (the engine's message, ``upstream_failed``), not a message."""
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("partial")))
    call.feed(event(json.dumps({"id": "chatcmpl-1", "error": {
        "message": "n is over the limit", "type": "invalid_request_error", "param": "choices"}})))
    assert call.core.error is not None and call.core.error_code is ErrorCode.UPSTREAM_FAILED
    assert [m.choices[0].content for m in call.messages()] == ["partial"]
    assert b"over the limit" not in bytes(call.wire)  # no message carries it as chunk_json
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.UNAVAILABLE  # in-band: the code decides
    assert percent_decode(trailers[b"grpc-message"]) == "n is over the limit"
    assert (trailers[b"tokenwire-error-code"], trailers[b"tokenwire-error-number"]) == (
        b"upstream_failed", b"E7307")


def test_the_cores_own_in_band_error_maps_from_its_code_not_its_http_status() -> None:
    """An operator's cancel after the first message: the core's LocalError has
    HTTP status 503, which never went out; its code (``cancelled``) decides."""
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    call.feed(StopRequested(EndReason.CANCELLED))
    assert call.core.error is not None and call.core.error.http_status == 503
    assert len(call.messages()) == 1
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.CANCELLED
    cancelled = "the stream was cancelled by its caller or an operator"
    assert percent_decode(trailers[b"grpc-message"]) == cancelled
    assert trailers[b"tokenwire-error-number"] == b"E7301"


def test_a_send_timeout_cut_writes_no_error_and_ends_with_the_cores_code() -> None:
    """A client that takes nothing for write_deadline_s: the core cuts it with no
    error event (nothing could reach it) and no WireError; its ``error_code``
    says which cut it was: ``send_timeout`` (E7303), not ``backpressure_exceeded``."""
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    call.paused = True
    call.feed(SocketPaused())
    call.feed(event(chunk("b")))
    call.now = SIDECAR_WIRE_DEFAULTS.write_deadline_s + 1.0
    call.feed(Tick())
    assert call.core.error is None and call.core.error_code is ErrorCode.SEND_TIMEOUT
    assert call.ending is not None and call.aborted
    assert b"error" not in bytes(call.wire)
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.RESOURCE_EXHAUSTED
    assert (trailers[b"tokenwire-error-code"], trailers[b"tokenwire-error-number"]) == (
        b"send_timeout", b"E7303")
    assert percent_decode(trailers[b"grpc-message"]) == "the client did not read the answer in time"


def test_an_engines_first_error_event_is_a_trailers_only_status_from_its_http_status() -> None:
    """An error as the first event is the response's status (the core's
    UpstreamErrorEvent, with the status its object stands for: 429)."""
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(json.dumps({"error": {"message": "slow down", "type": "rate_limit", "code": 429}})))
    assert call.core.error is not None and call.core.error.http_status == 429
    assert call.initial is None and call.ending is not None and call.ending.trailers_only
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.RESOURCE_EXHAUSTED
    assert percent_decode(trailers[b"grpc-message"]) == "slow down"
    assert trailers[b"tokenwire-error-code"] == b"upstream_failed"


def test_a_deadline_stops_the_stream_through_the_core_and_ends_deadline_exceeded() -> None:
    call = CoreCall()
    deadline = Deadline.from_headers([(b"grpc-timeout", b"2S")], now=0.0)
    assert deadline is not None
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    call.now = 2.0
    assert deadline.passed(call.now)
    call.transcoder.deadline_passed()
    call.feed(StopRequested(EndReason.CANCELLED))
    assert call.aborted
    trailers = _status(call.ending)
    assert trailers[b"grpc-status"] == b"%d" % GrpcStatus.DEADLINE_EXCEEDED
    assert trailers[b"tokenwire-error-number"] == b"E7301"


def test_a_deadline_before_the_first_byte_is_a_trailers_only_deadline_exceeded() -> None:
    call = CoreCall()
    call.transcoder.deadline_passed()
    call.feed(StopRequested(EndReason.CANCELLED))
    assert call.ending is not None and call.ending.trailers_only
    assert _status(call.ending)[b"grpc-status"] == b"%d" % GrpcStatus.DEADLINE_EXCEEDED


def test_cancel_aborts_the_upstream_at_once_and_sends_nothing() -> None:
    call = CoreCall()
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    call.feed(ClientGone())
    assert call.aborted and call.record.end_reason is EndReason.CLIENT_GONE


def test_heartbeats_are_not_messages() -> None:
    call = CoreCall(heartbeat_s=1.0)
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    for t in range(1, 5):
        call.now = float(t) * 1.5
        call.feed(Tick())
    assert call.core.heartbeats > 0
    assert len(call.messages()) == 1


def test_resume_event_ids_ride_on_messages_and_the_stream_id_in_initial_metadata() -> None:
    call = CoreCall()
    call.core = WireStream(replace(SIDECAR_WIRE_DEFAULTS, heartbeat_s=0.0, resume=True), now=0.0,
                           request_id="r1", stream_id="s1")
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("a")))
    call.feed(event(chunk("b")))
    assert call.initial is not None and (b"x-tokenwire-stream-id", b"s1") in call.initial
    assert [m.event_id for m in call.messages()] == ["s1.1", "s1.2"]


# ---------------------------------------------------------------- health, reflection


def test_health_check_follows_draining() -> None:
    response = health_pb2.HealthCheckResponse()
    request = health_pb2.HealthCheckRequest(service="tokenwire.v1.ChatCompletions").SerializeToString()
    response.ParseFromString(health.check(request, serving=True))
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    response.ParseFromString(health.check(b"", serving=False))
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(GrpcCallError) as error:
        health.check(health_pb2.HealthCheckRequest(service="nope").SerializeToString(), serving=True)
    assert error.value.status is GrpcStatus.NOT_FOUND


def test_health_watch_sends_only_changes() -> None:
    watcher = health.Watcher("")
    first = watcher.update(serving=True)
    assert first is not None
    assert watcher.update(serving=True) is None
    changed = watcher.update(serving=False)
    response = health_pb2.HealthCheckResponse()
    assert changed is not None
    response.ParseFromString(changed)
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    unknown = health.Watcher("nope").update(serving=True)
    assert unknown is not None
    response.ParseFromString(unknown)
    assert response.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def test_reflection_lists_and_describes_the_services() -> None:
    response = rpb.ServerReflectionResponse()
    response.ParseFromString(reflection.answer(rpb.ServerReflectionRequest(list_services="").SerializeToString()))
    names = {s.name for s in response.list_services_response.service}
    assert {"tokenwire.v1.ChatCompletions", "tokenwire.v1.Completions", "grpc.health.v1.Health"} <= names
    response.ParseFromString(reflection.answer(rpb.ServerReflectionRequest(
        file_containing_symbol="tokenwire.v1.ChatCompletions").SerializeToString()))
    from google.protobuf import descriptor_pb2
    file = descriptor_pb2.FileDescriptorProto()
    file.ParseFromString(response.file_descriptor_response.file_descriptor_proto[0])
    assert file.package == "tokenwire.v1"
    assert [m.name for m in file.service[0].method] == ["Create"]
    response.ParseFromString(reflection.answer(rpb.ServerReflectionRequest(
        file_containing_symbol="no.Such").SerializeToString()))
    assert response.error_response.error_code == GrpcStatus.NOT_FOUND


@pytest.mark.parametrize("writes", [
    [b": keepalive\n", b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'],
    [b': keepalive\ndata: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'],
    [b'data: {"choices":[{"index":0,', b'"delta":{"content":"a"}}]}\n\n'],  # an event cut in two
    [b'data: {"choices":[{"index":0,"delta":\r\ndata: {"content":"a"}}]}\r\n\r\n'],  # CRLF, two data lines
    [b'retry: 3000\ndata: {"choices":[{"index":0,"delta":{"content":"a"}}]}\nid: s.1\n\n'],
])
def test_transcoder_reads_any_split_of_the_cores_output(writes: list[bytes]) -> None:
    transcoder = ResponseTranscoder(CHAT)
    transcoder.on_headers(200, SSE_HEADERS)
    core = WireStream(SIDECAR_WIRE_DEFAULTS, now=0.0, request_id="r")  # running: no ending yet
    wire = b"".join(transcoder.on_body(data, core) for data in writes)
    (raw,) = MessageReader().feed(wire)
    message = pb.ChatCompletionChunk()
    message.ParseFromString(raw)
    assert message.choices[0].content == "a"
