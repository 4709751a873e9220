"""gRPC through the sidecar's HTTP/2 listener, with real gRPC clients on 127.0.0.1.

grpcio (sync and aio) against the fake engine; a raw HTTP/2 client (h2client)
where a test needs what a polite client never does (a window it never opens,
a deadline the server must honour itself, a PING flood, a wrong content type);
@grpc/grpc-js is in test_grpc_node.py. Each gRPC call is transcoded to the
engine's OpenAI request and served by the same exchange and wire core as SSE.
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import h2.events
import httpx
import pytest
from clients import sse_datas, wait_for
from conftest import LoopThread, RunningSidecar
from grpc_health.v1 import health_pb2, health_pb2_grpc
from h2client import H2Client
from tokenwire.middleware import EndReason
from upstreams import FakeUpstream, expected_text

from tokenwire.v1 import streaming_pb2 as pb
from tokenwire.v1 import streaming_pb2_grpc as pbg

CHAT_PATH = "/tokenwire.v1.ChatCompletions/Create"
GRPC_HEADERS = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]


def _request(text: str = "hi") -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(model="m", messages=[pb.ChatMessage(role="user", content=text)],
                                    seed=1)


def _metadata(request_id: str, tokens: int = 5, delay_s: float = 0.0) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), ("x-fake-tokens", str(tokens)), ("x-fake-delay-s", str(delay_s))]


def _text(messages: list[pb.ChatCompletionChunk]) -> str:
    return "".join(choice.content for message in messages for choice in message.choices)


def _frame(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def _messages(body: bytes) -> list[pb.ChatCompletionChunk]:
    out = []
    while body:
        length = struct.unpack(">I", body[1:5])[0]
        message = pb.ChatCompletionChunk()
        message.ParseFromString(body[5:5 + length])
        out.append(message)
        body = body[5 + length:]
    return out


class GrpcH2Client(H2Client):
    """h2client with the trailers a gRPC answer ends with, and GOAWAY's debug data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.trailers: dict[int, dict[bytes, bytes]] = {}
        self.goaway_debug = b""
        self.ping_acks = 0
        super().__init__(*args, **kwargs)

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.TrailersReceived):
            self.trailers[event.stream_id] = {bytes(k): bytes(v) for k, v in event.headers or []}
        elif isinstance(event, h2.events.PingAckReceived):
            self.ping_acks += 1
        super()._handle(event)

    def _without_goaway(self, data: bytes) -> bytes:
        frames = self._frames + data
        while len(frames) >= 9:
            length = int.from_bytes(frames[:3], "big")
            if len(frames) < 9 + length:
                break
            if frames[3] == 0x7:
                self.goaway_debug = bytes(frames[17:9 + length])
            frames = frames[9 + length:]
        return super()._without_goaway(data)

    def call(self, path: str, payload: bytes, headers: list[tuple[bytes, bytes]] = ()) -> int:  # type: ignore[assignment]
        return self.request(path, method="POST", body=_frame(payload), headers=[*GRPC_HEADERS, *headers])

    def status(self, stream_id: int) -> dict[bytes, bytes]:
        """grpc-status and friends: from the trailers, or a trailers-only response's headers."""
        return self.trailers.get(stream_id) or dict(self.streams[stream_id].headers)


# ---------------------------------------------------------------- normal streams


def test_grpc_when_sync_client_then_same_text_as_sse_and_status_ok(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    with httpx.Client(http2=True, http1=False, base_url=sidecar.url) as client:
        sse = client.post("/v1/chat/completions",
                          headers={"x-fake-tokens": "9", "content-type": "application/json"},
                          content=json.dumps({"model": "m", "stream": True, "seed": 1, "messages": []}))
    sse_text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                       for d in sse_datas(sse.content) if d != "[DONE]" and json.loads(d)["choices"])
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-sync", 9),
                                                       timeout=10)
        messages = list(call)
        assert call.code() is grpc.StatusCode.OK
        initial = dict(call.initial_metadata())
    assert _text(messages) == sse_text == expected_text(9)
    assert messages[0].choices[0].role == "assistant"
    assert any(m.choices and m.choices[0].finish_reason == "stop" for m in messages)
    usage = [m.usage for m in messages if m.usage.total_tokens]
    assert usage and usage[0].completion_tokens == 9
    assert all(json.loads(m.chunk_json)["id"] == m.id for m in messages)
    assert initial["x-request-id"] == "g-sync"
    record = sidecar.record("g-sync")
    assert record.end_reason is EndReason.COMPLETE
    assert sidecar.log.extras["g-sync"]["http_version"] == "2"


def test_grpc_when_aio_client_then_many_concurrent_calls_on_one_channel_complete(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()

    async def main() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
            stub = pbg.ChatCompletionsStub(channel)

            async def one(i: int) -> tuple[grpc.StatusCode, str]:
                call = stub.Create(_request(), metadata=_metadata(f"g-aio-{i}", 6, 0.01), timeout=10)
                text = "".join([c.content async for m in call for c in m.choices])
                return await call.code(), text

            return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(main())
    assert results == [(grpc.StatusCode.OK, expected_text(6))] * 20


def test_grpc_when_completions_then_text_chunks(start_sidecar: Callable[..., RunningSidecar],
                                            upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.CompletionsStub(channel).Create(pb.CompletionRequest(model="m", prompt="p", max_tokens=3),
                                                   metadata=[("x-request-id", "g-cmpl")], timeout=10)
        list(call)
        assert call.code() is grpc.StatusCode.OK
    (request,) = upstream.requests_with("g-cmpl")
    assert request.path == "/v1/completions"
    # Usage is asked of the engine for the record (request_usage), not forwarded.
    assert json.loads(request.body) == {"model": "m", "max_tokens": 3, "prompt": "p", "stream": True,
                                        "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------- cancel, deadline, upstream death


def test_grpc_when_client_cancels_then_upstream_aborted_at_once(start_sidecar: Callable[..., RunningSidecar],
                                                         upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-cancel", 500, 0.02),
                                                       timeout=30)
        next(call)
        next(call)
        cancelled_at = time.monotonic()
        call.cancel()
        connection = upstream.connection_of("g-cancel")
        assert connection.closed.wait(5)
    assert connection.peer_closed_at is not None and connection.peer_closed_at - cancelled_at < 1.0
    assert sidecar.record("g-cancel").end_reason is EndReason.CLIENT_GONE


def test_grpc_when_deadline_passes_then_server_ends_deadline_exceeded_and_aborts_upstream(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """The raw client never cancels: the sidecar honours grpc-timeout itself."""
    sidecar = start_sidecar()
    with GrpcH2Client(sidecar.port) as client:
        stream_id = client.call(CHAT_PATH, _request().SerializeToString(),
                                [(b"grpc-timeout", b"300m"), (b"x-request-id", b"g-deadline"),
                                 (b"x-fake-tokens", b"500"), (b"x-fake-delay-s", b"0.02")])
        state = client.response(stream_id)
        status = client.status(stream_id)
    assert state.ended
    assert status[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
    assert status[b"tokenwire-error-code"] == b"cancelled"
    assert 0 < len(_messages(bytes(state.body))) < 500
    assert upstream.connection_of("g-deadline").closed.wait(5)


def test_grpc_when_deadline_already_past_then_deadline_exceeded_and_nothing_sent_upstream(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """``grpc-timeout: 0n`` (a deadline spent before the call arrived): no
    generation starts for an answer nobody is waiting for."""
    sidecar = start_sidecar()
    with GrpcH2Client(sidecar.port) as client:
        stream_id = client.call(CHAT_PATH, _request().SerializeToString(),
                                [(b"grpc-timeout", b"0n"), (b"x-request-id", b"g-past")])
        state = client.response(stream_id)
        status = client.status(stream_id)
    assert state.ended
    assert status[b"grpc-status"] == b"4", status  # DEADLINE_EXCEEDED
    assert _messages(bytes(state.body)) == []
    # A later call on the same sidecar is served, and the past one never reached the upstream.
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        list(pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-after", 2, 0.0),
                                                     timeout=10))
    assert upstream.requests_with("g-after")
    assert upstream.requests_with("g-past") == []


def test_grpc_when_client_deadline_then_grpcio_sees_deadline_exceeded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-dl", 500, 0.02),
                                                       timeout=0.4)
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert upstream.connection_of("g-dl").closed.wait(5)


def test_grpc_when_upstream_dies_mid_stream_then_unavailable_never_ok(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(upstreams=f"{upstream.url}/die")
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-die", 10),
                                                       timeout=10)
        messages: list[pb.ChatCompletionChunk] = []
        with pytest.raises(grpc.RpcError):
            for message in call:
                messages.append(message)
        assert call.code() is grpc.StatusCode.UNAVAILABLE
        trailing = dict(call.trailing_metadata() or ())
    assert messages  # it died after the first message
    assert trailing["tokenwire-error-code"] == "upstream_failed"


def test_grpc_when_upstream_refuses_before_the_first_message_then_retried_and_ok(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """The core's retry rule, per call: a 503 before anything reached the client is retried."""
    sidecar = start_sidecar(upstreams=f"{upstream.url}/status503")
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(
            _request(), metadata=[*_metadata("g-retry", 6), ("x-fake-fail-first", "1")], timeout=10)
        assert _text(list(call)) == expected_text(6)
        assert call.code() is grpc.StatusCode.OK
    assert len(upstream.requests_with("g-retry")) == 2
    assert sidecar.record("g-retry").retries == 1


def test_grpc_when_operator_cancels_then_cancelled_with_the_code(start_sidecar: Callable[..., RunningSidecar],
                                                         upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-op", 500, 0.02),
                                                       timeout=30)
        next(call)
        assert httpx.delete(sidecar.admin_url + "/streams/g-op").status_code == 200
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    assert error.value.code() is grpc.StatusCode.CANCELLED
    trailing = dict(error.value.trailing_metadata())
    assert (trailing["tokenwire-error-code"], trailing["tokenwire-error-number"]) == ("cancelled", "E7301")
    assert upstream.connection_of("g-op").closed.wait(5)


def test_grpc_when_drain_time_ends_then_unavailable_with_shutdown(
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread) -> None:
    sidecar = start_sidecar(drain_s=0.5)
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-drain", 1000, 0.02),
                                                       timeout=30)
        next(call)
        stopping = threading.Thread(target=lambda: loop_thread.run(sidecar.sidecar.shutdown()))
        stopping.start()
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        stopping.join(10)
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
    assert dict(error.value.trailing_metadata())["tokenwire-error-code"] == "shutdown"


def test_grpc_when_engine_refuses_then_invalid_argument_with_its_message(
        start_sidecar: Callable[..., RunningSidecar], recorder: Any) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'{"error":{"message":"max_tokens is too large","type":"invalid_request_error"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()

    recorder.respond = refuse
    sidecar = start_sidecar(upstreams=recorder.url)
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "max_tokens is too large"


# ---------------------------------------------------------------- flow control


def test_grpc_when_reader_is_slow_then_chunks_merge_into_fewer_messages_with_exact_text(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """A window the client keeps shut: the core coalesces; opened, fewer messages, same text."""
    sidecar = start_sidecar()
    tokens = 400
    with GrpcH2Client(sidecar.port, settings={4: 256}) as client:  # SETTINGS_INITIAL_WINDOW_SIZE
        held = True
        client.credits = lambda stream_id: not held
        stream_id = client.call(CHAT_PATH, _request().SerializeToString(),
                                [(b"x-request-id", b"g-slow"), (b"x-fake-tokens", str(tokens).encode()),
                                 (b"x-fake-delay-s", b"0.002")])  # chunks arrive one by one
        # The engine finishes while the window is shut: its chunks wait in the core.
        wait_for(lambda: any(r.finished_at is not None for r in upstream.requests_with("g-slow")), 10.0)
        held = False
        client.conn.increment_flow_control_window(1 << 24, stream_id)
        client.conn.increment_flow_control_window(1 << 24)
        client.flush()
        state = client.response(stream_id)
        status = client.status(stream_id)
    messages = _messages(bytes(state.body))
    assert status[b"grpc-status"] == b"0"
    assert _text(messages) == expected_text(tokens)
    assert len(messages) < tokens
    assert sidecar.record("g-slow").coalesced_events > 0


def test_grpc_when_reader_never_opens_its_window_then_resource_exhausted_trailers_and_upstream_aborted(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """Past max_pending_bytes the call ends at once: trailers (not flow-controlled)
    with RESOURCE_EXHAUSTED and E7302, what the window held back dropped."""
    sidecar = start_sidecar(max_pending_bytes=8192)
    with GrpcH2Client(sidecar.port, settings={4: 256}) as client:
        client.credits = lambda stream_id: False
        stream_id = client.call(CHAT_PATH, _request().SerializeToString(),
                                [(b"x-request-id", b"g-stuck"), (b"x-fake-tokens", b"2000"),
                                 (b"x-fake-delay-s", b"0.001")])
        assert client.read_until(lambda: stream_id in client.trailers, timeout_s=20)
        status = client.status(stream_id)
    assert status[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
    assert status[b"tokenwire-error-number"] == b"E7302"
    assert upstream.connection_of("g-stuck").closed.wait(5)
    assert sidecar.record("g-stuck").end_reason is EndReason.SLOW_CLIENT


# ---------------------------------------------------------------- bad input


def test_grpc_when_bad_input_then_spec_statuses_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with GrpcH2Client(sidecar.port) as client:
        malformed = client.call(CHAT_PATH, b"\x12\xff\xff\xff\xff", [(b"x-request-id", b"g-bad-1")])
        unknown = client.call("/tokenwire.v1.ChatCompletions/Nope", b"", [(b"x-request-id", b"g-bad-2")])
        wrong_type = client.request(CHAT_PATH, method="POST", body=b"{}",
                                    headers=[(b"content-type", b"application/json"),
                                             (b"x-request-id", b"g-bad-3")])
        huge = client.request(CHAT_PATH, method="POST", body=struct.pack(">BI", 0, 5 * 1024 * 1024),
                              headers=[*GRPC_HEADERS, (b"x-request-id", b"g-bad-4")], end=False)
        bad_json = client.call(CHAT_PATH, pb.ChatCompletionRequest(extra_json="[1]").SerializeToString(),
                               [(b"x-request-id", b"g-bad-5")])
        for stream_id in (malformed, unknown, wrong_type, huge, bad_json):
            client.response(stream_id)
        assert client.status(malformed)[b"grpc-status"] == b"13"  # INTERNAL
        assert client.status(unknown)[b"grpc-status"] == b"12"  # UNIMPLEMENTED
        assert client.streams[wrong_type].status == 415
        assert client.status(huge)[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
        assert client.status(bad_json)[b"grpc-status"] == b"3"  # INVALID_ARGUMENT
    for i in range(1, 6):
        assert not upstream.requests_with(f"g-bad-{i}")


def test_grpc_when_message_over_limit_from_grpcio_then_resource_exhausted(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request("x" * (5 * 1024 * 1024)), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------- health, reflection, keepalive


def test_grpc_health_when_draining_then_watch_sees_not_serving_and_check_follows(
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread) -> None:
    sidecar = start_sidecar(drain_s=1.0)
    target = f"{sidecar.host}:{sidecar.port}"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
        assert stub.Check(health_pb2.HealthCheckRequest(service="tokenwire.v1.Completions"),
                          timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="tokenwire.v1.ChatCompletions"), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopping = threading.Thread(target=lambda: loop_thread.run(sidecar.sidecar.shutdown()))
        stopping.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as ended:
            next(watch)
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
        stopping.join(10)


def test_grpc_reflection_lists_and_describes_the_services(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"tokenwire.v1.ChatCompletions", "tokenwire.v1.Completions",
                "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(database)
        service = pool.FindServiceByName("tokenwire.v1.ChatCompletions")
        (method,) = service.methods
        assert method.name == "Create" and method.output_type.full_name == "tokenwire.v1.ChatCompletionChunk"


def test_grpc_keepalive_when_pings_too_frequent_then_goaway_too_many_pings(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(grpc_keepalive_min_ping_interval_s=10.0, grpc_keepalive_max_ping_strikes=2,
                            grpc_keepalive_permit_without_calls=True)
    with GrpcH2Client(sidecar.port) as polite:
        polite.conn.ping(b"12345678")
        polite.flush()
        assert polite.read_until(lambda: polite.ping_acks == 1)
        assert polite.goaway is None
    with GrpcH2Client(sidecar.port) as client:
        for i in range(4):
            client.conn.ping(b"%08d" % i)
        client.flush()
        assert client.read_until(lambda: client.goaway is not None, timeout_s=5)
        assert client.goaway is not None and client.goaway.error_code == 0xB  # ENHANCE_YOUR_CALM
        assert client.goaway_debug == b"too_many_pings"


# ---------------------------------------------------------------- resume


def test_grpc_resume_when_reconnect_with_last_event_id_then_the_rest_of_the_answer(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    tokens = 30
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        stub = pbg.ChatCompletionsStub(channel)
        first = stub.Create(_request(), metadata=_metadata("g-resume", tokens, 0.02), timeout=20)
        got = [next(first), next(first), next(first)]
        stream_id = dict(first.initial_metadata())["x-tokenwire-stream-id"]
        first.cancel()
        assert [m.event_id for m in got] == [f"{stream_id}.1", f"{stream_id}.2", f"{stream_id}.3"]
        again = stub.Create(_request(), metadata=[("last-event-id", got[-1].event_id),
                                                  ("x-request-id", "g-resume-2")], timeout=20)
        rest = list(again)
        assert again.code() is grpc.StatusCode.OK
        assert rest[0].event_id == f"{stream_id}.4"
        assert _text(got + rest) == expected_text(tokens)
        unknown = stub.Create(_request(), metadata=[("last-event-id", "nosuchstream.3")], timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(unknown)
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        assert dict(error.value.trailing_metadata())["tokenwire-error-number"] == "E7300"


def test_grpc_and_sse_on_one_port(start_sidecar: Callable[..., RunningSidecar]) -> None:
    """The same port serves SSE to an HTTP/1.1 client while gRPC calls run."""
    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call = pbg.ChatCompletionsStub(channel).Create(_request(), metadata=_metadata("g-mixed", 20, 0.01),
                                                       timeout=10)
        response = httpx.post(f"{sidecar.url}/v1/chat/completions", headers={"x-fake-tokens": "3"},
                              json={"model": "m", "stream": True, "messages": []}, timeout=10)
        assert response.status_code == 200 and "[DONE]" in response.text
        assert _text(list(call)) == expected_text(20)
