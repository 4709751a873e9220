"""``tokenwire-summary: true`` over gRPC: the stream's figures as trailers.

Over SSE the core queues ``event: tokenwire.summary`` just before ``[DONE]``
for a client that asked; over gRPC that event is never a message: its
figures ride on the OK ending's trailers (``tokenwire-tokens``, ...), and a
call that did not ask gets none of them. Sans-IO through the real wire core,
then end to end with grpcio through a real sidecar.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import grpc
from conftest import RunningSidecar
from tokenwire.middleware import (
    CloseClient,
    CommitHeaders,
    Finished,
    UpstreamEnded,
    UpstreamHeaders,
    WireStream,
    WriteCompleted,
)
from tokenwire.middleware.core.record import StreamRecord
from tokenwire.sidecar.grpc_gateway.call import Ending, ResponseTranscoder, summary_trailers
from tokenwire.sidecar.grpc_gateway.framing import MessageReader
from tokenwire.sidecar.grpc_gateway.routing import STREAM_METHODS
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS
from upstreams import expected_text

from tests.middleware.wire_harness import SSE_HEADERS, chunk, event
from tokenwire.v1 import streaming_pb2 as pb
from tokenwire.v1 import streaming_pb2_grpc as pbg

CHAT = STREAM_METHODS[b"/tokenwire.v1.ChatCompletions/Create"]
SUMMARY_TRAILERS = (b"tokenwire-ttft-s", b"tokenwire-tokens", b"tokenwire-tokens-source",
                    b"tokenwire-tokens-per-s", b"tokenwire-duration-s", b"tokenwire-events-out",
                    b"tokenwire-coalesced-events", b"tokenwire-retries")


class SummaryCall:
    """The wire core (``summary`` as asked) and a transcoder, wired as the exchange wires them."""

    def __init__(self, *, summary: bool) -> None:
        self.now = 0.0
        wire = replace(SIDECAR_WIRE_DEFAULTS, heartbeat_s=0.0)
        self.core = WireStream(wire, now=0.0, request_id="r1", expect_stream=True,
                               frames=frozenset({"summary"} if summary else ()))
        self.transcoder = ResponseTranscoder(CHAT)
        self.wire = bytearray()
        self.ending: Ending | None = None
        self.record: StreamRecord | None = None

    def feed(self, item: object) -> None:
        self._run(self.core.handle(item, self.now))  # type: ignore[arg-type]

    def _run(self, actions: list[object]) -> None:
        for action in actions:
            if isinstance(action, CommitHeaders):
                self.transcoder.on_headers(action.status, action.headers)
            elif isinstance(action, CloseClient):
                self.ending = self.transcoder.on_end(self.core, abrupt=action.abrupt, reset=action.reset)
            elif isinstance(action, Finished):
                self.record = action.record
        while data := self.core.data_to_send(self.now):
            self.wire += self.transcoder.on_body(data, self.core)
            self._run(self.core.handle(WriteCompleted(), self.now))

    def messages(self) -> list[pb.ChatCompletionChunk]:
        out = []
        for raw in MessageReader().feed(bytes(self.wire)):
            message = pb.ChatCompletionChunk()
            message.ParseFromString(raw)
            out.append(message)
        return out

    def run_answer(self) -> None:
        self.feed(UpstreamHeaders(200, SSE_HEADERS))
        self.feed(event(chunk(role="assistant")))
        for word in ("Hello", ", ", "world"):
            self.now += 0.25
            self.feed(event(chunk(word)))
        self.now += 0.25
        self.feed(event(chunk(finish="stop")))
        self.feed(event("[DONE]"))
        self.feed(UpstreamEnded())


def test_the_summary_event_becomes_trailers_never_a_message() -> None:
    call = SummaryCall(summary=True)
    call.run_answer()
    messages = call.messages()
    assert [m.choices[0].content for m in messages] == ["", "Hello", ", ", "world", ""]
    assert not any("tokenwire" in m.chunk_json or "ttft_s" in m.chunk_json for m in messages)
    assert call.ending is not None and not call.ending.trailers_only
    trailers = dict(call.ending.headers)
    assert trailers[b"grpc-status"] == b"0"
    assert call.record is not None
    tokens, source = call.record.tokens_out
    assert trailers[b"tokenwire-tokens"] == str(tokens).encode() and tokens == 3
    assert trailers[b"tokenwire-tokens-source"] == source.encode()
    assert float(trailers[b"tokenwire-ttft-s"]) == 0.25  # injected time: the first text at 0.25 s
    assert float(trailers[b"tokenwire-duration-s"]) == 1.0
    assert float(trailers[b"tokenwire-tokens-per-s"]) == round(3 / 0.75, 3)
    assert set(SUMMARY_TRAILERS) <= set(trailers)
    assert list(call.ending.extra) == [(k, v) for k, v in call.ending.headers if k.startswith(b"tokenwire-")]


def test_a_call_that_did_not_ask_gets_no_summary_trailers() -> None:
    call = SummaryCall(summary=False)
    call.run_answer()
    assert call.ending is not None
    assert dict(call.ending.headers) == {b"grpc-status": b"0"} and call.ending.extra == ()
    assert len(call.messages()) == 5


def test_an_ending_that_is_not_ok_carries_no_summary() -> None:
    call = SummaryCall(summary=True)
    call.feed(UpstreamHeaders(200, SSE_HEADERS))
    call.feed(event(chunk("Hello")))
    call.feed(UpstreamEnded())  # no terminal marker: the core queues no summary, the call is not OK
    assert call.ending is not None
    trailers = dict(call.ending.headers)
    assert trailers[b"grpc-status"] != b"0"
    assert not any(name in trailers for name in SUMMARY_TRAILERS) and call.ending.extra == ()


def test_summary_trailers_skip_null_figures_and_bad_json() -> None:
    body = {"ttft_s": None, "tokens": 0, "tokens_source": "counted", "tokens_per_s": None,
            "duration_s": 0.5, "events_out": 2, "coalesced_events": 0, "retries": 1}
    assert dict(summary_trailers(json.dumps(body))) == {
        b"tokenwire-tokens": b"0", b"tokenwire-tokens-source": b"counted", b"tokenwire-duration-s": b"0.5",
        b"tokenwire-events-out": b"2", b"tokenwire-coalesced-events": b"0", b"tokenwire-retries": b"1"}
    assert summary_trailers("not json") == [] and summary_trailers("[1]") == []


# ---------------------------------------------------------------- end to end, grpcio


def _request() -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(model="m", messages=[pb.ChatMessage(role="user", content="hi")], seed=1)


def test_grpc_when_summary_asked_then_figures_as_trailers_matching_the_record(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    trailing: dict[bool, dict[str, str]] = {}
    with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
        stub = pbg.ChatCompletionsStub(channel)
        for asked in (True, False):
            metadata = [("x-request-id", f"g-summary-{asked}"), ("x-fake-tokens", "7"),
                        *([("tokenwire-summary", "true")] if asked else [])]
            call = stub.Create(_request(), metadata=metadata, timeout=30)
            messages = list(call)
            assert call.code() is grpc.StatusCode.OK
            text = "".join(c.content for m in messages for c in m.choices)
            assert text == expected_text(7)
            assert not any("ttft_s" in m.chunk_json for m in messages)
            trailing[asked] = {k: v for k, v in call.trailing_metadata() if isinstance(v, str)}
    record = sidecar.record("g-summary-True")
    tokens, source = record.tokens_out
    got = trailing[True]
    assert got["tokenwire-tokens"] == str(tokens) and tokens > 0
    assert got["tokenwire-tokens-source"] == source
    ttft_s, duration_s = float(got["tokenwire-ttft-s"]), float(got["tokenwire-duration-s"])
    assert 0 <= ttft_s <= duration_s
    assert "tokenwire-tokens-per-s" in got or duration_s == ttft_s
    sidecar.record("g-summary-False")
    assert not any(name.decode() in trailing[False] for name in SUMMARY_TRAILERS)
