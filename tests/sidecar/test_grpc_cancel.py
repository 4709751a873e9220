"""Cancel by id over gRPC: ``tokenwire.v1.Streams/CancelStream``, with grpcio on real sockets.

A streaming call is cancelled by its own client (``CANCELLED``); a stream
another call made (one that left inside the resume grace, or one still
being read) is stopped by id with the unary ``CancelStream``, which is the
HTTP ``DELETE /v1/streams/{id}`` made over gRPC: the same owner check (the
``authorization`` metadata, hashed as the ``Authorization`` header is), the
same ``answer_cancel`` and ``registry.stop_writer``, the same answers mapped
to statuses by ``errors.py``'s table.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from clients import wait_for
from conftest import RunningSidecar
from tokenwire.middleware import EndReason
from upstreams import FakeUpstream, ScriptedUpstream, expected_text

from tokenwire.v1 import streaming_pb2 as pb
from tokenwire.v1 import streaming_pb2_grpc as pbg

ALICE = ("authorization", "Bearer sk-alice")
MALLORY = ("authorization", "Bearer sk-mallory")
# Issue 34's bound for the HTTP cancel, held here too: the owner's cancel
# reaches the upstream as a closed connection within this, at the median.
ABORTED_WITHIN_S = 0.050
RUNS = 20


def _request() -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(model="m", messages=[pb.ChatMessage(role="user", content="hi")], seed=1)


def _start(channel: grpc.Channel, request_id: str, *, tokens: int = 5000, delay_s: float = 0.005,
           owner: tuple[str, str] = ALICE) -> tuple[Any, list[pb.ChatCompletionChunk], str]:
    """A long streaming call, its first three messages read: (call, messages, stream id)."""
    call = pbg.ChatCompletionsStub(channel).Create(
        _request(), timeout=60, metadata=[owner, ("x-request-id", request_id),
                                          ("x-fake-tokens", str(tokens)), ("x-fake-delay-s", str(delay_s))])
    got = [next(call), next(call), next(call)]
    return call, got, dict(call.initial_metadata())["x-tokenwire-stream-id"]


def _cancel(channel: grpc.Channel, stream_id: str, owner: tuple[str, str] | None = ALICE,
            ) -> pb.CancelStreamReply:
    return pbg.StreamsStub(channel).CancelStream(pb.CancelStreamRequest(stream_id=stream_id), timeout=10,
                                                 metadata=[owner] if owner else None)


def _refused(channel: grpc.Channel, stream_id: str, owner: tuple[str, str] | None = ALICE) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _cancel(channel, stream_id, owner)
    return refused.value


def _trailers(error: grpc.RpcError) -> dict[str, str]:
    return {key: str(value) for key, value in error.trailing_metadata() or ()}


def _text(messages: list[pb.ChatCompletionChunk]) -> str:
    return "".join(choice.content for message in messages for choice in message.choices)


def test_owner_cancel_aborts_the_upstream_and_the_streaming_call_ends_cancelled(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    delays_s: list[float] = []
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        for run in range(RUNS):
            request_id = f"g-cancel-id-{run}"
            call, got, stream_id = _start(channel, request_id)
            connection = upstream.connection_of(request_id)
            asked_at = time.monotonic()
            reply = _cancel(channel, stream_id)
            assert (reply.stream_id, reply.status) == (stream_id, "cancelled")
            assert connection.closed.wait(5)
            assert connection.peer_closed_at is not None
            delays_s.append(connection.peer_closed_at - asked_at)
            # The call still reading it: the rest it had not read, then the cancel as its status.
            rest: list[pb.ChatCompletionChunk] = []
            with pytest.raises(grpc.RpcError) as ended:
                rest.extend(call)
            assert ended.value.code() is grpc.StatusCode.CANCELLED, ended.value
            assert _trailers(ended.value)["tokenwire-error-code"] == "cancelled"
            assert _trailers(ended.value)["tokenwire-error-number"] == "E7301"
            assert expected_text(5000).startswith(_text(got + rest))
            assert len(_text(got + rest)) < len(expected_text(5000))
            assert sidecar.record(request_id).end_reason is EndReason.CANCELLED
    print(f"gRPC CancelStream to upstream closed: median {statistics.median(delays_s) * 1000:.2f} ms, "
          f"max {max(delays_s) * 1000:.2f} ms over {RUNS}")
    assert statistics.median(delays_s) <= ABORTED_WITHIN_S, sorted(delays_s)


def test_a_call_that_left_inside_the_grace_is_stopped_by_id_and_its_resume_reads_why(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call, got, stream_id = _start(channel, "g-left")
        call.cancel()  # the client leaves; the grace keeps the answer generating
        connection = upstream.connection_of("g-left")
        assert not connection.closed.wait(0.3)  # not a fixed sleep: the grace is 10 s
        assert _cancel(channel, stream_id).status == "cancelled"
        assert connection.closed.wait(5)
        assert sidecar.record("g-left").end_reason is EndReason.CANCELLED
        again = pbg.ChatCompletionsStub(channel).Create(
            _request(), timeout=10, metadata=[ALICE, ("last-event-id", got[-1].event_id)])
        with pytest.raises(grpc.RpcError) as told:
            list(again)
        assert told.value.code() is grpc.StatusCode.CANCELLED
        assert _trailers(told.value)["tokenwire-error-code"] == "cancelled"
        # Cancelled and forgotten only once its stored part expires: a second cancel says it ended.
        assert _cancel(channel, stream_id).status == "ended"


def test_another_caller_and_an_unknown_id_get_the_same_not_found_and_the_stream_goes_on(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    tokens = 300
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        call, got, stream_id = _start(channel, "g-not-yours", tokens=tokens, delay_s=0.005)
        unknown = _refused(channel, "NoSuchStreamAtAll", MALLORY)
        assert unknown.code() is grpc.StatusCode.NOT_FOUND
        assert _trailers(unknown)["tokenwire-error-code"] == "stream_not_found"
        assert _trailers(unknown)["tokenwire-error-number"] == "E7300"
        for other in (MALLORY, None):
            refused = _refused(channel, stream_id, other)
            assert refused.code() is grpc.StatusCode.NOT_FOUND
            # The very answer of an unknown id: only the id it names differs.
            assert refused.details() == unknown.details().replace("NoSuchStreamAtAll", stream_id)
            assert _trailers(refused) == _trailers(unknown)
        assert upstream.connection_of("g-not-yours").peer_closed_at is None
        rest = list(call)  # the owner's call reads on to the end
        assert call.code() is grpc.StatusCode.OK
        assert _text(got + rest) == expected_text(tokens)
    assert sidecar.record("g-not-yours").end_reason is EndReason.COMPLETE


def test_bad_ids_and_messages_are_refused_by_their_statuses_and_nothing_is_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True)
    before = len(upstream.requests)
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        # An id that would be another path or a query over HTTP is only an unknown id.
        for odd in ("../../v1/chat/completions", "abc?x=1", "a/b", "é"):
            assert _refused(channel, odd).code() is grpc.StatusCode.NOT_FOUND
        assert _refused(channel, "").code() is grpc.StatusCode.INVALID_ARGUMENT
        garbage = channel.unary_unary("/tokenwire.v1.Streams/CancelStream")
        with pytest.raises(grpc.RpcError) as malformed:
            garbage(b"\xff\xff\xff", timeout=10)
        assert malformed.value.code() is grpc.StatusCode.INTERNAL
    assert len(upstream.requests) == before


@pytest.mark.slow
def test_a_stream_another_replica_writes_is_cancelled_there_through_the_store(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, redis_url: str) -> None:
    """The replica the call reaches passes the cancel on to the writer's
    (``redis_cancel.py``); ``stream_elsewhere`` is left for a stream no process
    stops (tests/sidecar/test_cancel_replicas.py)."""
    shared = {"resume": True, "resume_grace_s": 10.0, "resume_store": redis_url,
              "resume_owner_secret": "replicas-share-this"}
    writer, other = start_sidecar(**shared), start_sidecar(**shared)
    with grpc.insecure_channel(f"{writer.host}:{writer.port}") as near, \
            grpc.insecure_channel(f"{other.host}:{other.port}") as far:
        call, _, stream_id = _start(near, "g-elsewhere")
        # Another caller asking the other replica: the 404 of an unknown id, not a hint.
        assert _refused(far, stream_id, MALLORY).code() is grpc.StatusCode.NOT_FOUND
        assert upstream.connection_of("g-elsewhere").peer_closed_at is None
        assert _cancel(far, stream_id).status == "cancelled"
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() is grpc.StatusCode.CANCELLED
        connection = upstream.connection_of("g-elsewhere")
        wait_for(lambda: connection.peer_closed_at is not None, timeout_s=5)


def test_with_resume_off_the_cancel_goes_to_the_engine_as_the_http_delete_does(
        start_sidecar: Callable[..., RunningSidecar], recorder: ScriptedUpstream) -> None:
    """No stream ids without resume: the engine is asked (the tokenwire
    engine has the route), with the caller's metadata, and its 404 is NOT_FOUND."""
    seen = threading.Event()

    async def not_found(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.set()
        body = b'{"error":{"message":"no stream abc","type":"invalid_request_error","code":null}}'
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    recorder.respond = not_found  # type: ignore[assignment]
    sidecar = start_sidecar(recorder.url)
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        refused = _refused(channel, "abc")
    assert seen.is_set()
    assert refused.code() is grpc.StatusCode.NOT_FOUND and refused.details() == "no stream abc"
    head = bytes(recorder.received).split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"delete /v1/streams/abc http/1.1\r\n")
    assert b"\r\nauthorization: bearer sk-alice" in head
    # gRPC's own metadata is not the engine's (the user agent is the client's, kept).
    assert b"\r\ngrpc-" not in head and b"application/grpc" not in head and b"\r\nte:" not in head


def test_reflection_lists_the_streams_service_and_describes_cancel_stream(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    sidecar = start_sidecar()
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "tokenwire.v1.Streams" in set(database.get_services())
        (method,) = DescriptorPool(database).FindServiceByName("tokenwire.v1.Streams").methods
    assert (method.name, method.input_type.full_name, method.output_type.full_name) == (
        "CancelStream", "tokenwire.v1.CancelStreamRequest", "tokenwire.v1.CancelStreamReply")
    assert not method.server_streaming and not method.client_streaming


# ---------------------------------------------------------------- sans-IO


def test_the_request_becomes_the_http_target_with_the_id_percent_encoded() -> None:
    from tokenwire.sidecar.grpc_gateway.cancel import cancel_target
    from tokenwire.sidecar.grpc_gateway.framing import GrpcCallError

    def target(stream_id: str) -> bytes:
        return cancel_target(pb.CancelStreamRequest(stream_id=stream_id).SerializeToString())

    assert target("AbC-_9") == b"/v1/streams/AbC-_9"
    # Never another path or a query: the resume rules find these ids unknown.
    assert target("a/b?c#d") == b"/v1/streams/a%2Fb%3Fc%23d"
    assert target("é") == b"/v1/streams/%C3%A9"
    for bad, status in ((pb.CancelStreamRequest().SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
                        (b"\xff\xff", grpc.StatusCode.INTERNAL)):
        with pytest.raises(GrpcCallError) as refused:
            cancel_target(bad)
        assert refused.value.status == status.value[0]


def test_the_cores_refusals_map_by_their_code_an_engines_failure_by_its_status() -> None:
    from tokenwire.middleware.core.errors import ErrorCode, GrpcStatus, UpstreamError
    from tokenwire.middleware.core.resume import stream_elsewhere, stream_not_found
    from tokenwire.sidecar.grpc_gateway.cancel import cancel_status

    assert cancel_status(stream_elsewhere("s"), 409).status is GrpcStatus.FAILED_PRECONDITION
    assert cancel_status(stream_not_found("s"), 404).status is GrpcStatus.NOT_FOUND
    engine = UpstreamError("bad", ErrorCode.UPSTREAM_FAILED, http_status=400)
    assert cancel_status(engine, 400).status is GrpcStatus.INVALID_ARGUMENT


def test_a_forwarded_error_event_with_a_tokenwire_code_ends_the_call_by_that_code() -> None:
    from tokenwire.middleware.core.errors import ErrorCode, GrpcStatus, UpstreamErrorEvent
    from tokenwire.sidecar.grpc_gateway.call import _typed_status

    stored = UpstreamErrorEvent({"error": {"message": "the stream was cancelled", "type": "server_error",
                                           "tokenwire": {"code": "cancelled", "number": "E7301"}}})
    assert stored.code is ErrorCode.UPSTREAM_FAILED  # the core's word for any forwarded event
    status = _typed_status(stored, None)
    assert (status.status, status.code) == (GrpcStatus.CANCELLED, ErrorCode.CANCELLED)
    engines = UpstreamErrorEvent({"error": {"message": "CUDA", "type": "InternalServerError", "code": 500}})
    assert _typed_status(engines, None).status is GrpcStatus.UNAVAILABLE
    odd = UpstreamErrorEvent({"error": {"message": "x", "tokenwire": {"code": "no_such_code"}}})
    assert _typed_status(odd, None).code is ErrorCode.UPSTREAM_FAILED
