"""The OpenAI Responses dialect (``POST /v1/responses``).

Theory of operation
-------------------
A Responses stream is named events whose data carries the same ``type`` and a
``sequence_number`` counting from 0: ``response.created``,
``response.in_progress``, the output items and their parts with their deltas,
and one terminal event, ``response.completed``, ``response.incomplete`` (a
finished answer the engine stopped, e.g. at ``max_output_tokens``) or
``response.failed`` (the engine failed; forwarded and ended like a finished
body, recorded as the upstream's failure). There is no ``[DONE]``. An
``error`` event is the engine's failure: forwarded as it came (the SDKs read
it there) and the body is cut. tokenwire's own in-band error is an ``error``
event of the documented shape (``code``, ``message``, ``param``,
``sequence_number``) with an OpenAI ``error`` object beside it, on which the
openai SDKs raise ``APIError`` with its message.

For a slow reader, consecutive ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.reasoning_summary_text.delta``,
``response.refusal.delta`` and ``response.function_call_arguments.delta``
events of one part (the same ``item_id``, ``output_index``, ``content_index``
or ``summary_index``) merge by their ``delta``. A merged event keeps the first
event's number, and every event after it is renumbered (:meth:`renumber`), so
the numbers the client reads stay strictly increasing and contiguous. The
replay store keeps the engine's numbers; a reader that resumes gets those.

Usage is ``response.usage`` of the terminal event.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from ..chunks import dumps
from ..errors import WireError
from ..sse import SSEEvent
from .base import CONTENT, ERROR, FAILED, TERMINAL, Dialect, Found, parsed_object, type_of

DELTAS: Final = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                           "response.reasoning_summary_text.delta", "response.refusal.delta",
                           "response.function_call_arguments.delta"})
"""The events whose ``delta`` merges for a slow reader."""
ENDS: Final = {"response.completed": TERMINAL, "response.incomplete": TERMINAL,
               "response.failed": FAILED}
_KEYS: Final = frozenset({"type", "item_id", "output_index", "content_index", "summary_index", "delta",
                          "sequence_number", "logprobs", "obfuscation"})

_SEQUENCE_RE: Final = re.compile(r'"sequence_number"[ \t\r\n]*:[ \t\r\n]*([0-9]+)')
_TEXT_VALUE_RE: Final = re.compile(
    r'"(delta)"[ \t\r\n]*:[ \t\r\n]*"((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')
# A non-empty delta, or a tool call's item.
_TOKEN_RE: Final = re.compile(rb'"delta" ?: ?"[^"]|"type" ?: ?"function_call"')
# A delta's piece (the count where no usage came: an item's events repeat it whole).
_PIECE_RE: Final = re.compile(r'"delta" ?: ?"[^"]')


class ResponsesDialect(Dialect):
    """OpenAI Responses; see the module docstring. One object per stream (its numbering)."""

    name = "responses"
    merges = True
    error_is_terminal = True
    renumbers = True
    keep_first_volatile = True
    merge_names = frozenset({None, *DELTAS})
    volatile = frozenset({"sequence_number", "obfuscation"})
    terminal_event: str | None = "response.completed"

    def __init__(self) -> None:
        super().__init__(None)
        self._last_sequence = -1

    def for_stream(self) -> Dialect:
        return ResponsesDialect()

    def confirms(self, event: SSEEvent) -> bool:
        kind = type_of(event)
        return kind is not None and (kind.startswith("response.") or kind == "error")

    def classify(self, event: SSEEvent) -> int:
        kind = type_of(event)
        if kind == "error":
            return ERROR
        if kind is None:
            return CONTENT
        return ENDS.get(kind, CONTENT)

    def error_payload(self, event: SSEEvent) -> dict[str, Any]:
        return parsed_object(event.data) or {}

    def own_error_event(self, error: WireError, merged: int) -> SSEEvent:
        body = {"type": "error", "code": error.code.value, "message": error.message, "param": None,
                "sequence_number": self.next_sequence(merged), "error": error.to_json()["error"]}
        return SSEEvent(data=dumps(body), event="error")

    def usage(self, event: SSEEvent, current: dict[str, Any] | None) -> dict[str, Any] | None:
        data = event.data
        if data is None or '"usage"' not in data or type_of(event) not in ENDS:
            return current
        obj = parsed_object(data)
        response = obj.get("response") if obj is not None else None
        found = response.get("usage") if isinstance(response, dict) else None
        return found if isinstance(found, dict) else current

    def stream_alias(self, event: SSEEvent) -> str | None:
        if type_of(event) != "response.created":
            return None
        obj = parsed_object(event.data)
        response = obj.get("response") if obj is not None else None
        ident = response.get("id") if isinstance(response, dict) else None
        return ident if isinstance(ident, str) and 0 < len(ident) <= 128 and ident.isprintable() else None

    def count_tokens(self, data: str) -> int:
        return len(_PIECE_RE.findall(data))

    def carries_token(self, data: bytes) -> bool:
        return _TOKEN_RE.search(data) is not None

    # ---------------------------------------------------------------- merging

    def text_value(self, data: str) -> re.Match[str] | None:
        return _TEXT_VALUE_RE.search(data)

    def text_slot(self, data: str, volatile: frozenset[str]) -> Found | None:
        obj = parsed_object(data)
        if obj is None or obj.get("type") not in DELTAS or not obj.keys() <= _KEYS | volatile:
            return None
        if not isinstance(obj.get("delta"), str) or obj.get("logprobs") not in (None, []):
            return None
        same = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in obj.items()
                            if k not in ("delta", "sequence_number", "obfuscation") and k not in volatile))
        return same, obj, obj, "delta"

    # ---------------------------------------------------------------- numbering

    def renumber(self, event: SSEEvent, merged: int) -> SSEEvent:
        data = event.data
        if data is None:
            return event
        match = _SEQUENCE_RE.search(data)
        if match is None:
            return event
        number = int(match.group(1))
        self._last_sequence = number
        if not merged:
            return event
        start, end = match.span(1)
        return SSEEvent(data=f"{data[:start]}{max(number - merged, 0)}{data[end:]}", event=event.event,
                        id=event.id, retry=event.retry)

    def next_sequence(self, merged: int) -> int:
        return max(self._last_sequence + 1 - merged, 0)
