"""Engine transcripts, a replay upstream that serves them, and the oracle they are judged by.

A transcript (``transcripts/*.sse``) is a header of SSE comment lines citing
where its format comes from, a blank line, then the engine's bytes exactly.
The replay app serves ``GET /<name>`` as that engine would: status 200,
``text/event-stream``, then the bytes one event at a time (each ``Send`` of
the behaviour suite, so both drivers see the same upstream timing).

The oracle is independent of the wire core: a small SSE splitter for the
transcripts (no CR in them) and the coalescing rule (docs/architecture.md#coalescing) written out
again, so a merge the core should not have made shows up as a difference.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from behaviour.drivers import through_middleware, through_sidecar
from behaviour.scenarios import SEND_GAP_S, Scenario, Send, Silence, mark_played, play_steps
from behaviour.test_behaviour import parse
from tokenwire.middleware import WireConfig
from tokenwire.middleware.core.sse import SSEParser

TRANSCRIPTS = Path(__file__).resolve().parent / "transcripts"
EVENT_STREAM = ((b"content-type", b"text/event-stream"),)


@dataclass(frozen=True)
class Transcript:
    name: str
    header: str
    body: bytes

    @classmethod
    def load(cls, name: str) -> Transcript:
        raw = (TRANSCRIPTS / f"{name}.sse").read_bytes()
        header, separator, body = raw.partition(b"\n\n")
        assert separator and all(line.startswith(b":") for line in header.split(b"\n")), \
            f"{name}: the citation header must be SSE comment lines ended by a blank line"
        return cls(name, header.decode(), body)

    def raw_events(self) -> list[bytes]:
        """The body cut after each blank line: one upstream write per event
        (a trailing fragment, such as Ollama's bare error line, is the last)."""
        parts = self.body.split(b"\n\n")
        events = [part + b"\n\n" for part in parts[:-1]]
        if parts[-1]:
            events.append(parts[-1])
        return events


def transcript_names() -> list[str]:
    return sorted(path.stem for path in TRANSCRIPTS.glob("*.sse"))


# ---------------------------------------------------------------- the oracle


def sse_data(body: bytes) -> list[str]:
    """The ``data`` of each dispatched event (comments and other fields
    ignored, an unterminated last block discarded), as EventSource reads it."""
    out: list[str] = []
    for block in body.split(b"\n\n")[:-1]:
        lines = [line.decode() for line in block.split(b"\n")]
        data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


_CHUNK_KEYS = {"id", "object", "created", "model", "system_fingerprint", "service_tier", "choices", "usage",
               "obfuscation"}
_CHOICE_KEYS = {"index", "delta", "text", "finish_reason", "logprobs", "stop_reason", "matched_stop"}
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
_NEVER_COMPARED = {"choices", "created", "obfuscation"}  # obfuscation: the default volatile field


def text_piece(data: str) -> tuple[tuple[Any, ...], str] | None:
    """``(merge key, text)`` if ``data`` is a chunk the coalescing rule lets merge: one
    choice whose delta holds text in one field (other text fields empty, an
    optional role), or a later argument fragment of one tool call, and nothing
    else of value; top-level fields other than ``created`` and the volatile
    ``obfuscation`` are part of the key. Anything else is a barrier."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not set(chunk) <= _CHUNK_KEYS or chunk.get("usage") is not None:
        return None
    same = tuple(sorted((k, json.dumps(v)) for k, v in chunk.items() if k not in _NEVER_COMPARED))
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if not set(choice) <= _CHOICE_KEYS or any(
            choice.get(k) is not None for k in ("finish_reason", "logprobs", "stop_reason", "matched_stop")):
        return None
    delta = choice.get("delta")
    if delta is None:
        text = choice.get("text")
        return ((same, choice.get("index"), "text"), text) if isinstance(text, str) else None
    if not isinstance(delta, dict):
        return None
    role = delta.get("role")
    values = {k: v for k, v in delta.items() if v is not None and k != "role"}
    if "tool_calls" in values:
        return _argument_piece(same, choice.get("index"), role, values)
    if not values or not set(values) <= set(_TEXT_FIELDS):
        return None
    if not all(isinstance(v, str) for v in values.values()):
        return None
    filled = [k for k, v in values.items() if v]
    if len(filled) > 1 or (role is not None and not filled):
        return None
    name = filled[0] if filled else next(iter(values))
    return (same, choice.get("index"), name, role), values[name]


def _argument_piece(same: tuple[Any, ...], index: Any, role: Any,
                    values: dict[str, Any]) -> tuple[tuple[Any, ...], str] | None:
    if any(k != "tool_calls" and (k not in _TEXT_FIELDS or v != "") for k, v in values.items()):
        return None
    calls = values["tool_calls"]
    if not isinstance(calls, list) or len(calls) != 1 or not isinstance(calls[0], dict):
        return None
    call = calls[0]
    function = call.get("function")
    if (not set(call) <= {"index", "id", "type", "function"} or call.get("id") is not None
            or not isinstance(function, dict) or not set(function) <= {"arguments", "name"}
            or function.get("name") is not None or not isinstance(function.get("arguments"), str)):
        return None
    return (same, index, f"tool_calls[{call.get('index')}]", call.get("type"), role), function["arguments"]


def normalised(datas: list[str]) -> list[Any]:
    """Runs of mergeable text joined per key; every barrier as parsed JSON
    (or its text). Equal for two event lists iff they carry the same text
    in the same runs and the same barriers in the same places."""
    out: list[Any] = []
    last_key: tuple[Any, ...] | None = None
    for data in datas:
        piece = text_piece(data)
        if piece is None:
            try:
                out.append(("barrier", json.loads(data)))
            except ValueError:
                out.append(("barrier", data))
            last_key = None
            continue
        key, text = piece
        if key == last_key:
            out[-1] = ("text", key, out[-1][2] + text)
        else:
            out.append(("text", key, text))
        last_key = key
    return out


def texts(datas: list[str]) -> dict[tuple[Any, str], str]:
    """All text per (choice index, field), concatenated over the whole stream."""
    out: dict[tuple[Any, str], str] = {}
    for data in datas:
        piece = text_piece(data)
        if piece is not None:
            key = (piece[0][1], piece[0][2])
            out[key] = out.get(key, "") + piece[1]
    return out


def is_upstream_error(data: str) -> bool:
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("error") is not None and "choices" not in obj


# ---------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Expect:
    """What a client must see for one transcript."""

    ends_in_error: bool = False
    error_message: str | None = None
    """A piece of the upstream's message that must survive the mapping; None =
    the upstream's message cannot be read, tokenwire's own is fine."""
    error_type: str | None = None
    config: WireConfig = field(default_factory=lambda: BASE)


BASE = WireConfig(retry_attempts=0, terminal_marker="[DONE]", heartbeat_s=5.0, commit_deadline_s=0.5,
                  write_deadline_s=10.0)


def expected_datas(transcript: Transcript, expect: Expect) -> list[str] | None:
    """The client's events, mapped error excluded (checked on its own): the
    upstream's events up to its error, or all of them (less a ``[DONE]`` that
    follows an error the parser cannot see)."""
    datas = sse_data(transcript.body)
    if not expect.ends_in_error:
        return datas
    for i, data in enumerate(datas):
        if is_upstream_error(data):
            return datas[:i]
    return [d for d in datas if d != "[DONE]"]


def check_error_event(data: str, expect: Expect, upstream_body: bytes) -> None:
    """The in-band error: the engine's own error object forwarded field for field
    (a bare string becomes ``{"message", "type", "code"}``, the shape the OpenAI
    SDKs raise on), with tokenwire's code beside it."""
    obj = json.loads(data)
    assert set(obj) == {"error"} and isinstance(obj["error"], dict), obj
    error = dict(obj["error"])
    ours = error.pop("tokenwire")
    assert isinstance(error.get("message"), str), obj
    upstream = _upstream_error(upstream_body)
    if ours == {"code": "upstream_failed", "number": "E7307"} and isinstance(upstream, dict):
        assert error == upstream, obj
    else:
        assert set(error) == {"message", "type", "code"} and ours["code"] == error["code"], obj
    if expect.error_message is not None:
        assert expect.error_message in obj["error"]["message"], obj
    if expect.error_type is not None:
        assert obj["error"]["type"] == expect.error_type, obj


def _upstream_error(body: bytes) -> object:
    """The ``error`` value of the engine's own error event in ``body``."""
    parser = SSEParser()
    for event in parser.feed(body) + parser.feed(b"\n\n"):
        if event.data and '"error"' in event.data:
            try:
                payload = json.loads(event.data)
            except ValueError:
                continue
            if isinstance(payload, dict) and "error" in payload:
                return payload["error"]
    return None


# ---------------------------------------------------------------- the replay upstream


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def scenario_for(transcript: Transcript, config: WireConfig, *, repeat_text: int = 1,
                 client_stall_s: float = 0.0) -> Scenario:
    """The transcript as a behaviour-suite :class:`Scenario`: one ``Send`` per
    event. ``repeat_text`` > 1 sends each mergeable text chunk that many times
    in a row and without gaps (a longer answer of the same shape: enough bytes
    to fill the socket buffers of a stalled reader)."""
    steps: list[Send | Silence] = []
    for raw in transcript.raw_events():
        datas = sse_data(raw)
        mergeable = len(datas) == 1 and text_piece(datas[0]) is not None
        if mergeable and repeat_text > 1:
            steps.extend(Send(raw, gap_s=0.0) for _ in range(repeat_text))
        else:
            steps.append(Send(raw, gap_s=0.0 if repeat_text > 1 else SEND_GAP_S))
    name = transcript.name if repeat_text == 1 else f"{transcript.name}-x{repeat_text}"
    return Scenario(name, tuple(steps), config, headers=EVENT_STREAM, client_stall_s=client_stall_s)


def replay_app(scenario: Scenario) -> Callable[[Scope, Callable[[], Awaitable[Message]],
                                                Callable[[Message], Awaitable[None]]], Awaitable[None]]:
    """An ASGI app that plays ``scenario``'s upstream bytes (the scenario app of
    the behaviour suite, for one scenario that is not in its table)."""

    async def app(scope: Scope, receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        try:
            await send({"type": "http.response.start", "status": scenario.status,
                        "headers": list(scenario.headers)})
            await play_steps(scenario.steps, send, lambda: AssertionError("a transcript has no Fail step"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            mark_played(scenario.name)

    return app


async def replay_through_middleware(scenario: Scenario) -> bytes:
    """The replay app behind the middleware, as the behaviour suite runs its apps."""
    return await through_middleware(replay_app(scenario), scenario)


async def replay_through_sidecar(scenario: Scenario) -> bytes:
    """The replay app as the upstream of an in-process sidecar, likewise."""
    return await through_sidecar(replay_app(scenario), scenario)


DRIVERS = {"middleware": replay_through_middleware, "sidecar": replay_through_sidecar}

__all__ = ["DRIVERS", "Expect", "Transcript", "parse"]
