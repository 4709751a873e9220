"""The pending buffer: what waits for a slow socket, and how it shrinks.

Theory of operation
-------------------
While the downstream socket cannot take bytes (paused, or a write still
outstanding), events queue here instead of in the kernel. When it can, the
whole buffer leaves in one write.

Under every policy, consecutive OpenAI chunks that carry nothing but text
(``delta.content``, ``delta.reasoning_content``, vLLM's and Ollama's newer
``delta.reasoning``, or a completion's ``text``) for the same id and choice are
merged into one chunk whose text is the exact concatenation. So are the
argument fragments of one tool call (``delta.tool_calls[0].function.arguments``
with no ``id`` or ``name``: the fragments after the call's first chunk), keyed
by the call's index, so a client accumulates exactly the same call. Anything
else — a role-only chunk, a tool call's first chunk, a finish reason, usage,
logprobs, unknown keys with values, non-JSON, named events, comments — is a
barrier: kept as its own event, never merged across.

Top-level chunk fields other than ``choices`` and ``created`` (a timestamp
that Ollama renews on every chunk) must be equal for chunks to merge, except
the ``volatile`` ones (``WireConfig.volatile_chunk_fields``:
OpenAI's random ``obfuscation`` padding, a gateway's per-chunk timestamp or
sequence number). Those carry no content, so a merged chunk may keep just the
newest value; a field that did carry content would lose all but its last
value, which is why only fields named there are treated so.

Two engine habits are text-only chunks too (tests/compat has their transcripts):
TGI and Ollama repeat ``"role": "assistant"`` in *every* delta, and Ollama sends
``"content": ""`` beside each ``reasoning`` delta. A delta may therefore carry a
``role`` beside its text and empty strings in the other text fields. The role
is part of the merge key (a chunk with a role never merges with one without),
a role with no text (``{"role": "assistant", "content": ""}``) is the role
chunk and stays a barrier, and the empty fields stay empty, so the merge is
still exact. Without this, every chunk
of those engines was a barrier and a slow reader of them got no coalescing.
A merged chunk is the first chunk's JSON with the escaped texts concatenated
inside its string (so escapes, even a surrogate pair split across chunks, join
exactly). Chunks are looked at only when a second event queues behind the
first, and then by a regex plus a once-per-shape JSON check, not a parse per
event (see ``PendingBuffer._slot``).

Under ``drop``, a new event of one of the ``droppable`` SSE ``event:`` types
replaces the queued event of the same type (the newest state wins), and the
event that replaced others is preceded on the wire by
``event: tokenwire.dropped`` / ``data: {"dropped": N}``, so a reader learns how
many it missed. Answer text is never dropped: unnamed events, and events the
caller marks as not droppable (terminal marker, errors), are never replaced.

``pending_bytes`` is the buffer's size as it would be written; merged text is
counted by its escaped length, which is exact when the chunk's own JSON is the
template (the usual case) and an estimate when it had to be re-serialised.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .sse import SSEEvent, encode

# Top-level chunk keys a mergeable chunk may have (besides volatile ones). Their
# values are part of the merge key: chunks that differ in them never merge.
_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "system_fingerprint",
                         "service_tier", "choices", "usage"})
_CHOICE_KEYS = frozenset({"index", "delta", "text", "finish_reason", "logprobs", "stop_reason",
                          "matched_stop"})
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
_TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
# Keys whose values never block a merge: the choices (compared on their own)
# and ``created``, a timestamp that Ollama stamps on every chunk afresh.
_ALWAYS_VOLATILE = frozenset({"choices", "created"})


def _text_slot(data: str, volatile: frozenset[str]) -> tuple[
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
    if not isinstance(chunk, dict) or not chunk.keys() <= _CHUNK_KEYS | volatile:
        return None
    if chunk.get("usage") is not None:
        return None
    # Every top-level value but the choices and the volatile fields must match.
    same = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in chunk.items()
                        if k not in _ALWAYS_VOLATILE and k not in volatile))
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
    if not choice.keys() <= _CHOICE_KEYS:
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
    if not fields or any(k not in _TEXT_FIELDS or not isinstance(delta[k], str) for k in fields):
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
    if any(k != "tool_calls" and (k not in _TEXT_FIELDS or delta[k] != "") for k in fields):
        return None
    calls = delta["tool_calls"]
    if not isinstance(calls, list) or len(calls) != 1 or not isinstance(calls[0], dict):
        return None
    call = calls[0]
    function = call.get("function")
    if (not call.keys() <= _TOOL_CALL_KEYS or call.get("id") is not None
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
_TEXT_VALUE_RE = re.compile(
    r'"(content|reasoning_content|reasoning|text|arguments)"[ \t\r\n]*:[ \t\r\n]*"'
    r'((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')
_SENTINEL = "tokenwire-merge-sentinel-1f2e3d"
_SHAPE_CACHE_LIMIT = 64

# A mergeable chunk, as a template: ``prefix + escaped_text + suffix`` is its JSON
# (``escaped_text`` without the quotes); chunks with equal ``key`` merge.
_Slot = tuple[tuple[object, ...], str, str, str]


def _text_value(data: str) -> re.Match[str] | None:
    """The text value a chunk carries: the first non-empty one the regex
    finds, else the first (an empty field may come first, as in Ollama's
    ``"content":"","reasoning":"..."``)."""
    first: re.Match[str] | None = None
    for match in _TEXT_VALUE_RE.finditer(data):
        if match.group(2):
            return match
        if first is None:
            first = match
    return first


def _dumps(obj: object) -> str:
    """Compact JSON, UTF-8 where it can be; lone surrogates (from ``\\udXXX``
    escapes split across chunks) stay escaped so the bytes are valid UTF-8."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(obj, separators=(",", ":"))
    return text


def _slow_slot(data: str, volatile: frozenset[str]) -> _Slot | None:
    """Classify by parsing; the template is the chunk re-serialised."""
    found = _text_slot(data, volatile)
    if found is None:
        return None
    key, chunk, holder, field = found
    text = holder[field]
    holder[field] = _SENTINEL
    template = _dumps(chunk)
    if template.count(_SENTINEL) != 1:
        return None  # the sentinel occurs in the chunk itself: keep it unmerged
    prefix, _, suffix = template.partition(json.dumps(_SENTINEL))
    return key, prefix + '"', '"' + suffix, _dumps(text)[1:-1]


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


# A JSON scalar: a string, a number, true, false or null.
_JSON_SCALAR = (r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
                r"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")


def _volatile_value_re(volatile: frozenset[str]) -> re.Pattern[str] | None:
    """Finds the scalar values of the volatile fields, so that chunks differing
    only there share one shape in the cache (one JSON check, not one per chunk)."""
    if not volatile:
        return None
    names = "|".join(re.escape(name) for name in sorted(volatile))
    return re.compile(r'("(?:' + names + r')"[ \t\r\n]*:[ \t\r\n]*)(?:' + _JSON_SCALAR + ")")


_ESCAPED_RE = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


def _same_shape(slot: _Slot, event: SSEEvent | None) -> str | None:
    """The escaped text of ``event`` if it is ``slot``'s template with another
    text (so it is valid JSON and merges under the same key), else None."""
    if event is None or event.event is not None or event.retry is not None:
        return None
    data = event.data
    _, prefix, suffix, _ = slot
    if data is None or not (data.startswith(prefix) and data.endswith(suffix)):
        return None
    start, end = len(prefix), len(data) - len(suffix)
    if end < start or _ESCAPED_RE.fullmatch(data, start, end) is None:
        return None
    return data[start:end]


class _Unparsed:
    """Sentinel: the event has not been looked at for merging yet."""


_UNPARSED = _Unparsed()


def _dropped_notice(count: int) -> bytes:
    """What a reader of a ``drop`` stream gets before the event that replaced others."""
    return b'event: tokenwire.dropped\ndata: {"dropped":%d}\n\n' % count


class _Item:
    __slots__ = ("droppable", "dropped_before", "encoded", "event", "events", "parts", "size", "slot")

    def __init__(self, event: SSEEvent | None, encoded: bytes, events: int, droppable: bool) -> None:
        self.event = event
        self.encoded: bytes | None = encoded
        self.size = len(encoded)
        self.events = events
        self.droppable = droppable
        self.dropped_before = 0  # queued events of its type this one replaced
        self.slot: Any = _UNPARSED if event is not None else None
        self.parts: list[str] | None = None

    def to_bytes(self) -> bytes:
        if self.encoded is not None:
            encoded = self.encoded
        else:
            assert self.parts is not None and self.event is not None
            slot: _Slot = self.slot
            data = slot[1] + "".join(self.parts) + slot[2]
            if self.event.id is None and "\n" not in data:
                encoded = b"data: " + data.encode() + b"\n\n"
            else:
                encoded = encode(SSEEvent(data=data, id=self.event.id))
        if self.dropped_before:
            return _dropped_notice(self.dropped_before) + encoded
        return encoded


class PendingBuffer:
    """Bytes and events waiting for the socket; see the module docstring."""

    __slots__ = ("_items", "_last_slot", "_shapes", "_volatile_re", "coalesced_events", "drop",
                 "droppable_types", "dropped_events", "merge", "pending_bytes", "volatile")

    def __init__(self, *, merge: bool, drop: bool, droppable_types: frozenset[str] = frozenset(),
                 volatile: frozenset[str] = frozenset({"obfuscation"})) -> None:
        """``merge``: merge text and tool-call argument deltas; ``drop``: let a new
        event of one of ``droppable_types`` replace the queued one of its type;
        ``volatile``: top-level chunk fields that do not block a merge."""
        self._items: list[_Item] = []
        self._shapes: dict[tuple[str, str], Any] = {}
        self._last_slot: _Slot | None = None
        self.pending_bytes = 0
        self.merge = merge
        self.drop = drop
        self.droppable_types = droppable_types
        self.volatile = volatile
        self._volatile_re = _volatile_value_re(volatile)
        self.coalesced_events = 0
        self.dropped_events = 0

    def __bool__(self) -> bool:
        return bool(self._items)

    def add_bytes(self, data: bytes, events: int = 0) -> None:
        """Queue raw bytes (a heartbeat, a passthrough body, or ``events``
        whole events forwarded as they came); never merged or dropped."""
        if data:
            self._items.append(_Item(None, data, events, False))
            self.pending_bytes += len(data)

    def add_event(self, event: SSEEvent, encoded: bytes | None = None, *,
                  droppable: bool = True) -> None:
        """Queue one event (``encoded``: its wire bytes, computed here if not
        given and only if needed), merging or replacing per the policy."""
        items = self._items
        item: _Item | None = None
        if items and self.merge:
            last = items[-1]
            previous = self._slot(last) if last.event is not None else None
            if previous is not None:
                # Most chunks have the shape of the one before: no _Item, no regex search.
                escaped = _same_shape(previous, event)
                newest = previous
                if escaped is None:
                    if encoded is None:
                        encoded = encode(event)
                    item = _Item(event, encoded, 1, droppable)
                    slot = self._slot(item)  # cached on the item if it is queued instead
                    if slot is not None and slot[0] == previous[0]:
                        escaped, newest = slot[3], slot
                if escaped is not None:
                    self._merge(last, previous, event, escaped, newest)
                    return
        if item is None:
            if encoded is None:
                encoded = encode(event)
            item = _Item(event, encoded, 1, droppable)
        if items and self.drop and droppable and event.event in self.droppable_types:
            for i, queued in enumerate(items):
                if queued.droppable and queued.event is not None and queued.event.event == event.event:
                    del items[i]
                    self.pending_bytes -= queued.size
                    self.dropped_events += 1
                    item.dropped_before = queued.dropped_before + 1
                    item.size += len(_dropped_notice(item.dropped_before))
                    break
        items.append(item)
        self.pending_bytes += item.size

    def _merge(self, last: _Item, previous: _Slot, event: SSEEvent, escaped: str, newest: _Slot) -> None:
        if last.parts is None:
            last.parts = [previous[3]]
            last.encoded = None
        if newest is not previous and (newest[1], newest[2]) != (previous[1], previous[2]):
            # Only volatile fields differ (the key is equal): keep the newest values.
            last.slot = (previous[0], newest[1], newest[2], previous[3])
            grown = (_utf8_len(newest[1]) + _utf8_len(newest[2])
                     - _utf8_len(previous[1]) - _utf8_len(previous[2]))
            last.size += grown
            self.pending_bytes += grown
        last.parts.append(escaped)
        if event.id is not None and last.event is not None:
            # The merged event stands for the newest one: keep its id.
            last.event = SSEEvent(data=last.event.data, id=event.id)
        added = _utf8_len(escaped)
        last.size += added
        self.pending_bytes += added
        self.coalesced_events += 1

    def _slot(self, item: _Item) -> _Slot | None:
        """The item's merge template, or None if it is a barrier (cached on the item).

        Fast path: find the text value with a regex and validate the chunk's
        *shape* (the JSON around that value) once per shape, by parsing it with
        a sentinel in place of the text; a stream's chunks share a few shapes,
        so a client that lags costs no JSON parsing per event.
        """
        if item.slot is not _UNPARSED:
            cached: _Slot | None = item.slot
            return cached
        event = item.event
        assert event is not None
        data = event.data
        slot: _Slot | None = None
        last = self._last_slot
        if last is not None:
            escaped = _same_shape(last, event)
            if escaped is not None:
                slot = (last[0], last[1], last[2], escaped)
                item.slot = slot
                return slot
        if event.event is None and event.retry is None and data and data[0] == "{":
            match = _text_value(data)
            if match is None:
                slot = _slow_slot(data, self.volatile)
            else:
                start, end = match.span(2)
                prefix = data[:start]
                suffix = data[end:]
                shapes = self._shapes
                volatile_re = self._volatile_re
                shape = (prefix, suffix) if volatile_re is None else (
                    volatile_re.sub(r"\g<1>0", prefix), volatile_re.sub(r"\g<1>0", suffix))
                key = shapes.get(shape, _UNPARSED)
                if key is _UNPARSED:
                    found = _text_slot(prefix + _SENTINEL + suffix, self.volatile)
                    if found is None:
                        key = None
                    elif found[2][found[3]] == _SENTINEL:
                        key = found[0]
                    # else: the regex did not find the value JSON reads (duplicate
                    # keys...): key stays _UNPARSED and the slow path decides.
                    if len(shapes) >= _SHAPE_CACHE_LIMIT:
                        shapes.clear()
                    shapes[shape] = key
                if key is _UNPARSED:
                    slot = _slow_slot(data, self.volatile)
                elif key is not None:
                    slot = (key, prefix, suffix, match.group(2))
        item.slot = slot
        if slot is not None:
            self._last_slot = slot
        return slot

    def take(self) -> tuple[bytes, int]:
        """Everything pending as one write, and how many events it holds."""
        items = self._items
        if not items:
            return b"", 0
        if len(items) == 1:
            item = items[0]
            data, events = item.to_bytes(), item.events
        else:
            data = b"".join(item.to_bytes() for item in items)
            events = sum(item.events for item in items)
        self._items = []
        self.pending_bytes = 0
        return data, events

    def clear(self) -> None:
        """Forget everything pending (the client is gone)."""
        self._items = []
        self.pending_bytes = 0
