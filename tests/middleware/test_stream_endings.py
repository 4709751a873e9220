"""Truthful endings in the record (virtual time): an upstream error status, a
streaming request answered with something that is not an event stream, and a
client that left while its answer was completed into the replay store."""

from __future__ import annotations

import json

import pytest
from tokenwire.middleware import (
    AbortUpstream,
    ClientGone,
    EndReason,
    ErrorCode,
    ReaderAttached,
    SocketPaused,
    SocketResumed,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
    WireConfig,
)
from tokenwire.middleware.core.dialects import DialectTable

from .wire_harness import Driver, chunk, parse_all, proxy_config

HTML = ((b"content-type", b"text/html"),)
JSON = ((b"content-type", b"application/json"),)


def driver(path: str = "/v1/chat/completions", config: WireConfig | None = None, **kwargs: object) -> Driver:
    config = config or proxy_config(retry_attempts=0)
    return Driver(config, dialect=DialectTable(config.dialect_routes, config.terminal_marker).for_path(path),
                  **kwargs)


@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_an_upstream_error_status_is_passed_through_and_recorded_as_one(status: int) -> None:
    d = driver()
    d.send(UpstreamHeaders(status, JSON))
    d.send(UpstreamData(b'{"error": {"message": "no"}}'))
    d.send(UpstreamEnded())
    assert d.commit.status == status and d.written == b'{"error": {"message": "no"}}'
    record = d.finished.record
    assert (record.end_reason, record.error_code) == (EndReason.UPSTREAM_STATUS, ErrorCode.UPSTREAM_FAILED)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_streaming_request_answered_with_html_on_a_known_route_is_a_clear_502(path: str) -> None:
    d = driver(path)
    d.send(UpstreamHeaders(200, HTML))
    assert d.commit.status == 502
    body = json.loads(d.written)
    assert "text/html" in body["error"]["message"] and "text/event-stream" in body["error"]["message"]
    assert [a.reason for a in d.of(AbortUpstream)] == [EndReason.NOT_EVENT_STREAM]
    assert d.finished.record.end_reason is EndReason.NOT_EVENT_STREAM


def test_on_a_generic_route_or_when_configured_it_is_passed_through_and_recorded() -> None:
    for d in (driver("/my/stream"), driver(config=proxy_config(non_event_stream_answer="pass"))):
        d.send(UpstreamHeaders(200, HTML))
        d.send(UpstreamData(b"<html>wrong port</html>"))
        d.send(UpstreamEnded())
        assert d.commit.status == 200 and d.written == b"<html>wrong port</html>"
        assert d.finished.record.end_reason is EndReason.NOT_EVENT_STREAM


def test_a_request_that_asked_for_no_stream_gets_its_json_and_is_complete() -> None:
    d = driver(expect_stream=False)
    d.send(UpstreamHeaders(200, JSON))
    d.send(UpstreamData(b"{}"))
    d.send(UpstreamEnded())
    assert d.finished.record.end_reason is EndReason.COMPLETE


@pytest.mark.parametrize("reader", [False, True])
def test_a_client_that_left_during_the_grace_is_departed_unless_a_reader_came(reader: bool) -> None:
    d = driver(config=proxy_config(resume=True, resume_grace_s=5.0), stream_id="s1")
    d.sse_headers()
    d.send(UpstreamData(f"data: {chunk('a')}\n\n".encode()), at=1.0)
    d.send(ClientGone(), at=1.5)
    if reader:
        d.send(ReaderAttached(), at=1.6)
    d.send(UpstreamData(f"data: {chunk('b')}\n\ndata: [DONE]\n\n".encode()), at=2.0)
    record = d.finished.record
    assert record.end_reason is (EndReason.DETACHED if reader else EndReason.DEPARTED)
    assert record.events_out == 1  # what the client itself received
    assert d.of(AbortUpstream) == []  # the answer completed: nothing to abort


def test_config_refuses_an_unknown_answer_policy() -> None:
    with pytest.raises(ValueError, match="non_event_stream_answer"):
        WireConfig(non_event_stream_answer="maybe")  # type: ignore[arg-type]


def test_without_usage_the_count_is_the_engines_pieces_before_merging_not_the_events_written() -> None:
    """20,000 tokens to a slow reader were once recorded as the 325 merged events."""
    d = driver()
    d.sse_headers()
    d.send(UpstreamData(f"data: {chunk(role='assistant', text='')}\n\n".encode()))
    d.send(SocketPaused())
    for i in range(2000):
        d.send(UpstreamData(f"data: {chunk(f'w{i}')}\n\n".encode()))
    d.send(UpstreamData(b'event: progress\ndata: {"step": 1}\n\n'))  # no token
    d.send(UpstreamData(f"data: {chunk(finish='stop')}\n\ndata: [DONE]\n\n".encode()))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    record = d.finished.record
    assert record.coalesced_events == 1999
    assert record.tokens_out == (2000, "counted")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_that_asked_gets_the_figures_just_before_the_terminal_event(path: str) -> None:
    d = driver(path, frames=frozenset({"summary"}))
    d.sse_headers(at=0.0)
    if path == "/v1/messages":
        frames = [b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                  b'{"input_tokens":2,"output_tokens":1}}}\n\n',
                  b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                  b'"delta":{"type":"text_delta","text":"Hi"}}\n\n',
                  b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                  b'"usage":{"output_tokens":4}}\n\n',
                  b'event: message_stop\ndata: {"type":"message_stop"}\n\n']
    else:
        frames = [f"data: {chunk(t)}\n\n".encode() for t in ("a", "b", "c", "d")] + [b"data: [DONE]\n\n"]
    for at, frame in enumerate(frames, start=1):
        d.send(UpstreamData(frame), at=at * 0.5)
    d.send(UpstreamEnded())
    events = parse_all(d.written)
    summary = events[-2]
    assert summary.event == "tokenwire.summary" and summary.id is None
    body = json.loads(summary.data or "")
    assert body["tokens"] == 4 and body["ttft_s"] is not None and body["tokens_per_s"] > 0
    # The summary is tokenwire's, not a content event: the delta and message_delta, or the four chunks.
    assert d.finished.record.content_events == (2 if path == "/v1/messages" else 4)
    plain = driver(path)
    plain.sse_headers()
    for frame in frames:
        plain.send(UpstreamData(frame))
    assert all(e.event != "tokenwire.summary" for e in parse_all(plain.written))  # never unasked
