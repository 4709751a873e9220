"""Responses and Anthropic Messages streams through a real sidecar: a slow reader
at the issue's pace (4 KiB receive buffer, 1 KiB every 8 ms) gets the whole answer
exactly with the pending buffer under its cap, and an engine that sends only
keepalives after its first token is timed out (real sockets on 127.0.0.1; the
streams are written from the public API references, not captured)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from clients import request_bytes
from conftest import RunningSidecar
from tokenwire.middleware import SSEEvent, SSEParser
from tokenwire.middleware.core.sse import encode
from upstreams import ScriptedUpstream

StartSidecar = Callable[..., RunningSidecar]
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def named(kind: str, **fields: Any) -> bytes:
    return encode(SSEEvent(data=json.dumps({"type": kind, **fields}, separators=(",", ":")), event=kind))


def responses_stream(words: list[str]) -> list[bytes]:
    seq = iter(range(10**9))
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    frames = [named("response.created", response=response, sequence_number=next(seq))]
    frames += [named("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
                     delta=word, logprobs=[], sequence_number=next(seq)) for word in words]
    frames.append(named("response.completed", response={**response, "status": "completed",
                                                         "usage": {"output_tokens": len(words)}},
                        sequence_number=next(seq)))
    return frames


def messages_stream(words: list[str]) -> list[bytes]:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
               "usage": {"input_tokens": 3, "output_tokens": 1}}
    frames = [named("message_start", message=message),
              named("content_block_start", index=0, content_block={"type": "text", "text": ""})]
    frames += [named("content_block_delta", index=0, delta={"type": "text_delta", "text": w}) for w in words]
    frames += [named("content_block_stop", index=0),
               named("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": len(words)}),
               named("message_stop")]
    return frames


def answer_with(frames: list[bytes], *, per_write: int = 64) -> Callable[..., Any]:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        for start in range(0, len(frames), per_write):
            writer.write(chunked(b"".join(frames[start:start + per_write])))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    return respond


def dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


def read_slowly(port: int, path: str, request_id: str) -> list[SSEEvent]:
    """The issue's slow reader: a 4 KiB receive buffer, 1 KiB every 8 ms, to the end."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    with sock:
        sock.sendall(request_bytes("POST", path, body=b'{"stream": true}',
                                   headers={"X-Request-Id": request_id, "Connection": "close"}))
        data = bytearray()
        while True:
            piece = sock.recv(1024)
            if not piece:
                break
            data += piece
            time.sleep(0.008)  # the reader's pace (the scenario), not a wait for anything
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert body.endswith(b"0\r\n\r\n"), "the body did not end with its terminator"
    parser = SSEParser()
    events = [e for e in parser.feed(dechunk(body)) if e.comment is None]
    parser.close()
    return events


def text_of(events: list[SSEEvent]) -> str:
    out = []
    for event in events:
        body = json.loads(event.data or "{}")
        if event.event == "response.output_text.delta":
            out.append(body["delta"])
        elif event.event == "content_block_delta":
            out.append(body["delta"]["text"])
    return "".join(out)


@pytest.mark.slow
@pytest.mark.parametrize(("route", "build", "answer_bytes"), [
    ("/v1/responses", responses_stream, 2_300_000), ("/v1/messages", messages_stream, 1_000_000)])
def test_a_slow_reader_gets_the_whole_answer_exactly_under_the_cap(
        start_sidecar: StartSidecar, recorder: ScriptedUpstream, route: str,
        build: Callable[[list[str]], list[bytes]], answer_bytes: int) -> None:
    words: list[str] = []
    while sum(len(f) for f in build(words)) < answer_bytes:
        words += [f"w{len(words) + i} " for i in range(500)]
    frames = build(words)
    recorder.respond = answer_with(frames)  # type: ignore[assignment]
    sidecar = start_sidecar(recorder.url)
    events = read_slowly(sidecar.port, route, "slow-1")
    assert text_of(events) == "".join(words)
    record = sidecar.record("slow-1")
    assert record.end_reason == "complete"
    assert record.coalesced_events > 0
    assert record.pending_high_water_bytes < 1 << 20  # the default max_pending_bytes
    if route == "/v1/responses":
        numbers = [json.loads(e.data or "{}")["sequence_number"] for e in events]
        assert numbers == list(range(len(events)))


def test_an_engine_sending_only_keepalives_after_its_first_token_is_timed_out(
        start_sidecar: StartSidecar, recorder: ScriptedUpstream) -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(b"".join(messages_stream(["Hi"])[:3])))
        await writer.drain()
        while not writer.is_closing():  # stuck: pings and comments, forever
            writer.write(chunked(named("ping") + b": keepalive\n\n"))
            await writer.drain()
            await asyncio.sleep(0.05)

    recorder.respond = respond  # type: ignore[assignment]
    sidecar = start_sidecar(recorder.url, upstream_idle_timeout_s=0.5)
    sock = socket.create_connection(("127.0.0.1", sidecar.port), timeout=30)
    with sock:
        sock.sendall(request_bytes("POST", "/v1/messages", body=b'{"stream": true}',
                                   headers={"X-Request-Id": "stuck-1"}))
        data = bytearray()
        while piece := sock.recv(65536):
            data += piece
    assert recorder.cut_off.wait(30), "the stuck upstream was never aborted"
    parser = SSEParser()
    events = [e for e in parser.feed(dechunk(bytes(data).partition(b"\r\n\r\n")[2])) if e.comment is None]
    last = json.loads(events[-1].data or "{}")
    assert events[-1].event == "error" and last["error"]["type"] == "timeout_error"
    assert "keepalives only" in last["error"]["message"]
    record = sidecar.record("stuck-1")
    assert (record.end_reason, record.error_code) == ("upstream_timeout", "upstream_timeout")
    assert record.upstream_keepalives >= 4


def test_a_client_that_asks_gets_its_figures_as_a_last_named_event(start_sidecar: StartSidecar) -> None:
    """``Tokenwire-Summary: true``: the stream's figures just before [DONE], never unasked."""
    sidecar = start_sidecar()
    seen: dict[bool, list[SSEEvent]] = {}
    for asked in (True, False):
        headers = {"x-fake-tokens": "6", "X-Request-Id": f"summary-{asked}",
                   **({"Tokenwire-Summary": "true"} if asked else {})}
        with httpx.stream("POST", f"{sidecar.url}/normal/v1/chat/completions", headers=headers,
                          content=b'{"stream": true}', timeout=30) as response:
            parser = SSEParser()
            seen[asked] = [e for piece in response.iter_bytes() for e in parser.feed(piece)
                           if e.comment is None]
    summary = seen[True][-2]
    assert summary.event == "tokenwire.summary" and seen[True][-1].data == "[DONE]"
    body = json.loads(summary.data or "")
    record = sidecar.record("summary-True")
    assert body["tokens"] == record.tokens_out[0] and body["ttft_s"] is not None
    assert not any(e.event == "tokenwire.summary" for e in seen[False])
