"""The drain's hand-off, sans-IO: ``HandOff(until)`` closes the client so it
reconnects elsewhere and keeps the stream running into the store until
``until``. Time is injected; nothing sleeps."""

from __future__ import annotations

import json

from tokenwire.middleware import (
    AbortUpstream,
    AwaitReader,
    ClientGone,
    CloseClient,
    EndReason,
    HandOff,
    ReaderAttached,
    ReplayAppend,
    StopRequested,
    Tick,
    UpstreamData,
)

from .test_stream_resume import RESUME, SID, frames_of, reader, recorded, resumable
from .wire_harness import Driver, chunk, parse_all, proxy_config, texts

DONE = b"data: [DONE]\n\n"


def ids(driver: Driver) -> list[str | None]:
    return [e.id for e in parse_all(driver.written) if e.data]


def test_a_written_stream_is_closed_at_once_and_keeps_recording_until_the_drain_ends() -> None:
    d = resumable()
    d.send(UpstreamData(frames_of([chunk("a"), chunk("b")])), at=1.0)
    d.send(HandOff(until=31.0), at=2.0)
    # Closed without the terminal event (a client reconnects), not reset (it
    # gets every byte written, so its Last-Event-ID is the last one it was sent).
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.of(AwaitReader) == [AwaitReader(SID, 31.0)]
    assert d.of(AbortUpstream) == []
    assert ids(d) == [f"{SID}.1", f"{SID}.2"] and DONE not in d.written
    assert d.stream.next_deadline() == 31.0  # no heartbeat to nobody, the drain's end
    written = len(d.written)
    d.send(UpstreamData(frames_of([chunk("c")])), at=3.0)
    assert len(d.written) == written and len(recorded(d)) == 3
    d.send(ClientGone(), at=3.1)  # the driver's echo of the close: still held
    assert d.of(AbortUpstream) == [] and not d.stream.finished


def test_a_reader_elsewhere_gets_the_answer_completed_into_the_store() -> None:
    d = resumable()
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(HandOff(until=31.0), at=2.0)
    d.send(ReaderAttached(), at=2.2)  # the client reconnected to another replica
    d.send(UpstreamData(frames_of([chunk("b")]) + DONE), at=40.0)  # attached: past the hold's end too
    assert d.of(AbortUpstream) == []
    assert d.of(ReplayAppend)[-1].end is EndReason.COMPLETE
    assert [frame.startswith(b"data: ") for frame in recorded(d)] == [True] * 3
    assert d.finished.record.end_reason is EndReason.DETACHED
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]  # once: at the hand-off


def test_nobody_comes_back_by_the_drains_end_the_stream_ends_as_a_shutdown() -> None:
    d = resumable()
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(HandOff(until=31.0), at=2.0)
    d.send(Tick(), at=30.9)
    assert d.of(AbortUpstream) == []
    d.send(Tick(), at=31.0)
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.SHUTDOWN, final=True)]
    assert d.finished.record.end_reason is EndReason.SHUTDOWN
    # What a reader elsewhere ends with: the drain's in-band error, stored as an event.
    last = recorded(d)[-1]
    assert json.loads(last[len(b"data: "):])["error"]["code"] == "shutdown"
    assert d.of(ReplayAppend)[-1].end is EndReason.SHUTDOWN
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]


def test_the_hand_off_waits_until_the_client_holds_an_id() -> None:
    d = Driver(RESUME, stream_id=SID)
    d.send(HandOff(until=31.0), at=0.5)  # before the upstream answered
    assert d.of(CloseClient) == []
    d.sse_headers(at=1.0)
    assert d.of(CloseClient) == []  # headers out, but no id yet
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.5)
    assert ids(d) == [f"{SID}.1"]
    assert d.of(CloseClient) == [CloseClient(abrupt=True)] and d.of(AwaitReader) == [AwaitReader(SID, 31.0)]


def test_a_socket_that_is_behind_is_handed_off_once_it_took_what_was_numbered() -> None:
    d = resumable(auto_complete=False)
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(HandOff(until=31.0), at=1.1)
    assert d.of(CloseClient) == []  # the first event is still in flight
    d.complete()
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert ids(d) == [f"{SID}.1"]


def test_a_stream_that_ends_before_its_hand_off_ends_as_it_would() -> None:
    d = Driver(RESUME, stream_id=SID)
    d.send(HandOff(until=31.0), at=0.5)
    d.sse_headers(at=1.0)
    d.send(UpstreamData(frames_of([chunk("a")]) + DONE), at=1.5)
    # The whole answer went out with its first event: nothing left to hand off.
    assert texts(parse_all(d.written)) == "a" and [e.data for e in parse_all(d.written)][-1] == "[DONE]"
    assert d.of(CloseClient) == [CloseClient(abrupt=False)] and d.of(AwaitReader) == []
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_without_resume_a_hand_off_is_ignored_and_the_drain_ends_the_stream() -> None:
    d = Driver(proxy_config(), stream_id=None)
    d.sse_headers(at=0.1)
    d.send(UpstreamData(frames_of([chunk("a")])), at=0.2)
    d.send(HandOff(until=31.0), at=0.3)
    assert d.of(CloseClient) == [] and d.of(AwaitReader) == []
    d.send(StopRequested(EndReason.SHUTDOWN), at=31.0)
    assert d.finished.record.end_reason is EndReason.SHUTDOWN
    last = [e for e in parse_all(d.written) if e.data][-1]
    assert json.loads(last.data or "")["error"]["code"] == "shutdown"


def test_a_stream_past_its_cap_is_not_handed_off() -> None:
    d = resumable(proxy_config(resume=True, resume_max_bytes=100))
    d.send(UpstreamData(frames_of([chunk("a" * 200)])), at=0.5)  # over the cap: recording stopped
    d.send(HandOff(until=31.0), at=1.0)
    assert d.of(CloseClient) == [] and d.of(AwaitReader) == []


def test_a_held_stream_keeps_its_grace_and_a_second_hand_off_changes_nothing() -> None:
    d = resumable(proxy_config(resume=True, resume_grace_s=5.0))
    d.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    d.send(ClientGone(), at=1.5)
    d.send(HandOff(until=31.0), at=2.0)
    assert d.of(AwaitReader) == [AwaitReader(SID, 6.5)] and d.of(CloseClient) == []
    e = resumable()
    e.send(UpstreamData(frames_of([chunk("a")])), at=1.0)
    e.send(HandOff(until=31.0), at=2.0)
    e.send(HandOff(until=40.0), at=3.0)
    assert e.of(AwaitReader) == [AwaitReader(SID, 31.0)] and len(e.of(CloseClient)) == 1


def test_a_reader_is_closed_and_ends_without_an_error_event() -> None:
    d = reader(4)
    d.send(UpstreamData(frames_of([chunk("e")])), at=0.1)
    d.send(HandOff(until=31.0), at=0.2)
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    # The replay is the store's: dropped, no engine to tell, and no error event,
    # so the client reconnects from its last id.
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.SHUTDOWN, final=False)]
    assert ids(d) == [f"{SID}.5"] and d.of(AwaitReader) == []
    assert d.finished.record.end_reason is EndReason.SHUTDOWN


def test_a_reconnect_that_already_holds_an_id_is_handed_off_once_its_headers_are_out() -> None:
    d = reader(4)
    d.send(HandOff(until=31.0), at=0.05)  # the headers wait for the first event (or the commit deadline)
    assert d.of(CloseClient) == []
    d.send(Tick(), at=d.stream.next_deadline())  # the commit deadline: headers, nothing replayed yet
    # Its id is the one the client came with: closed at once, nothing written.
    assert d.commit.status == 200 and d.of(CloseClient) == [CloseClient(abrupt=True)] and d.written == b""
