"""The OpenAI streaming chunk format, in one place.

Theory of operation
-------------------
Everything tokenwire knows about what is *inside* an SSE ``data:`` payload of
an OpenAI-compatible stream lives here, so the rest of the code treats events
as opaque unless it asks this module:

* **where the text is**: a chat chunk's ``choices[0].delta`` field
  (``content``, ``reasoning_content``, or vLLM's and Ollama's ``reasoning``), a
  completion's ``choices[0].text``, or a later argument fragment of one tool
  call (``delta.tool_calls[0].function.arguments``): :func:`text_slot` by
  parsing, :func:`text_value` by a regex that finds the value without parsing;
* **which chunks merge** (the *shape*): two chunks merge when everything but
  their text is the same (the merge key of :func:`text_slot`); a mergeable
  chunk is kept as a template, ``prefix + escaped text + suffix``
  (:data:`Slot`), so a merged chunk is the first chunk's JSON with the escaped
  texts concatenated (:func:`slot_by_parsing`, :func:`same_shape`); the
  coalescing itself is ``pending.py``'s;
* **error objects**: an upstream's error event (:func:`error_object`), the
  status and message it stands for (:func:`status_of`, :func:`message_of`), and
  the shape tokenwire writes its own errors in (:func:`error_payload`), which
  the OpenAI SDKs raise on;
* **usage**: the block accounting keeps (:func:`usage_of`);
* **tokens**: whether an event carries one (:func:`carries_token`: text,
  reasoning or a tool call, not the role-only chunk), for the time to first
  token (``meter.py``);
* the **keeps-up fast path**: which reads hold nothing but plain chunks that
  need no look inside (:func:`plain_event_count`);
* the **client's view** of a chunk, for the tools (:func:`read_chunk`).

``pending.py``'s docstring lists the engine habits that still count as
text-only chunks (TGI and Ollama repeat the role; Ollama's empty ``content``
beside ``reasoning``).
"""

from __future__ import annotations

import json
import json.scanner
import re
import typing
from dataclasses import dataclass
from typing import Any, Final

# Top-level chunk keys a mergeable chunk may have (besides volatile ones). Their
# values are part of the merge key: chunks that differ in them never merge.
CHUNK_KEYS: Final = frozenset({"id", "object", "created", "model", "system_fingerprint",
                        "service_tier", "choices", "usage"})
CHOICE_KEYS: Final = frozenset({"index", "delta", "text", "finish_reason", "logprobs", "stop_reason",
                         "matched_stop"})
TEXT_FIELDS: Final = ("content", "reasoning_content", "reasoning")
"""The delta fields that carry answer text."""
TOOL_CALL_KEYS: Final = frozenset({"index", "id", "type", "function"})
# Keys whose values never block a merge: the choices (compared on their own),
# ``created``, a timestamp that Ollama stamps on every chunk afresh, and
# ``usage``, cumulative where an engine puts it in every chunk (vLLM's
# continuous_usage_stats, the way to bill aborted streams): a merged chunk keeps
# the newest, which is the usage as of its last text. Chunks merge only if both
# carry usage or neither does (the key says which).
ALWAYS_VOLATILE: Final = frozenset({"choices", "created", "usage"})

Slot = tuple[tuple[object, ...], str, str, str]
"""A mergeable chunk as a template: (merge key, prefix, suffix, escaped text);
``prefix + escaped_text + suffix`` is its JSON (the text without its quotes).
Chunks with equal keys merge."""


# ---------------------------------------------------------------- where the text is


def text_slot(data: str, volatile: frozenset[str]) -> tuple[
        tuple[object, ...], dict[str, Any], dict[str, Any], str] | None:
    """If ``data`` is a mergeable OpenAI chunk: (merge key, chunk, holder, field).

    ``holder[field]`` is the text (or tool-call arguments); the key says what it
    may merge with.
    """
    if not data.startswith("{"):
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not chunk.keys() <= CHUNK_KEYS | volatile:
        return None
    usage = chunk.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return None
    # Every top-level value but the choices and the volatile fields must match.
    same = (*sorted((k, json.dumps(v, sort_keys=True)) for k, v in chunk.items()
                    if k not in ALWAYS_VOLATILE and k not in volatile), ("usage", usage is not None))
    found = _choice_slot(chunk)
    if found is None:
        return None
    key, holder, field = found
    return (*key, same), chunk, holder, field


def _choice_slot(chunk: dict[str, Any]) -> tuple[tuple[object, ...], dict[str, Any], str] | None:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if not choice.keys() <= CHOICE_KEYS:
        return None
    if any(choice.get(k) is not None for k in ("finish_reason", "logprobs", "stop_reason",
                                               "matched_stop")):
        return None
    delta = choice.get("delta")
    if delta is None:
        text = choice.get("text")
        if not isinstance(text, str):
            return None
        return (choice.get("index"), "text"), choice, "text"
    if not isinstance(delta, dict) or "text" in choice:
        return None
    role = delta.get("role")
    if role is not None and not isinstance(role, str):
        return None
    fields = [k for k, v in delta.items() if v is not None and k != "role"]
    if "tool_calls" in fields:
        return _tool_call_slot(choice.get("index"), delta, role, fields)
    if not fields or any(k not in TEXT_FIELDS or not isinstance(delta[k], str) for k in fields):
        return None
    # One field carries the text; any other text field must be empty (Ollama's
    # ``"content": ""`` beside ``reasoning``). With all empty, the first one --
    # unless a role is named: a role with no text is the role chunk, a barrier.
    with_text = [k for k in fields if delta[k]]
    if len(with_text) > 1 or (role is not None and not with_text):
        return None
    field = with_text[0] if with_text else fields[0]
    return (choice.get("index"), field, role), delta, field


def _tool_call_slot(choice_index: object, delta: dict[str, Any], role: object,
                    fields: list[str]) -> tuple[tuple[object, ...], dict[str, Any], str] | None:
    """A later argument fragment of one tool call: mergeable by the call's index.
    The call's first chunk (its ``id``, ``name``) and anything beside the call
    other than empty text fields stay barriers."""
    if any(k != "tool_calls" and (k not in TEXT_FIELDS or delta[k] != "") for k in fields):
        return None
    calls = delta["tool_calls"]
    if not isinstance(calls, list) or len(calls) != 1 or not isinstance(calls[0], dict):
        return None
    call = calls[0]
    function = call.get("function")
    if (not call.keys() <= TOOL_CALL_KEYS or call.get("id") is not None
            or not isinstance(function, dict) or not function.keys() <= {"arguments", "name"}
            or function.get("name") is not None or not isinstance(function.get("arguments"), str)):
        return None
    kind = call.get("type")
    if kind is not None and not isinstance(kind, str):
        return None
    return (choice_index, "tool_calls", call.get("index"), kind, role), function, "arguments"


# A JSON string holding one text field's value: ``"field": "<escaped>"``. Only a
# value made of valid JSON string characters matches, so the chunk stays valid
# JSON when values are concatenated.
_TEXT_VALUE_RE: Final = re.compile(
    r'"(content|reasoning_content|reasoning|text|arguments)"[ \t\r\n]*:[ \t\r\n]*"'
    r'((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')
SENTINEL: Final = "tokenwire-merge-sentinel-1f2e3d"
"""Stands in for a chunk's text while its shape is checked."""


def text_value(data: str) -> re.Match[str] | None:
    """The text value a chunk carries (group 2, escaped): the first non-empty
    one the regex finds, else the first (an empty field may come first, as in
    Ollama's ``"content":"","reasoning":"..."``)."""
    first: re.Match[str] | None = None
    for match in _TEXT_VALUE_RE.finditer(data):
        if match.group(2):
            return match
        if first is None:
            first = match
    return first


# ---------------------------------------------------------------- shapes and merging


def dumps(obj: object) -> str:
    """Compact JSON, UTF-8 where it can be; lone surrogates (from ``\\udXXX``
    escapes split across chunks) stay escaped so the bytes are valid UTF-8."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(obj, separators=(",", ":"))
    return text


def slot_by_parsing(found: tuple[tuple[object, ...], dict[str, Any], dict[str, Any], str] | None
                    ) -> Slot | None:
    """The template of what a dialect's ``text_slot`` found (None: a barrier), by
    putting a sentinel in place of its text and re-serialising the event."""
    if found is None:
        return None
    key, chunk, holder, field = found
    text = holder[field]
    holder[field] = SENTINEL
    template = dumps(chunk)
    if template.count(SENTINEL) != 1:
        return None  # the sentinel occurs in the chunk itself: keep it unmerged
    prefix, _, suffix = template.partition(json.dumps(SENTINEL))
    return key, prefix + '"', '"' + suffix, dumps(text)[1:-1]


# A JSON scalar: a string, a number, true, false or null.
_JSON_SCALAR: Final = (r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
                r"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")


def volatile_value_re(volatile: frozenset[str]) -> re.Pattern[str] | None:
    """Finds the scalar values of the volatile fields, so that chunks differing
    only there share one shape (one JSON check, not one per chunk)."""
    if not volatile:
        return None
    # Asked for by every stream, with the one set its config names: built once.
    pattern = _VOLATILE_RES.get(volatile)
    if pattern is None:
        if len(_VOLATILE_RES) >= 16:
            _VOLATILE_RES.clear()
        names = "|".join(re.escape(name) for name in sorted(volatile))
        pattern = _VOLATILE_RES[volatile] = re.compile(
            r'("(?:' + names + r')"[ \t\r\n]*:[ \t\r\n]*)(?:' + _JSON_SCALAR + ")")
    return pattern


_VOLATILE_RES: Final[dict[frozenset[str], re.Pattern[str]]] = {}


_ESCAPED_RE: Final = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


def same_shape(slot: Slot, data: str) -> str | None:
    """The escaped text of ``data`` if it is ``slot``'s template with another
    text (so it is valid JSON and merges under the same key), else None."""
    _, prefix, suffix, _ = slot
    if not (data.startswith(prefix) and data.endswith(suffix)):
        return None
    start, end = len(prefix), len(data) - len(suffix)
    if end < start or _ESCAPED_RE.fullmatch(data, start, end) is None:
        return None
    return data[start:end]


# ---------------------------------------------------------------- errors and usage


# json.loads' own C scanner with its defaults, called without json.loads: that
# is three interpreted frames and two regular-expression matches (its JSON
# whitespace skipped on either side) a call, more than the scan of a short
# object (docs/perf/stream-cost.md).
_SCAN: Final = json.scanner.make_scanner(typing.cast(Any, json.JSONDecoder()))
_JSON_SPACE: Final = " \t\n\r"


def chunk_object(data: str) -> dict[str, Any] | None:
    """An SSE ``data`` payload parsed, when it is a JSON object; else None.
    What ``json.loads`` reads, read the way it reads it: JSON whitespace either
    side (no value ends in whitespace, so stripping it changes no verdict),
    then one value that is the whole text."""
    text = data.strip(_JSON_SPACE)
    try:
        obj, end = _SCAN(text, 0)
    except (StopIteration, ValueError):
        return None
    return obj if end == len(text) and isinstance(obj, dict) else None


def error_object(data: str) -> dict[str, Any] | None:
    """The parsed payload if ``data`` is an upstream error event
    (``{"error": ...}`` and no ``choices``)."""
    if '"error"' not in data:
        return None
    obj = chunk_object(data)
    if obj is not None and obj.get("error") is not None and "choices" not in obj:
        return obj
    return None


def error_payload(message: str, error_type: str, code: str, **extra: object) -> dict[str, object]:
    """The error object tokenwire writes: ``{"error": {"message", "type", "code", ...}}``,
    the shape the OpenAI SDKs raise as ``APIError`` inside a stream."""
    return {"error": {"message": message, "type": error_type, "code": code, **extra}}


_CLIENT_ERROR_TYPES: Final = ("invalid_request", "badrequest", "bad_request", "validation", "not_found",
                       "notfound", "unprocessable", "permission", "authentication")


def status_of(payload: dict[str, Any], error: object) -> int:
    """The HTTP status an upstream's error object stands for: the ``code`` or
    ``status`` it carries when that is an HTTP error status (vLLM, SGLang and
    our engine put one there), else 400 when its type names a client error
    (OpenAI's ``invalid_request_error``, TGI's ``validation``), else 502."""
    holders = (error, payload) if isinstance(error, dict) else (payload,)
    for holder in holders:
        for key in ("code", "status", "status_code"):
            value = holder.get(key)
            if isinstance(value, str) and value.isascii() and value.isdigit():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
                return value
    kind = error.get("type") if isinstance(error, dict) else payload.get("error_type")
    if isinstance(kind, str) and kind.replace(" ", "").lower().startswith(_CLIENT_ERROR_TYPES):
        return 400
    return 502


def message_of(error: object) -> str:
    """An upstream error's message: its ``message``, else the object itself."""
    if isinstance(error, dict):
        message = error.get("message")
        return str(message) if message else json.dumps(error, ensure_ascii=False)
    return str(error)


def usage_of(data: str) -> dict[str, Any] | None:
    """The chunk's ``usage`` block, if it carries one."""
    obj = chunk_object(data)
    if obj is not None and isinstance(obj.get("usage"), dict):
        usage: dict[str, Any] = obj["usage"]
        return usage
    return None


# ---------------------------------------------------------------- the keeps-up fast path


def plain_event_count(data: bytes, limit_bytes: int, marker: str | None) -> int:
    """How many events ``data`` holds if it is nothing but whole, single-line
    ``data: `` events that need no look inside (no terminal marker, no error,
    no usage block, no comment, id, event type or CR); else 0.

    A few C-speed scans of the text, conservative by design: anything that
    might need the full algorithm (even the marker's text inside a chunk)
    answers 0 and takes the parser.
    """
    if len(data) > limit_bytes:
        return 0
    # Scanned as text, not bytes: compiled, ``str``'s find/count/startswith/``in``
    # are direct C calls, while each of ``bytes``' goes through a generic method
    # call that parses its arguments (docs/perf/compiled-core.md).
    # The decode is needed anyway: the parser replaces invalid UTF-8 with U+FFFD,
    # and bytes passed through unparsed must be no different, or the output
    # would depend on timing.
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return 0
    if not text.startswith("data: ") or not text.endswith("\n\n") or "\r" in text or '"error"' in text:
        return 0
    if text.find("\n") == len(text) - 2:
        # One line, one event: the usual read of a streaming engine. Its data
        # is the marker only if the line is exactly "data: " + marker: a length
        # compare rules out nearly every read without a scan of the text.
        if marker is not None and len(text) == len(marker) + 8 and text[6:-2] == marker:
            return 0
        count = 1
    else:
        if marker is not None and marker in text:  # anywhere: conservative
            return 0
        count = text.count("\n\n")
        if (text.count("\n") != 2 * count or text.count("data: ") != count
                or text.count("\n\ndata: ") != count - 1):
            return 0
    if '"usage"' in text:
        usage = text.count('"usage"')
        if usage != text.count('"usage":null') + text.count('"usage": null'):
            return 0
    return count


# ---------------------------------------------------------------- the client's view


@dataclass(frozen=True, slots=True)
class ChunkFacts:
    """What one OpenAI stream chunk says, as a client reads it."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    carries_token: bool = False
    """Text (content, reasoning or a completion's text) or a tool call reached the
    reader: a token. An engine's role-only first chunk, a finish reason alone and
    a usage chunk carry none."""


def read_chunk(data: str) -> ChunkFacts:
    """Read one SSE ``data`` payload of an OpenAI stream (not ``[DONE]``):
    its text (content, reasoning or completion text), finish reason, usage
    block, or in-band error."""
    try:
        chunk: Any = json.loads(data)
    except ValueError:
        return ChunkFacts(error=f"non-JSON event: {data[:120]}")
    if not isinstance(chunk, dict):
        return ChunkFacts()
    if chunk.get("error") is not None:
        return ChunkFacts(error=f"in-band error: {json.dumps(chunk['error'])[:300]}")
    usage = chunk.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    text: list[str] = []
    finish_reason = None
    tool_call = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text.append(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or choice.get("text") or "")
        tool_call = tool_call or bool(delta.get("tool_calls"))
        if choice.get("finish_reason") is not None:
            finish_reason = choice["finish_reason"]
    joined = "".join(text)
    return ChunkFacts(joined, finish_reason, tokens if isinstance(tokens, int) else None,
                      carries_token=bool(joined) or tool_call)


# ---------------------------------------------------------------- tokens


# A non-empty text field, or the opening of a tool call's list.
_TOKEN_RE: Final = re.compile(rb'"(?:content|reasoning_content|reasoning|text)" ?: ?"[^"]'
                       rb'|"tool_calls" ?: ?\[ ?\{')


def carries_token(data: bytes) -> bool:
    """Whether ``data`` (one or more events' data, or whole ``data:`` frames)
    holds a token event: a non-empty text (content, reasoning, a completion's
    text) or a tool call, found by a regex on the bytes, without parsing (the
    core asks this of reads until the first token); non-JSON data counts as a
    token. :func:`read_chunk`'s ``carries_token`` is the same fact, parsed."""
    if _TOKEN_RE.search(data) is not None:
        return True
    # Non-JSON data is content: a plain event stream's first event is its text.
    body = data[6:] if data.startswith(b"data: ") else data
    return not body.lstrip().startswith((b"{", b"[", b"\"")) and bool(body.strip())


_TOKEN_TEXT_RE: Final = re.compile(_TOKEN_RE.pattern.decode())


def count_tokens(data: str) -> int:
    """How many token pieces an event's data holds: its non-empty texts and
    tool-call fragments, one a chunk as an engine sends one token a chunk (the
    :func:`carries_token` regex). The record's count where no usage came; the role
    chunk, a finish reason and usage count none."""
    return len(_TOKEN_TEXT_RE.findall(data))
