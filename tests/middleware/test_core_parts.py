"""The core's parts and their states, watched through a WireStream driven as a
driver would drive it; and driver.py, the module every driver shares (its
timer on a real event loop, its resume entry against a real memory store)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import (
    ClientGone,
    EndReason,
    FailureKind,
    LocalProtocolError,
    ReaderAttached,
    ReplayAppend,
    SocketPaused,
    SocketResumed,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
    WireConfig,
)
from tokenwire.middleware.core.attempt import AttemptPhase
from tokenwire.middleware.core.chunks import plain_event_count, read_chunk
from tokenwire.middleware.core.client_socket import SocketPhase
from tokenwire.middleware.core.errors import ErrorCode
from tokenwire.middleware.core.lifecycle import StreamState, Trigger, next_state
from tokenwire.middleware.core.recording import RecorderPhase
from tokenwire.middleware.core.resume import CallerKey, ResumeFrom
from tokenwire.middleware.core.sse import SSEParser
from tokenwire.middleware.shared.driver import DeadlineTimer, enter_resume, needs_body
from tokenwire.middleware.shared.replay_store import MemoryReplayStore

from .wire_harness import SSE_HEADERS, Driver, chunk, proxy_config

DONE = "[DONE]"


def sse(*datas: str) -> UpstreamData:
    return UpstreamData(b"".join(b"data: " + d.encode() + b"\n\n" for d in datas))


def test_lifecycle_when_trigger_not_in_table_then_local_protocol_error() -> None:
    assert next_state(StreamState.WAITING, Trigger.COMMIT) is StreamState.COMMITTED
    with pytest.raises(LocalProtocolError, match="can't send in state waiting"):
        next_state(StreamState.WAITING, Trigger.SEND)
    with pytest.raises(LocalProtocolError):
        next_state(StreamState.ABORTED, Trigger.ABORT)


def test_attempt_when_retried_then_answered_then_phases_follow_the_docstring() -> None:
    d = Driver(proxy_config(retry_attempts=1, retry_backoff_s=0.5))
    attempt = d.stream._attempt
    assert attempt.phase is AttemptPhase.CONNECTING
    d.send(UpstreamFailed(FailureKind.CONNECT, "refused"), at=0.1)
    assert attempt.phase is AttemptPhase.BACKOFF and attempt.retry_at == pytest.approx(0.6)
    d.send(UpstreamData(b""), at=0.3)  # a dropped attempt's late bytes change nothing
    assert attempt.phase is AttemptPhase.BACKOFF
    d.send(Tick(), at=0.6)
    assert attempt.phase is AttemptPhase.CONNECTING and attempt.number == 1
    d.send(UpstreamHeaders(200, SSE_HEADERS), at=0.7)
    assert attempt.phase is AttemptPhase.EVENT_STREAM
    d.send(UpstreamEnded(), at=0.8)
    assert attempt.phase is AttemptPhase.CLOSED


def test_attempt_when_error_status_after_commit_then_late_error_reads_its_body() -> None:
    d = Driver(proxy_config(commit_deadline_s=1.0))
    d.send(SocketResumed(), at=1.0)  # the commit deadline passes: the SSE headers go out
    assert d.stream.state is StreamState.COMMITTED
    d.send(UpstreamHeaders(500, ((b"content-type", b"application/json"),)), at=1.5)
    assert d.stream._attempt.phase is AttemptPhase.LATE_ERROR
    d.send(UpstreamData(b'{"error": {"message": "engine fell over", "code": 500}}'), at=1.6)
    d.send(UpstreamEnded(), at=1.7)
    assert b"engine fell over" in d.written
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


def test_client_socket_when_paused_writing_gone_then_phases_follow() -> None:
    d = Driver(proxy_config(), auto_complete=False)
    client = d.stream._client
    assert client.phase is SocketPhase.WRITABLE
    d.sse_headers(at=0.0)
    d.send(sse(chunk("hi")), at=0.1)
    assert client.phase is SocketPhase.WRITING
    d.send(SocketPaused(), at=0.2)
    assert client.phase is SocketPhase.PAUSED
    d.send(ClientGone(), at=0.3)
    assert client.phase is SocketPhase.GONE


def test_recorder_when_client_leaves_and_reader_attaches_then_recording_ends_detached() -> None:
    config = proxy_config(resume=True, resume_grace_s=5.0)
    d = Driver(config, stream_id="s1")
    recorder, hold = d.stream._resume, d.stream._hold
    assert recorder.phase is RecorderPhase.RECORDING
    d.sse_headers(at=0.0)
    d.send(sse(chunk("one")), at=0.1)
    d.send(ClientGone(), at=0.2)
    assert hold.until == pytest.approx(5.2) and d.stream.state is StreamState.STREAMING
    d.send(ReaderAttached(), at=0.3)
    assert hold.until is None and hold.reader_attached
    d.send(sse(chunk("two"), DONE), at=0.4)
    d.send(UpstreamEnded(), at=0.5)
    assert recorder.phase is RecorderPhase.ENDED
    appended = d.of(ReplayAppend)
    assert [f for a in appended for f in a.frames][-1] == f"data: {DONE}\n\n".encode()
    assert appended[-1].end is EndReason.COMPLETE
    assert d.finished.record.end_reason is EndReason.DETACHED


def test_recorder_when_past_resume_max_bytes_then_overflowed_and_stops_recording() -> None:
    d = Driver(proxy_config(resume=True, resume_max_bytes=200), stream_id="s2")
    d.sse_headers(at=0.0)
    for n in range(6):
        d.send(sse(chunk(f"chunk number {n}")), at=0.1 * n)
    assert d.stream._resume.phase is RecorderPhase.OVERFLOWED
    overflowed = [a for a in d.of(ReplayAppend) if a.overflow]
    assert len(overflowed) == 1


def test_accounting_when_counter_assigned_then_read_only() -> None:
    d = Driver(proxy_config())
    d.sse_headers(at=0.0)
    d.send(sse(chunk("a")), at=0.1)
    d.send(sse(chunk("b")), at=0.2)
    assert d.stream.events_in == 2 and d.stream.events_out == 2
    with pytest.raises(AttributeError):  # a property without a setter, compiled or not
        d.stream.events_in = 0  # type: ignore[misc]


def test_read_chunk_when_text_finish_usage_or_error_then_client_view() -> None:
    facts = read_chunk('{"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}],'
                       '"usage":{"completion_tokens":3}}')
    assert (facts.text, facts.finish_reason, facts.completion_tokens, facts.error) == ("hi", "stop", 3, None)
    assert read_chunk('{"error": {"message": "no"}}').error == 'in-band error: {"message": "no"}'
    assert read_chunk("not json").error == "non-JSON event: not json"


# ------------------------------------------------------------------ driver.py


def test_deadline_timer_when_armed_later_then_earlier_then_fires_once_at_the_earlier_never_before() -> None:
    asyncio.run(_deadline_timer())


async def _deadline_timer() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    done = asyncio.Event()

    def on_tick(now: float) -> None:
        fired.append(now)
        done.set()

    timer = DeadlineTimer(loop, on_tick)
    start = loop.time()
    timer.arm(start + 30.0)
    timer.arm(start + 0.05)  # moves it earlier
    timer.arm(start + 10.0)  # a later deadline never moves it later
    timer.arm(None)
    await asyncio.wait_for(done.wait(), timeout=20.0)
    assert len(fired) == 1 and start + 0.05 <= fired[0] < start + 10.0  # the earlier one, not the later
    timer.arm(loop.time() + 0.01)
    timer.cancel()
    await asyncio.sleep(0.05)
    assert len(fired) == 1


def test_enter_resume_when_reconnect_reused_key_or_plain_then_one_answer_for_every_driver() -> None:
    asyncio.run(_enter_resume())


async def _enter_resume() -> None:
    store = MemoryReplayStore.from_config(WireConfig(resume=True))
    key = CallerKey(b"authorization", b"secret")
    alice = [(b"authorization", b"Bearer alice")]
    entry = await enter_resume(store, key, method="POST", path="/v1/chat/completions", headers=alice,
                               body=b"{}", stream_id="s1", open_now=True)
    assert entry.opened and entry.replay is None and entry.refusal is None
    again = await enter_resume(store, key, method="GET", path="/v1/streams/s1", headers=alice,
                               body=b"", stream_id="s2", open_now=True)
    assert again.replay == ResumeFrom("s1", 0) and again.reconnect
    bob = [(b"authorization", b"Bearer bob")]
    stranger = await enter_resume(store, key, method="GET", path="/v1/streams/s1", headers=bob,
                                  body=b"", stream_id="s3", open_now=True)
    assert stranger.refusal is not None and stranger.refusal.code is ErrorCode.STREAM_NOT_FOUND
    keyed = [*alice, (b"idempotency-key", b"k1")]
    assert needs_body("POST", keyed) and not needs_body("POST", alice)
    first = await enter_resume(store, key, method="POST", path="/v1/x", headers=keyed, body=b"a",
                               stream_id="s4", open_now=False)
    assert first.opened and first.replay is None
    repeat = await enter_resume(store, key, method="POST", path="/v1/x", headers=keyed, body=b"a",
                                stream_id="s5", open_now=False)
    assert repeat.replay == ResumeFrom("s4", 0) and not repeat.reconnect
    reused = await enter_resume(store, key, method="POST", path="/v1/x", headers=keyed, body=b"b",
                                stream_id="s6", open_now=False)
    assert reused.refusal is not None and reused.refusal.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    await store.aclose()


_EVENT_PIECES = st.lists(st.sampled_from([
    'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', "data: plain text\n\n", "data: héllo\n\n",
    'data: {"usage":null}\n\n', 'data: {"usage": null}\n\n', 'data: {"usage":{"total_tokens":3}}\n\n',
    'data: {"error":"x"}\n\n', "data: [DONE]\n\n", ": comment\n\n", "event: x\ndata: y\n\n",
    "data: a\r\n\r\n", "data: a\ndata: b\n\n", "id: 1\ndata: z\n\n", "data: cut", "\n",
]), min_size=1, max_size=5)


@settings(max_examples=500, deadline=None)
@given(pieces=_EVENT_PIECES, raw_tail=st.sampled_from([b"", b"\xff\n\n", b"data: \xc3\n\n"]))
def test_plain_event_count_when_non_zero_then_that_many_plain_events_the_parser_agrees_with(
        pieces: list[str], raw_tail: bytes) -> None:
    # The keeps-up path passes a read through unparsed only when this says it is
    # nothing but plain data events; the parser must then see exactly that many,
    # none of them the marker, an error, a usage block or anything but ``data``.
    data = "".join(pieces).encode() + raw_tail
    count = plain_event_count(data, 1 << 20, "[DONE]")
    parser = SSEParser()
    events = parser.feed(data)
    if count:
        assert parser.at_boundary and len(events) == count
        for sse_event in events:
            assert sse_event.event in (None, "message") and sse_event.id is None
            assert sse_event.data != "[DONE]" and '"error"' not in sse_event.data
            assert '"usage":{' not in sse_event.data
        assert data.decode() == "".join(f"data: {sse_event.data}\n\n" for sse_event in events)
    elif data.startswith(b"data: ") and raw_tail == b"" and all(
            piece.startswith("data: ") and piece.endswith("\n\n") and piece.count("\n") == 2
            and "[DONE]" not in piece and "error" not in piece and "\r" not in piece
            and '"total_tokens"' not in piece for piece in pieces):
        raise AssertionError(f"plain events not counted: {data!r}")
