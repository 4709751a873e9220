"""The wire core's resume rules, sans-IO: numbering, recording, replay, grace.
Time is injected; nothing sleeps. The memory store is tested with an injected clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import (
    AbortUpstream,
    AwaitReader,
    ClientError,
    ClientGone,
    CloseClient,
    EndReason,
    ErrorCode,
    FailureKind,
    LocalProtocolError,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ReplaySource,
    SocketPaused,
    StopRequested,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    WireConfig,
)
from tokenwire.middleware.core.resume import CancelStream, Idempotent, ResumeFrom, classify, parse_event_id
from tokenwire.middleware.shared.replay_store import MemoryReplayStore, ReplayUnavailable, StreamNotFound

from .wire_harness import PROXY_DEFAULTS, Driver, chunk, parse_all, proxy_config, texts

RESUME = proxy_config(resume=True, resume_retry_ms=800)
SID = "Stream123"


def frames_of(chunks: list[str]) -> bytes:
    return b"".join(b"data: " + c.encode() + b"\n\n" for c in chunks)


def resumable(config: WireConfig = RESUME, **kwargs: Any) -> Driver:
    driver = Driver(config, stream_id=SID, **kwargs)
    driver.sse_headers()
    return driver


def recorded(driver: Driver) -> list[bytes]:
    """Every frame the core handed to the store, checking the numbering is gapless."""
    frames: list[bytes] = []
    for append in driver.of(ReplayAppend):
        assert append.stream_id == SID and append.first_seq == len(frames) + 1
        frames += append.frames
    return frames


def test_every_event_is_numbered_and_recorded_without_its_id() -> None:
    d = resumable()
    d.send(UpstreamData(frames_of([chunk("a")])), at=0.1)  # commits (parser path)
    d.send(UpstreamData(frames_of([chunk("b")])), at=0.15)  # the fast path
    d.send(UpstreamData(b"event: note\ndata: x\n\n"), at=0.2)  # the parser path
    d.send(UpstreamData(b"data: [DONE]\n\n"), at=0.3)
    assert dict(d.commit.headers)[b"x-tokenwire-stream-id"] == SID.encode()
    events = parse_all(d.written)
    # No frame without data (a bare retry: or id: is an empty event to some decoders).
    assert all(e.data for e in events if e.comment is None)
    events = [e for e in events if e.comment is None]
    assert [e.retry for e in events] == [800, None, None, None]
    assert [e.id for e in events] == [f"{SID}.{n}" for n in range(1, 5)]
    frames = recorded(d)
    assert frames == [b"data: " + chunk("a").encode() + b"\n\n", b"data: " + chunk("b").encode() + b"\n\n",
                      b"event: note\ndata: x\n\n", b"data: [DONE]\n\n"]
    assert d.of(ReplayAppend)[-1].end is EndReason.COMPLETE
    assert d.of(ReplayAppend).index(d.of(ReplayAppend)[-1]) == len(d.of(ReplayAppend)) - 1


def test_coalesced_events_carry_the_newest_id_and_are_recorded_one_by_one() -> None:
    d = resumable(auto_complete=False)
    d.send(UpstreamData(frames_of([chunk("a")])), at=0.1)  # a write is now in flight
    for text in "bcd":
        d.send(UpstreamData(frames_of([chunk(text)])))
    d.complete()
    merged = [e for e in parse_all(d.writes[-1]) if e.data is not None]
    assert len(merged) == 1 and merged[0].id == f"{SID}.4" and texts(merged) == "bcd"
    assert len(recorded(d)) == 4


def test_an_upstream_id_is_replaced_by_ours() -> None:
    d = resumable()
    d.send(UpstreamData(b"id: theirs-7\ndata: x\n\n"), at=0.1)
    assert [e.id for e in parse_all(d.written) if e.data] == [f"{SID}.1"]
    assert recorded(d) == [b"data: x\n\n"]


def test_resume_needs_a_stream_id() -> None:
    with pytest.raises(ValueError, match="stream_id"):
        Driver(RESUME)


def test_the_per_stream_cap_stops_recording_and_says_so_once() -> None:
    d = resumable(proxy_config(resume=True, resume_max_bytes=300))
    for text in "abcdefgh":
        d.send(UpstreamData(frames_of([chunk(text * 20)])), at=0.1)
    overflows = [a for a in d.of(ReplayAppend) if a.overflow]
    assert len(overflows) == 1
    assert sum(len(f) for f in recorded(d)) <= 300
    # The live client still gets everything.
    assert texts(parse_all(d.written)) == "".join(t * 20 for t in "abcdefgh")


def test_a_failure_before_the_first_event_discards_the_stream() -> None:
    d = Driver(RESUME.replace(retry_attempts=0), stream_id=SID)
    d.send(UpstreamFailed(FailureKind.CONNECT, "refused"), at=0.1)
    appends = d.of(ReplayAppend)
    assert len(appends) == 1 and appends[0].discard and appends[0].frames == ()


def test_a_client_that_leaves_without_grace_ends_the_stored_stream_with_cancelled() -> None:
    d = resumable()
    d.send(UpstreamData(frames_of([chunk("a")])), at=0.1)
    assert d.stream.departure_aborts_upstream()  # what a driver cuts on, ahead of ClientGone
    d.send(ClientGone(), at=0.2)
    assert d.of(AbortUpstream) and not d.of(AwaitReader)
    assert not d.stream.departure_aborts_upstream()  # over: nothing left to abort
    last = d.of(ReplayAppend)[-1]
    assert last.end is EndReason.CLIENT_GONE
    assert json.loads(last.frames[-1][len(b"data: "):])["error"]["code"] == "cancelled"
    assert len(recorded(d)) == 2


def test_grace_holds_the_stream_then_aborts_at_its_deadline() -> None:
    d = resumable(proxy_config(resume=True, resume_grace_s=2.0, heartbeat_s=0.5))
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    written = len(d.written)
    assert not d.stream.departure_aborts_upstream()  # held instead: a driver must not cut
    d.send(ClientGone(), at=1.5)
    assert d.of(AwaitReader) == [AwaitReader(SID, 3.5)] and d.of(AbortUpstream) == []
    assert d.stream.next_deadline() == 3.5  # no heartbeat for a departed client
    d.send(UpstreamData(frames_of([chunk("b")])), at=2.0)
    assert len(d.written) == written  # nothing is written to nobody...
    assert len(recorded(d)) == 2  # ...but everything is recorded
    d.send(Tick(), at=3.49)
    assert d.of(AbortUpstream) == []
    d.send(Tick(), at=3.5)
    assert [a.reason for a in d.of(AbortUpstream)] == [EndReason.CLIENT_GONE]
    assert d.finished.record.end_reason is EndReason.CLIENT_GONE
    assert d.of(CloseClient) == []  # the client was already gone


@pytest.mark.parametrize("ending", ["shutdown", "complete"])
def test_a_held_stream_that_ends_otherwise_ends_once(ending: str) -> None:
    d = resumable(proxy_config(resume=True, resume_grace_s=2.0))
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(ClientGone(), at=1.5)
    if ending == "shutdown":
        d.send(StopRequested(EndReason.SHUTDOWN), at=3.6)  # after the grace's deadline
        assert d.finished.record.end_reason is EndReason.SHUTDOWN
        assert json.loads(recorded(d)[-1][len(b"data: "):])["error"]["code"] == "shutdown"
    else:
        d.send(UpstreamData(b"data: [DONE]\n\n"), at=3.6)
        # Completed into the store while nobody had come back: not its client's.
        assert d.finished.record.end_reason is EndReason.DEPARTED
    assert len([a for a in d.of(ReplayAppend) if a.end is not None]) == 1
    assert d.stream.next_deadline() is None


def test_grace_with_a_reader_completes_into_the_store() -> None:
    d = resumable(proxy_config(resume=True, resume_grace_s=2.0))
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(ClientGone(), at=1.5)
    d.send(ReaderAttached(), at=1.6)
    assert d.stream.next_deadline() is None or d.stream.next_deadline() != 3.5
    d.send(UpstreamData(frames_of([chunk("b")]) + b"data: [DONE]\n\n"), at=5.0)
    assert d.of(AbortUpstream) == []
    assert d.of(ReplayAppend)[-1].end is EndReason.COMPLETE
    assert d.finished.record.end_reason is EndReason.DETACHED
    assert len(recorded(d)) == 3


def test_a_slow_client_cut_off_is_held_like_a_departure() -> None:
    config = proxy_config(resume=True, resume_grace_s=1.0, write_deadline_s=5.0)
    d = resumable(config, auto_complete=False)
    d.send(UpstreamData(frames_of([chunk("a")])), at=0.1)
    d.send(SocketPaused(), at=0.2)
    d.send(Tick(), at=5.2)
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    assert d.of(AwaitReader) and d.of(AbortUpstream) == []
    assert not d.stream.departure_aborts_upstream()
    d.send(ClientGone(), at=5.3)  # the driver's echo of the reset it did: still held
    assert d.of(AbortUpstream) == [] and not d.stream.finished
    d.send(Tick(), at=6.2)  # nobody came back: it ends as what it was, a slow client
    assert [a.reason for a in d.of(AbortUpstream)] == [EndReason.SLOW_CLIENT]
    assert d.finished.record.end_reason is EndReason.SLOW_CLIENT


def reader(after_seq: int, config: WireConfig = RESUME, **kwargs: Any) -> Driver:
    d = Driver(config, stream_id="readers-own-id", **kwargs)
    d.send(ReplaySource(SID, after_seq))
    d.sse_headers()
    return d


def test_a_reader_numbers_on_from_where_the_client_left_and_records_nothing() -> None:
    d = reader(5)
    d.send(UpstreamData(frames_of([chunk("f"), chunk("g")]) + b"data: [DONE]\n\n"), at=0.1)
    d.send(UpstreamEnded(), at=0.1)
    assert [e.id for e in parse_all(d.written) if e.data] == [f"{SID}.{n}" for n in (6, 7, 8)]
    assert dict(d.commit.headers)[b"x-tokenwire-stream-id"] == SID.encode()
    assert d.of(ReplayAppend) == []
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_a_reader_never_merges_a_backlog_and_pauses_the_store_instead() -> None:
    d = reader(0, proxy_config(resume=True, max_pending_bytes=4000), auto_complete=False)
    backlog = [chunk(str(i)) for i in range(40)]
    fed = 0
    while not d.of(PauseUpstream):  # fed in slices, as feed_replay does
        d.send(UpstreamData(frames_of(backlog[fed:fed + 5])), at=0.1)
        fed += 5
    assert d.of(CloseClient) == []  # paused before the cap: the reader is not cut off
    while fed < len(backlog) or d.in_flight:
        if d.in_flight:
            d.complete()
        else:
            d.send(UpstreamData(frames_of(backlog[fed:fed + 5])))
            fed += 5
    ids = [e.id for e in parse_all(d.written) if e.data]
    assert ids == [f"{SID}.{n}" for n in range(1, 41)]


def test_a_reader_that_leaves_stops_its_replay_but_tells_no_engine() -> None:
    d = reader(2)
    d.send(UpstreamData(frames_of([chunk("c")])), at=0.1)
    d.send(ClientGone(), at=0.2)
    # The replay is read from the store: dropped, but nothing generates to be stopped.
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.CLIENT_GONE, final=False)]


def test_a_reader_after_the_end_gets_204() -> None:
    d = reader(9)
    d.send(UpstreamEnded(), at=0.1)
    assert d.commit.status == 204 and d.written == b""
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_a_readers_own_ending_carries_no_id() -> None:
    d = reader(3)
    d.send(UpstreamData(frames_of([chunk("d")])), at=0.1)
    d.send(StopRequested(EndReason.SHUTDOWN), at=0.2)
    events = [e for e in parse_all(d.written) if e.data]
    assert events[0].id == f"{SID}.4" and events[-1].id is None
    assert json.loads(events[-1].data or "")["error"]["code"] == "shutdown"


def test_rejected_is_a_real_status_before_the_first_byte_and_calls_no_abort() -> None:
    d = Driver(RESUME, stream_id=SID)
    error = ClientError("nope", ErrorCode.STREAM_NOT_FOUND, http_status=404)
    d.send(Rejected(error), at=0.1)
    assert d.commit.status == 404 and json.loads(d.written)["error"]["code"] == "stream_not_found"
    assert d.of(AbortUpstream) == []


def test_replay_source_after_the_headers_is_a_driver_bug() -> None:
    d = resumable()
    with pytest.raises(LocalProtocolError):
        d.send(ReplaySource(SID, 0))
    with pytest.raises(LocalProtocolError):
        Driver(PROXY_DEFAULTS, stream_id=SID).send(ReplaySource(SID, 0))


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 30), cut=st.integers(0, 40), data=st.data())
def test_record_then_replay_from_any_id_gives_the_rest_exactly(tokens: int, cut: int,
                                                                data: st.DataObject) -> None:
    """Property: for any split of the upstream into reads and any resume point,
    a reader fed the recorded frames gives exactly the events after that point."""
    chunks = [chunk(f"t{i} ") for i in range(tokens)]
    wire = frames_of(chunks) + b"data: [DONE]\n\n"
    d = resumable()
    position = 0
    while position < len(wire):
        step = data.draw(st.integers(1, 64))
        d.send(UpstreamData(wire[position:position + step]))
        position += step
    frames = recorded(d)
    assert len(frames) == tokens + 1
    after = min(cut, len(frames))
    r = reader(after)
    r.send(UpstreamData(b"".join(frames[after:])))
    r.send(UpstreamEnded())
    events = [e for e in parse_all(r.written) if e.data is not None]
    if after == len(frames):
        assert r.commit.status == 204
        return
    assert [e.id for e in events] == [f"{SID}.{n}" for n in range(after + 1, len(frames) + 1)]
    assert texts(events) == "".join(f"t{i} " for i in range(after, tokens))


# ------------------------------------------------------------------ request classification


@pytest.mark.parametrize(("method", "path", "headers", "expected"), [
    ("GET", "/v1/streams/abc_-9", [], ResumeFrom("abc_-9", 0)),
    ("GET", "/v1/streams/abc", [(b"last-event-id", b"abc.17")], ResumeFrom("abc", 17)),
    ("POST", "/v1/chat/completions", [(b"last-event-id", b"abc.3")], ResumeFrom("abc", 3)),
    ("POST", "/v1/chat/completions", [(b"idempotency-key", b"k1")], Idempotent("k1", "")),
    ("POST", "/v1/chat/completions", [], None),
    ("GET", "/v1/models", [(b"idempotency-key", b"k1")], None),
    ("DELETE", "/v1/streams/abc", [], CancelStream("abc")),
    ("POST", "/v1/responses/resp_1/cancel", [], CancelStream(alias="resp_1")),
    ("POST", "/openai/v1/responses/r1/cancel", [(b"idempotency-key", b"k")], CancelStream(alias="r1")),
    ("POST", "/v1/responses/resp_1/other", [], None),
    ("POST", "/v1/responses//cancel", [], None),
    ("DELETE", "/v1/chat/completions", [], None),
])
def test_classify(method: str, path: str, headers: list[tuple[bytes, bytes]], expected: object) -> None:
    route = classify(method, path, headers, b"{}")
    if isinstance(expected, Idempotent):
        assert isinstance(route, Idempotent) and route.key == "k1" and len(route.digest) == 64
    else:
        assert route == expected


@pytest.mark.parametrize(("method", "path", "headers", "status", "code"), [
    ("GET", "/v1/streams/a.b", [], 404, "stream_not_found"),
    ("GET", "/v1/streams/", [], 404, "stream_not_found"),
    ("POST", "/v1/streams/abc", [], 405, "bad_request"),
    ("DELETE", "/v1/streams/a.b", [], 404, "stream_not_found"),
    ("GET", "/v1/streams/abc", [(b"last-event-id", b"other.1")], 400, "invalid_last_event_id"),
    ("POST", "/v1/x", [(b"last-event-id", b"abc.-1")], 400, "invalid_last_event_id"),
    ("POST", "/v1/x", [(b"idempotency-key", b"\x01")], 400, "bad_request"),
])
def test_classify_refusals(method: str, path: str, headers: list[tuple[bytes, bytes]],
                           status: int, code: str) -> None:
    with pytest.raises(ClientError) as raised:
        classify(method, path, headers, b"")
    assert raised.value.http_status == status and raised.value.code.value == code


def test_parse_event_id_splits_at_the_last_dot() -> None:
    assert parse_event_id("a-b_c.42") == ("a-b_c", 42)


# ------------------------------------------------------------------ the memory store


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def read_all(store: MemoryReplayStore, stream_id: str, after: int) -> list[bytes]:
    got: list[bytes] = []
    async for frames in store.read(stream_id, after):
        got += frames
    return got


def test_memory_store_ttl_counts_from_the_last_append() -> None:
    clock = FakeClock()

    async def scenario() -> None:
        store = MemoryReplayStore(ttl_s=10.0, clock=clock)
        await store.open("s")
        store.append(ReplayAppend("s", 1, (b"data: a\n\n",), end=EndReason.COMPLETE))
        clock.now = 9.0
        assert await read_all(store, "s", 0) == [b"data: a\n\n"]
        clock.now = 10.5
        with pytest.raises(StreamNotFound):
            await read_all(store, "s", 0)

    run(scenario())


def test_memory_store_total_cap_drops_finished_streams_first() -> None:
    async def scenario() -> None:
        store = MemoryReplayStore(total_bytes=600)
        for name in ("old-done", "live", "new-done"):
            await store.open(name)
        store.append(ReplayAppend("old-done", 1, (b"x" * 200,), end=EndReason.COMPLETE))
        store.append(ReplayAppend("live", 1, (b"y" * 200,)))
        store.append(ReplayAppend("new-done", 1, (b"z" * 200,), end=EndReason.COMPLETE))
        assert store.stored_bytes <= 600 and store.evicted_streams == 1
        with pytest.raises(StreamNotFound):
            await read_all(store, "old-done", 0)
        assert await read_all(store, "new-done", 0) == [b"z" * 200]

    run(scenario())


def test_memory_store_live_tail_and_eviction_while_reading() -> None:
    async def scenario() -> None:
        store = MemoryReplayStore(total_bytes=10_000)
        await store.open("s")
        store.append(ReplayAppend("s", 1, (b"a",)))
        got: list[bytes] = []

        async def follow() -> None:
            async for frames in store.read("s", 0):
                got.extend(frames)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0)
        assert await store.wait_reader("s", 0.01)
        store.append(ReplayAppend("s", 2, (b"b",)))
        await asyncio.sleep(0)
        store.append(ReplayAppend("s", 3, (b"c",), end=EndReason.COMPLETE))
        await asyncio.wait_for(task, 1)
        assert got == [b"a", b"b", b"c"]
        # A live stream evicted under a reader: it learns the rest is gone.
        await store.open("t")
        store.append(ReplayAppend("t", 1, (b"x",)))
        reading = asyncio.ensure_future(read_all(store, "t", 0))
        await asyncio.sleep(0)
        await store.aclose()
        with pytest.raises(ReplayUnavailable):
            await asyncio.wait_for(reading, 1)

    run(scenario())
