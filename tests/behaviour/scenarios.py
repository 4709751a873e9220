"""Scenarios for the shared behaviour suite, the app that plays them, and the
reference the drivers are held to.

A :class:`Scenario` is what an upstream does (a status, headers, then steps:
bytes, silences, a failure) plus what the client does (read at once, or stall
first) and the :class:`WireConfig` both drivers run with. The same scenario
app serves as the app behind the middleware and as the upstream behind the
sidecar, so both drivers see the same upstream bytes with the same timing.

Timing is made deterministic by design: every ``Send`` is followed by a short
gap so a fast client gets it as its own write; the heartbeat scenarios'
silences are chosen so a heartbeat never falls within 0.2 s of a silence's
end (a loop that runs late by less than that, on a machine with two busy
processes beside the suite, writes the same bytes); every other scenario runs
with heartbeats and the commit deadline seconds away, so a stall under load
cannot add a heartbeat or commit a stream early where the reference does not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from tokenwire.middleware import (
    CloseClient,
    CommitHeaders,
    FailureKind,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
)

SEND_GAP_S = 0.005


@dataclass(frozen=True)
class Send:
    """The upstream writes these bytes (any framing: partial lines, CRLF...)."""

    data: bytes
    gap_s: float = SEND_GAP_S


@dataclass(frozen=True)
class Silence:
    """The upstream says nothing for a while."""

    seconds: float


@dataclass(frozen=True)
class Fail:
    """The upstream breaks off (the app raises; the upstream connection is cut)."""


Step = Send | Silence | Fail


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    config: WireConfig
    status: int = 200
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"text/event-stream"),)
    client_stall_s: float = 0.0
    """The client reads nothing for this long (with a tiny receive buffer)."""
    timing_sensitive: bool = False
    """Coalescing depends on timing: compare text deltas merged, not raw events."""
    notes: str = ""


BASE = WireConfig(retry_attempts=0, terminal_marker="[DONE]", heartbeat_s=2.0, commit_deadline_s=2.0)
HEARTBEATS = BASE.replace(heartbeat_s=0.4, commit_deadline_s=0.1)
"""The heartbeat scenarios' config: their silences end 0.2 s from any heartbeat."""


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [] if usage else [{"index": 0, "delta": delta,
                                                         "finish_reason": finish}]}
    if usage:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _chat(*texts: str) -> tuple[Step, ...]:
    return (Send(chunk(role="assistant", content="")), *(Send(chunk(t)) for t in texts),
            Send(chunk(finish="stop")), Send(chunk(usage={"prompt_tokens": 3, "completion_tokens": 4})),
            Send(DONE))


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("openai_chat", _chat("Hel", "lo", ", wor", "ld"), BASE),
    Scenario("sse_framing", (
        Send(b"\xef\xbb\xbfevent: progress\r\nid: 7\r\nretry: 1500\r\ndata: a\r\ndata: b\r\n\r\n"),
        Send(b": upstream keepalive\n\n"),
        Send(b"data: split "),
        Send(b"across sends\n\n"),
        Send(b"data:no-space\rdata:  two spaces\r\r"),
        Send(b"id: 8\n\n"),
        Send(DONE),
    ), BASE, notes="BOM, CRLF/CR, multi-line data, comments dropped, id-only event kept"),
    Scenario("heartbeat_before_first_event", (Silence(1.1), *_chat("late")), HEARTBEATS,
             notes="headers at 0.1 s, heartbeats at 0.5 and 0.9 s (the next would be at 1.3 s)"),
    Scenario("heartbeat_mid_stream", (Send(chunk("a")), Silence(1.0), Send(chunk("b")), Send(DONE)),
             HEARTBEATS, notes="heartbeats 0.4 and 0.8 s after the first write (the next: 1.2 s)"),
    Scenario("fail_after_events", (Send(chunk("a")), Send(chunk("b")), Send(chunk("c")), Fail()),
             BASE, notes="in-band error, body cut without terminator"),
    Scenario("eof_without_terminal_marker", (Send(chunk("a")), Send(chunk("b"))), BASE),
    Scenario("eof_without_marker_allowed", (Send(chunk("a")), Send(chunk("b"))),
             BASE.replace(terminal_marker=None)),
    Scenario("truncated_final_event", (Send(chunk("a")), Send(b"data: {\"half")),
             BASE.replace(terminal_marker=None)),
    Scenario("empty_stream", (), BASE, notes="no event at all: a real 502"),
    Scenario("upstream_error_event_first",
             (Send(b'data: {"error": {"message": "overloaded", "type": "x", "code": "busy"}}\n\n'),),
             BASE),
    # An engine that answered a streaming request with JSON, passed through as an
    # operator may ask (by default a known dialect's route answers 502).
    Scenario("json_passthrough", (Send(b'{"id":"c1","choices":[{"text":"hi"}]}'),),
             BASE.replace(non_event_stream_answer="pass"), headers=((b"content-type", b"application/json"),)),
    Scenario("error_status_passthrough", (Send(b'{"error":{"message":"slow down"}}'),), BASE,
             status=429, headers=((b"content-type", b"application/json"), (b"retry-after", b"2"))),
    Scenario("slow_reader_coalesces", (
        Send(chunk(role="assistant", content="")),
        *(Send(chunk(f"token{i} "), gap_s=0.0) for i in range(2000)),
        Send(chunk(finish="stop")), Send(DONE)),
        BASE.replace(write_deadline_s=10.0), client_stall_s=0.5, timing_sensitive=True),
)
SCENARIOS_BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


class ScenarioFailure(Exception):
    """Raised by the scenario app for a ``Fail`` step."""


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


PLAYED: dict[str, asyncio.Event] = {}
"""Set (by name) when a scenario's app has played its last step: a stalled
client waits for it, so what it tests does not depend on how fast the machine is."""


def mark_played(name: str) -> None:
    event = PLAYED.get(name)
    if event is not None:
        event.set()


async def play_steps(steps: Iterable[Step], send: Callable[[Message], Awaitable[None]],
                     failure: Callable[[], Exception]) -> None:
    """An ASGI upstream's body, step by step: each ``Send`` as a body part and
    its pause after, each ``Silence`` waited out; a ``Fail`` raises ``failure()``
    (the server then cuts the body). Does not end the body."""
    for step in steps:
        if isinstance(step, Send):
            await send({"type": "http.response.body", "body": step.data, "more_body": True})
            await asyncio.sleep(step.gap_s)
        elif isinstance(step, Silence):
            await asyncio.sleep(step.seconds)
        else:
            raise failure()


def path_of(scenario: Scenario) -> str:
    """The request path of a scenario: its name, on a Chat Completions route (the
    scenarios are OpenAI streams; a shape that is not one is generic all the same)."""
    return f"/{scenario.name}/v1/chat/completions"


async def scenario_app(scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
    """Plays ``/<scenario name>/...`` (:func:`path_of`) as an upstream would."""
    if scope["type"] != "http":
        return
    scenario = SCENARIOS_BY_NAME[scope["path"].strip("/").split("/")[0]]
    try:
        await send({"type": "http.response.start", "status": scenario.status,
                    "headers": list(scenario.headers)})
        await play_steps(scenario.steps, send, lambda: ScenarioFailure(scenario.name))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        mark_played(scenario.name)


# ---------------------------------------------------------------- the reference


@dataclass
class WireResult:
    """What a client received, parsed: the unit the suite compares."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool
    extra: dict[str, Any] = field(default_factory=dict)


def reference(scenario: Scenario) -> WireResult:
    """The core's own answer for ``scenario`` with a client that keeps up,
    in virtual time: what every driver must put on the wire."""
    now = 0.0
    stream = WireStream(scenario.config, now=now, request_id="ref", upstream="app")
    status = 0
    headers: dict[bytes, bytes] = {}
    body = bytearray()
    complete = False

    def feed(event: Any) -> None:
        nonlocal status, headers, complete
        for action in stream.handle(event, now):
            if isinstance(action, CommitHeaders):
                status = action.status
                headers = dict(action.headers)
            elif isinstance(action, CloseClient):
                complete = not action.abrupt
        data = stream.data_to_send(now)
        if data:
            body.extend(data)
            feed(WriteCompleted())

    def advance(seconds: float) -> None:
        nonlocal now
        end = now + seconds
        while (deadline := stream.next_deadline()) is not None and deadline <= end:
            now = max(now, deadline)
            feed(Tick())
        now = end

    feed(UpstreamHeaders(scenario.status, scenario.headers))
    for step in scenario.steps:
        if isinstance(step, Send):
            feed(UpstreamData(step.data))
            advance(step.gap_s)
        elif isinstance(step, Silence):
            advance(step.seconds)
        else:
            feed(UpstreamFailed(FailureKind.PROTOCOL, "reference"))
            break
    else:
        feed(UpstreamEnded())
    assert stream.finished, f"{scenario.name}: the reference stream did not finish"
    return WireResult(status, headers, bytes(body), complete)
