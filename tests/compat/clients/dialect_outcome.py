"""What of a dialect client's outcome the rows compare (:func:`view`), and the
comparison of *through tokenwire* with *directly*, documented differences
included (:func:`compare`; README.md, "Dialect rows").

Raw events (the clients that hand them over) are compared whole, after one
normalization that only undoes what tokenwire may do for a slow reader:
consecutive deltas of one stream position are joined into one (Responses
``response.*.delta`` per ``item_id``/``output_index``/``content_index``,
Anthropic ``content_block_delta`` per ``index`` and delta type), and
``sequence_number`` is dropped (tokenwire renumbers it; :func:`sequence_gaps`
checks it separately: strictly increasing and contiguous).
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from .dialect_clients import DialectOutcome, _body_error
from .dialect_scripts import ANTHROPIC_OVERLOADED, BEFORE_FAILURE, RESPONSES_ERROR, WORDS
from .outcome import diff_of, short_json
from .scripts import DEATH_AFTER_WORDS, ERROR_MID

RESPONSES_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                              "response.function_call_arguments.delta"})
ANTHROPIC_DELTAS = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}
CUT_KINDS = frozenset({
    "RemoteProtocolError", "ReadError",  # httpx / httpx2 read into a body cut without its terminator
    "APIConnectionError",  # openai-python's stream helper wraps that
    "TypeError", "OpenAIError", "AnthropicError",  # Node's fetch: "terminated" (the SDKs rethrow it)
    "AI_APICallError",  # the AI SDK: "Failed to process successful response"
    "MidStreamFallbackError", "InternalServerError",  # litellm, wrapping the cut
})
"""How a client reports a body cut without its terminator."""
BARE_CUT_KINDS = frozenset({"RemoteProtocolError", "ReadError", "APIConnectionError", "TypeError",
                            "AI_APICallError"})
"""A body cut, as the client reports it when nothing told it more."""
STRIPS_ERROR_FIELDS = frozenset({"litellm-anthropic", "litellm-responses", "ai-sdk-anthropic",
                                 "ai-sdk-openai-responses", "ai-sdk-openai-chat"})
"""Clients that drop fields they do not know from an error object (tokenwire's
``"tokenwire"`` among them): litellm keeps only a message, the AI SDK what its
schema names."""
ANTHROPIC_ERROR_TYPES = frozenset({"invalid_request_error", "authentication_error", "billing_error",
                                   "permission_error", "not_found_error", "rate_limit_error", "timeout_error",
                                   "api_error", "overloaded_error"})
"""The error ``type``s of Anthropic's error objects (``anthropic/types/shared/``)."""
ENDED_EARLY_KINDS = frozenset({"RuntimeError", "Object"})
"""A stream helper's own complaint that the stream ended before its terminal event
(openai-python's "Didn't receive a `response.completed` event", openai-node's
``error`` event)."""


def _merge_key(dialect: str, event: Any) -> Any:
    if not isinstance(event, dict):
        return None
    if dialect == "responses" and event.get("type") in RESPONSES_DELTAS:
        return (event["type"], event.get("item_id"), event.get("output_index"), event.get("content_index"))
    if dialect == "anthropic" and event.get("type") == "content_block_delta":
        kind = (event.get("delta") or {}).get("type")
        if kind in ANTHROPIC_DELTAS:
            return (event["type"], event.get("index"), kind)
    return None


def normalized_events(dialect: str, events: list[Any]) -> list[Any]:
    """``events`` with consecutive deltas of one position joined, without ``sequence_number``."""
    out: list[Any] = []
    last_key = None
    for event in events:
        key = _merge_key(dialect, event)
        if isinstance(event, dict):
            event = {k: v for k, v in event.items() if k != "sequence_number"}
        if key is not None and key == last_key:
            into = out[-1]
            if dialect == "responses":
                into["delta"] += event["delta"]
                if isinstance(into.get("logprobs"), list):
                    into["logprobs"] = into["logprobs"] + (event.get("logprobs") or [])
            else:
                field = ANTHROPIC_DELTAS[key[2]]
                into["delta"] = {**into["delta"], field: into["delta"][field] + event["delta"][field]}
        else:
            out.append(json.loads(json.dumps(event)))
        last_key = key
    return out


def sequence_gaps(events: list[Any]) -> list[tuple[int, int]]:
    """Each pair of consecutive ``sequence_number``s that is not ``n, n + 1``."""
    numbers = [e["sequence_number"] for e in events if isinstance(e, dict) and "sequence_number" in e]
    return [(a, b) for a, b in pairwise(numbers) if b != a + 1]


def raw_text(dialect: str, out: DialectOutcome) -> str:
    """The answer's text as the application has it (raw events added up, or the client's own)."""
    if out.events is None:
        return out.text or ""
    text = ""
    for event in out.events:
        if not isinstance(event, dict):
            continue
        if dialect == "responses" and event.get("type") == "response.output_text.delta":
            text += event["delta"]
        elif dialect == "anthropic" and event.get("type") == "content_block_delta" \
                and event["delta"].get("type") == "text_delta":
            text += event["delta"]["text"]
    return text


def _strip_tokenwire(value: Any) -> Any:
    """``value`` without tokenwire's own ``"tokenwire"`` fields (added beside an
    upstream's error object)."""
    if isinstance(value, dict):
        return {k: _strip_tokenwire(v) for k, v in value.items() if k != "tokenwire"}
    if isinstance(value, list):
        return [_strip_tokenwire(v) for v in value]
    return value


def view(dialect: str, out: DialectOutcome) -> dict[str, Any]:
    """The part of an outcome that must be the same through tokenwire."""
    error = None
    if out.error is not None:
        error = {k: out.error.get(k) for k in ("kind", "status", "type", "message")}
        error["body"] = _strip_tokenwire(out.error.get("body"))
        error["count"] = out.error.get("count")
    events = None if out.events is None else normalized_events(dialect, _strip_tokenwire(out.events))
    return {"status": out.status, "events": events, "text": out.text, "thinking": out.thinking,
            "tools": out.tools, "stop": out.stop, "usage": out.usage, "final": out.final, "error": error,
            "parts": out.parts}


def tokenwire_error(out: DialectOutcome) -> dict[str, Any] | None:
    """tokenwire's own ``"tokenwire": {"code", "number"}`` in the error the client
    raised or the error event it handed over, if any."""
    candidates: list[Any] = []
    if out.error is not None:
        body = out.error.get("body")
        candidates += [body, body.get("error") if isinstance(body, dict) else None]
    for event in out.events or ():
        if isinstance(event, dict) and (event.get("type") == "error" or "error" in event):
            candidates += [event, event.get("error")]
    for candidate in candidates:
        if isinstance(candidate, dict) and isinstance(candidate.get("tokenwire"), dict):
            return candidate["tokenwire"]
    return None


def upstream_error(dialect: str) -> dict[str, Any]:
    """The fields of the upstream's own error that must reach the client as they came."""
    if dialect == "anthropic":
        return dict(ANTHROPIC_OVERLOADED["error"])
    if dialect == "responses":
        return {k: v for k, v in RESPONSES_ERROR.items() if v is not None}
    return {k: ERROR_MID[k] for k in ("message", "type", "code")}


def carries(out: DialectOutcome, expected: dict[str, Any]) -> bool:
    """The client handed the application the upstream's error fields ``expected``:
    in the exception's body, in an error event it yielded, or (litellm, which
    keeps only a message) a message naming the upstream's."""
    found: list[Any] = []
    if out.error is not None:
        body = out.error.get("body")
        found += [body, body.get("error") if isinstance(body, dict) else None]
    found += [e for e in out.events or () if isinstance(e, dict) and e.get("type") == "error"]
    for obj in found:
        if isinstance(obj, dict) and all(obj.get(k) == v for k, v in expected.items()):
            return True
    return out.error is not None and expected["message"] in str(out.error.get("message"))


def compare(dialect: str, feature: str, client: str, direct: DialectOutcome, through: DialectOutcome) -> None:
    """Fail with the difference unless README.md documents it as intended."""
    if through.events is not None and dialect == "responses":
        assert not sequence_gaps(through.events), \
            f"sequence_number not contiguous through tokenwire: gaps {sequence_gaps(through.events)[:5]}"
    want, got = view(dialect, direct), view(dialect, through)
    if feature in ("error_event", "error_mid_stream"):
        # Documented: the upstream's error reaches the client as it came (tokenwire's
        # fields beside it), and after it the body is cut: a client that reads on
        # past the error event (it does not raise there) then sees the cut.
        expected = upstream_error(dialect)
        assert carries(direct, expected), f"direct: the client did not get the upstream's error: {direct}"
        error_events = [e for e in through.events or () if e.get("type") == "error"]
        assert carries(through, expected), (
            f"through tokenwire the client did not get the upstream's error {expected} as it came: "
            f"error {through.error}, error events {error_events}")
        read_on = want["error"] is None or want["error"]["kind"] in ENDED_EARLY_KINDS
        if read_on and got["error"] is not None and got["error"]["kind"] in CUT_KINDS:
            want["error"] = got["error"] = "read on into the cut"
        if got["parts"] is not None and _ai_sdk_read_on(direct, through):
            # The AI SDK reads on past an error part: through tokenwire it then reads
            # into the cut, fails its stream (a second error) and never finishes.
            for v in (want, got):
                v["parts"] = v["parts"][:v["parts"].index("error") + 1]
                v["stop"] = v["usage"] = None
                v["error"] = {**v["error"], "count": 1}
    assert got == want, diff_of(want, got)


def assert_tokenwire_ending(dialect: str, feature: str, client: str, direct: DialectOutcome,
                            through: DialectOutcome) -> None:
    """Endings only tokenwire reports (README.md, "Dialect rows"): directly the
    client saw a broken or a silently ended stream; through tokenwire it must
    raise (or hand over) tokenwire's in-band error, ``upstream_failed``, after
    the same text."""
    text = "".join(WORDS[:DEATH_AFTER_WORDS if dialect == "chat" else BEFORE_FAILURE]) \
        if feature != "eof_no_terminal" else "".join(WORDS)
    assert raw_text(dialect, direct) == text, f"direct: text {raw_text(dialect, direct)!r}"
    assert direct.error is None or direct.error["kind"] in CUT_KINDS | ENDED_EARLY_KINDS \
        or "without" in str(direct.error["message"]) or "ended" in str(direct.error["message"]), \
        f"directly the client should see a broken or silently ended stream: {direct.error}"
    assert tokenwire_error(direct) is None
    assert raw_text(dialect, through) == text, \
        f"through tokenwire the text before the end was {raw_text(dialect, through)!r}, not {text!r}"
    assert through.error is not None, (
        f"through tokenwire the client must raise (tokenwire's in-band error) where directly the stream "
        f"{'broke' if direct.error else 'ended silently'}; it ended with no error: "
        f"{short_json(through.to_json())}")
    code = tokenwire_error(through)
    if client in STRIPS_ERROR_FIELDS:
        # The client keeps a message (litellm) or the fields its schema knows (the AI
        # SDK): no "tokenwire" object; what it raised must not be the bare cut.
        assert through.error["kind"] not in BARE_CUT_KINDS, \
            f"the client saw a cut body, not tokenwire's error event: {through.error}"
        if client.startswith("ai-sdk"):
            # The error part carries tokenwire's error object (``code`` where the dialect has one).
            body = _body_error(through.error.get("body")) or {}
            assert through.error["kind"] == "Object", through.error
            assert body.get("message") == through.error["message"], through.error
            assert body.get("code", "upstream_failed") == "upstream_failed", through.error
        return
    assert code is not None and code.get("code") == "upstream_failed", (
        f"through tokenwire the client's error does not carry tokenwire's upstream_failed: {through.error} "
        f"(direct: {direct.error})")
    if dialect == "anthropic":
        # Anthropic's shape: {"type": "error", "error": {"type": <one of its error types>, "message"}}.
        body = through.error.get("body") or {}
        assert body.get("type") == "error" and through.error["type"] in ANTHROPIC_ERROR_TYPES, through.error


def _ai_sdk_read_on(direct: DialectOutcome, through: DialectOutcome) -> bool:
    """The AI SDK's error part came as directly, and after it only a cut."""
    if direct.error is None or through.error is None or direct.error.get("count") != 1:
        return False
    later = (through.error.get("all") or [])[1:]
    return bool(later) and all(kind in CUT_KINDS for kind, _ in later) and "error" in (through.parts or ())

