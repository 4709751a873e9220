"""The ``block`` policy (the producer waits, nothing merges) and tokenwire's own
frames (``Tokenwire-Frames: open, done``), in the sans-IO core with an injected clock."""

from __future__ import annotations

import json

import pytest
from tokenwire.middleware import (
    ClientError,
    PauseUpstream,
    ReplaySource,
    ResumeUpstream,
    SlowClientPolicy,
    SocketPaused,
    SocketResumed,
    UpstreamData,
    UpstreamEnded,
    WireConfig,
)
from tokenwire.middleware.core import client_settings, frames

from .test_stream_endings import driver
from .wire_harness import Driver, chunk, event, parse_all, proxy_config, texts

TEXT = [f"t{i} " for i in range(400)]


def _slow_burst(policy: SlowClientPolicy, **changes: object) -> Driver:
    """A burst to a reader whose socket is paused, the driver obeying Pause/Resume
    as the sidecar does: no read while paused, the reader drains at t=10."""
    d = Driver(proxy_config(slow_client_policy=policy, **changes), auto_complete=False)
    d.sse_headers(at=0.0)
    d.send(event(chunk(role="assistant")), at=0.0)
    d.send(SocketPaused(), at=0.0)
    fed = 0
    now = 0.0
    while fed < len(TEXT):
        if d.of(PauseUpstream) and len(d.of(PauseUpstream)) > len(d.of(ResumeUpstream)):
            now += 1.0  # the reader takes a second to free its socket
            d.send(SocketResumed(), at=now)
            while d.in_flight:
                d.complete()
            d.send(SocketPaused(), at=now)
            continue
        d.send(event(chunk(TEXT[fed])), at=now)
        fed += 1
    d.send(event(chunk(finish="stop")), at=now)
    d.send(event("[DONE]"), at=now)
    d.send(UpstreamEnded(), at=now)
    d.send(SocketResumed(), at=now + 1.0)
    while d.in_flight:
        d.complete()
    return d


def test_block_merges_nothing_and_waits_where_coalesce_merges() -> None:
    block = _slow_burst(SlowClientPolicy.BLOCK, block_window_bytes=4096)
    coalesce = _slow_burst(SlowClientPolicy.COALESCE)
    for d in (block, coalesce):
        assert texts(parse_all(d.written)) == "".join(TEXT)
        assert d.finished.record.end_reason.value == "complete"
    b, c = block.finished.record, coalesce.finished.record
    assert b.coalesced_events == 0 and c.coalesced_events > 300
    assert b.events_out == len(TEXT) + 3 > c.events_out
    # Paused each time 4 KiB waited; each pause lasted the reader's second.
    pauses = len(block.of(PauseUpstream))
    assert pauses >= 5 and b.pending_high_water_bytes < 4096 + 300
    assert b.producer_wait_s == pytest.approx(float(pauses))
    assert c.producer_wait_s == 0.0 and coalesce.of(PauseUpstream) == []


def test_block_window_is_held_to_half_the_cap() -> None:
    d = _slow_burst(SlowClientPolicy.BLOCK, block_window_bytes=1 << 20, max_pending_bytes=8192)
    assert d.finished.record.pending_high_water_bytes < 4096 + 300  # never cut at the cap
    assert texts(parse_all(d.written)) == "".join(TEXT)


def test_a_pause_still_running_at_the_end_counts_to_the_end() -> None:
    d = Driver(proxy_config(slow_client_policy=SlowClientPolicy.BLOCK, block_window_bytes=512),
               auto_complete=False)
    d.sse_headers(at=0.0)
    d.send(SocketPaused(), at=0.0)
    while not d.of(PauseUpstream):
        d.send(event(chunk("x" * 50)), at=1.0)
    assert d.stream.record(3.5).producer_wait_s == pytest.approx(2.5)


def test_block_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_window_bytes"):
        WireConfig(block_window_bytes=0)


def _frames(d: Driver) -> list[tuple[str | None, dict[str, object] | str | None]]:
    out: list[tuple[str | None, dict[str, object] | str | None]] = []
    for e in parse_all(d.written):
        if e.data is None:
            continue
        out.append((e.event, json.loads(e.data) if e.data.startswith("{") else e.data))
    return out


def _answer(d: Driver) -> None:
    d.sse_headers(at=0.0)
    d.send(event(chunk("Hel")), at=0.1)
    d.send(event(chunk("lo")), at=0.2)
    d.send(event(chunk(finish="stop")), at=0.2)
    d.send(event("[DONE]"), at=0.3)
    d.send(UpstreamEnded(), at=0.3)


def test_open_and_done_frames_only_for_a_client_that_asked() -> None:
    plain = Driver(proxy_config())
    _answer(plain)
    assert [name for name, _ in _frames(plain)] == [None] * 4
    asked = Driver(proxy_config(resume=True), stream_id="S1", frames=frozenset({"open", "done"}))
    _answer(asked)
    seen = _frames(asked)
    assert [name for name, _ in seen] == ["tokenwire.open", None, None, None, "tokenwire.done", None]
    assert seen[0][1] == {"stream_id": "S1", "resumed": False, "start_index": 1, "policy": "coalesce",
                          "buffer_bytes": 1 << 20}
    done = seen[4][1]
    assert isinstance(done, dict)
    assert (done["end_reason"], done["tokens"], done["delivered_from"], done["dropped"]) == (
        "complete", 2, 1, 0)
    assert seen[-1] == (None, "[DONE]")
    # Neither is numbered: a resume never replays them, and the stream's ids are its own.
    ids = [e.id for e in parse_all(asked.written) if e.data]
    assert ids[0] is None and ids[4] is None and ids[1] == "S1.1" and ids[-1] == "S1.4"


def test_a_resumed_reader_is_told_where_it_starts() -> None:
    d = Driver(proxy_config(resume=True), stream_id="own", frames=frozenset({"open", "done"}))
    d.send(ReplaySource("S1", 5))
    _answer(d)
    seen = _frames(d)
    assert seen[0] == ("tokenwire.open", {"stream_id": "S1", "resumed": True, "start_index": 6,
                                          "policy": "coalesce", "buffer_bytes": 1 << 20})
    done = seen[-2][1]
    assert isinstance(done, dict) and done["delivered_from"] == 6


def test_done_comes_before_an_in_band_error_too() -> None:
    d = Driver(proxy_config(), frames=frozenset({"done"}))
    d.sse_headers(at=0.0)
    d.send(event(chunk("Hel")), at=0.1)
    d.send(UpstreamEnded(), at=0.2)  # cut before [DONE]
    names = [name for name, _ in _frames(d)]
    assert names[-2] == "tokenwire.done"
    done = _frames(d)[-2][1]
    assert isinstance(done, dict) and done["end_reason"] == "upstream_error"


def test_frames_header_parsed_and_an_unknown_frame_refused() -> None:
    assert frames.asked([(b"tokenwire-frames", b" Open , done")]) == {"open", "done"}
    assert frames.asked([(b"tokenwire-summary", b"true")]) == {"summary"}
    assert frames.asked([(b"content-type", b"x")]) == frozenset()
    config = proxy_config()
    _, _, kept, refusal = client_settings.for_request(config, [(b"tokenwire-frames", b"open,done")], b"",
                                                      "chat.completions")
    assert refusal is None and kept == [(b"tokenwire-frames", b"open,done")]
    _, _, _, refusal = client_settings.for_request(config, [(b"tokenwire-frames", b"open,bogus")], b"",
                                                   "chat.completions")
    assert isinstance(refusal, ClientError) and refusal.http_status == 400
    assert "'bogus' is not a frame" in str(refusal)


def test_the_query_parameter_stands_for_the_header() -> None:
    """``?tokenwire_frames=`` (a browser EventSource sets no header) becomes the
    header, so it is checked and applied as the header is; the header wins."""
    assert frames.with_query([], b"a=1&tokenwire_frames=open%2Cdone") == [(b"tokenwire-frames", b"open,done")]
    assert frames.asked(frames.with_query([], b"tokenwire_frames=done+,open")) == {"open", "done"}
    header = [(b"tokenwire-frames", b"summary")]
    assert frames.with_query(header, b"tokenwire_frames=open") is header
    plain = [(b"accept", b"text/event-stream")]
    for query in (b"", b"x=1", b"not_tokenwire_frames_either=1", b"tokenwire_framesx=open"):
        assert frames.with_query(plain, query) is plain, query
    _, _, _, refusal = client_settings.for_request(
        proxy_config(), frames.with_query(plain, b"tokenwire_frames=open,nope"), b"", "chat.completions")
    assert isinstance(refusal, ClientError) and "'nope' is not a frame" in str(refusal)
    # Percent-decoded, a value could carry a line break into the header: refused, never passed on.
    for bad in (b"open%0A", b"open%0D%0Ax-injected:%201", b"done%00", b"open;done", b"%C3%A9"):
        _, _, _, refusal = client_settings.for_request(
            proxy_config(), frames.with_query(plain, b"tokenwire_frames=" + bad), b"", "chat.completions")
        assert isinstance(refusal, ClientError) and refusal.http_status == 400, bad
        assert "is not a list of frame names" in str(refusal), (bad, str(refusal))


_DIALECT_ANSWERS = {
    "/v1/responses": [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_1","status":"in_progress"}}\n\n',
        *(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
          b'"sequence_number":%d,"item_id":"m1","output_index":0,"content_index":0,"delta":"t%d "}\n\n'
          % (n, n) for n in range(1, 4)),
        b'event: response.completed\ndata: {"type":"response.completed","sequence_number":4,'
        b'"response":{"id":"resp_1","status":"completed"}}\n\n'],
    "/v1/messages": [
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"output_tokens":1}}}\n\n',
        *(b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
          b'"delta":{"type":"text_delta","text":"t%d "}}\n\n' % n for n in range(1, 4)),
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'],
}


@pytest.mark.parametrize("path", sorted(_DIALECT_ANSWERS))
def test_the_frames_and_block_in_the_named_event_dialects(path: str) -> None:
    """Responses and Anthropic Messages: open first, done just before the dialect's
    own terminal event, and under block a slow reader's deltas are not merged."""
    answer = _DIALECT_ANSWERS[path]
    for policy, merged in ((SlowClientPolicy.BLOCK, False), (SlowClientPolicy.COALESCE, True)):
        d = driver(path, proxy_config(slow_client_policy=policy), frames=frozenset({"open", "done"}),
                   auto_complete=False)
        d.sse_headers(at=0.0)
        d.send(SocketPaused(), at=0.0)
        for frame in answer:
            d.send(UpstreamData(frame), at=0.1)
        d.send(UpstreamEnded(), at=0.2)
        d.send(SocketResumed(), at=0.3)
        while d.in_flight:
            d.complete()
        names = [event.event for event in parse_all(d.written) if event.data]
        assert names[0] == "tokenwire.open" and names[-2] == "tokenwire.done", names
        assert names[-1] == ("response.completed" if path == "/v1/responses" else "message_stop")
        assert (d.finished.record.coalesced_events > 0) is merged, (policy, names)
