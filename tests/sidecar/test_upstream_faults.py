"""Upstream faults the fake engine does not play: a body cut before any event,
a 100 MB line with no newline, bytes that are not UTF-8, CR-only line ends,
gzip. Before the first byte the client gets a real status; after it, an
in-band error and a cut body; memory stays bounded throughout.

(Refused connections, a silent upstream, one that never sends headers and one
that dies mid-stream are in test_upstream_failures.py.)
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import json
from collections.abc import Callable, Iterator

import pytest
from clients import chat_body, exchange, sse_datas
from conftest import LoopThread, RunningSidecar
from upstreams import DONE, Respond, ScriptedUpstream, chunk

_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n")
_MiB = 1 << 20

StartSidecar = Callable[..., RunningSidecar]
Scripted = Callable[[Respond], ScriptedUpstream]


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture
def scripted(loop_thread: LoopThread) -> Iterator[Scripted]:
    started: list[ScriptedUpstream] = []

    def start(respond: Respond) -> ScriptedUpstream:
        upstream = ScriptedUpstream(respond)
        loop_thread.run(upstream.start())
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        loop_thread.run(upstream.stop())


def _stream_of(*events: bytes, head: bytes = _SSE_HEAD, end: bool = True) -> Respond:
    """A script: the head, each event as one chunk, then the chunked terminator."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"\r\n")
        for event in events:
            writer.write(_framed(event))
            await writer.drain()
        if end:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        else:
            writer.transport.abort()

    return respond


def _endless_line(upstream_of: Callable[[], ScriptedUpstream], *before: bytes) -> Respond:
    """A script: ``before``, then one SSE line of up to 100 MB, 1 MiB per chunk, no newline."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = upstream_of()
        writer.write(_SSE_HEAD + b"\r\n" + b"".join(_framed(event) for event in before))
        await upstream.send(writer, _framed(b"data: "))
        piece = _framed(b"x" * _MiB)
        for _ in range(100):
            await upstream.send(writer, piece)

    return respond


def _content(datas: list[str]) -> str:
    text = []
    for data in datas:
        if data != "[DONE]":
            text.append(json.loads(data)["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_upstream_when_body_ends_before_any_event_then_502(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    upstream = scripted(_stream_of(end=False))
    sidecar = start_sidecar(upstream.url, retry_attempts=0)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "cut-early"})
    assert response.status == 502 and response.clean_end
    assert response.json()["error"]["code"] == "upstream_failed"
    assert sidecar.record("cut-early").end_reason == "upstream_error"


def test_upstream_when_endless_line_before_first_event_then_502_and_upstream_cut_off_early(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    upstream = scripted(_endless_line(lambda: upstream))
    sidecar = start_sidecar(upstream.url, retry_attempts=0)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "endless-early"})
    assert response.status == 502
    assert response.json()["error"]["code"] == "invalid_stream"
    assert upstream.cut_off.wait(5), "the upstream was never cut off"
    # The sidecar read a line's limit (1 MiB) and stopped: what the upstream got
    # out is that plus socket buffers, never the 100 MB.
    assert upstream.sent_bytes < 16 * _MiB, upstream.sent_bytes
    record = sidecar.record("endless-early")
    assert record.end_reason == "upstream_error" and record.error_code == "invalid_stream"


def test_upstream_when_endless_line_after_first_event_then_in_band_error_and_bounded_memory(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    upstream = scripted(_endless_line(lambda: upstream, chunk(role="assistant"), chunk("hello")))
    sidecar = start_sidecar(upstream.url)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "endless-late"})
    assert response.status == 200 and not response.clean_end
    datas = response.datas()
    assert _content(datas[:-1]) == "hello"
    assert json.loads(datas[-1])["error"]["code"] == "invalid_stream"
    assert upstream.cut_off.wait(5)
    assert upstream.sent_bytes < 16 * _MiB, upstream.sent_bytes
    record = sidecar.record("endless-late")
    assert record.error_code == "invalid_stream" and record.retries == 0
    assert record.pending_high_water_bytes <= sidecar.sidecar.config.wire.max_pending_bytes


def test_upstream_when_not_utf8_then_stream_completes_with_replacement_characters(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    # Latin-1 é (0xE9) where UTF-8 was due, in the first event (parsed before
    # the commit) and in a later one (which may take the core's no-parse path).
    # (chunk() writes JSON with \u escapes; the raw byte replaces the escape.)
    first = chunk("caf\u00e9", role="assistant").replace(b"\\u00e9", b"\xe9")
    later = chunk("na\u00efve").replace(b"\\u00ef", b"\xef")
    assert b"\xe9" in first and b"\xef" in later
    upstream = scripted(_stream_of(first, chunk(" ok"), later, chunk(finish="stop"), DONE))
    sidecar = start_sidecar(upstream.url)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "latin1"})
    assert response.status == 200 and response.clean_end
    # Whichever path each event took (parsed, or the core's no-parse path), the
    # client gets valid UTF-8, the invalid bytes replaced by U+FFFD.
    datas = sse_datas(response.body)
    response.body.decode("utf-8")
    assert datas[-1] == "[DONE]"
    assert _content(datas) == "caf\ufffd okna\ufffdve"
    assert sidecar.record("latin1").end_reason == "complete"


def test_upstream_when_cr_only_line_ends_then_events_reframed_with_lf(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    events = [chunk(role="assistant"), chunk("one "), chunk("two"), chunk(finish="stop"), DONE]
    upstream = scripted(_stream_of(*(event.replace(b"\n", b"\r") for event in events)))
    sidecar = start_sidecar(upstream.url)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "cr-only"})
    assert response.status == 200 and response.clean_end
    assert b"\r" not in response.body
    datas = response.datas()
    assert datas[-1] == "[DONE]" and _content(datas) == "one two"
    assert sidecar.record("cr-only").events_in == len(events)


def test_upstream_when_sse_is_gzipped_then_502_and_identity_was_asked(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    """The wire core parses events, so it cannot pass gzip through, and
    decompressing would let a small upstream body expand without bound: the
    sidecar asks for identity and refuses an upstream that compresses anyway."""
    body = gzip.compress(chunk("hi", role="assistant") + DONE)
    upstream = scripted(_stream_of(body, head=_SSE_HEAD + b"content-encoding: gzip\r\n"))
    sidecar = start_sidecar(upstream.url, retry_attempts=0)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": "gzip-sse", "Accept-Encoding": "gzip, br"})
    assert response.status == 502
    assert response.json()["error"]["code"] == "invalid_stream"
    assert "content-encoding" not in response.headers
    forwarded = bytes(upstream.received).lower()
    assert forwarded.count(b"\r\naccept-encoding:") == 1
    assert b"\r\naccept-encoding: identity\r\n" in forwarded
    assert sidecar.record("gzip-sse").end_reason == "upstream_error"


def test_upstream_when_json_is_gzipped_then_passed_through_untouched(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    """A non-stream answer is not parsed, so an upstream that compresses it
    (ignoring the identity asked for) is forwarded byte for byte, header and all."""
    payload = gzip.compress(b'{"object": "list", "data": []}')

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
        await writer.drain()

    upstream = scripted(respond)
    sidecar = start_sidecar(upstream.url)
    response = exchange(sidecar.port, "GET", "/v1/models")
    assert response.status == 200 and response.clean_end
    assert response.headers["content-encoding"] == "gzip"
    assert response.body == payload


def test_upstream_server_and_date_headers_are_replaced_by_the_sidecars(
        start_sidecar: StartSidecar, scripted: Scripted) -> None:
    # As nginx's proxy_hide_header defaults: the engine's software and clock are not the client's.
    head = _SSE_HEAD + b"server: engine/1.2\r\ndate: Thu, 01 Jan 1970 00:00:00 GMT\r\nx-engine-kept: 1\r\n"
    upstream = scripted(_stream_of(chunk("hi", role="assistant"), DONE, head=head))
    sidecar = start_sidecar(upstream.url)
    response = exchange(sidecar.port, "POST", "/v1/chat/completions", body=chat_body())
    assert response.status == 200 and response.clean_end
    assert "server" not in response.headers and response.headers["x-engine-kept"] == "1"
    assert email.utils.parsedate_to_datetime(response.headers["date"]).year >= 2026
