"""The Anthropic Messages dialect (``POST /v1/messages``).

Theory of operation
-------------------
A Messages stream is named events: ``message_start``, then per content block
``content_block_start`` / ``content_block_delta``... / ``content_block_stop``,
then ``message_delta`` (the stop reason, the output usage) and
``message_stop``, which is the end of a complete stream. ``ping`` events may
come at any time: forwarded, but not activity of the engine (an engine that
sends only pings has hung). An ``error`` event (``{"type": "error", "error":
{"type": "overloaded_error", ...}}``) is the engine's failure: forwarded as it
came, even as the first event, since that is what the anthropic SDKs raise
their typed errors from; the body is then cut. tokenwire's own in-band errors
are written in the same shape, with tokenwire's code beside the message.

For a slow reader, consecutive ``content_block_delta`` events of one block
(the same ``index``) and one delta type merge: ``text_delta`` by its
``text``, ``input_json_delta`` by its ``partial_json``, ``thinking_delta`` by
its ``thinking``; the client accumulates the same block. Every other event
(``signature_delta`` included) is a barrier.

Usage is ``message_start.message.usage`` updated by each ``message_delta.usage``.
"""

from __future__ import annotations

import re
from typing import Any, Final

from ..chunks import dumps
from ..errors import ClientError, ErrorCode, WireError
from ..sse import SSEEvent
from .base import CONTENT, ERROR, KEEPALIVE, TERMINAL, Dialect, Found, parsed_object, type_of

EVENTS: Final = frozenset({"message_start", "content_block_start", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "ping", "error"})
DELTA_FIELDS: Final = {"text_delta": "text", "input_json_delta": "partial_json",
                       "thinking_delta": "thinking"}
"""A mergeable delta's type and the field that carries its text."""

_TEXT_VALUE_RE: Final = re.compile(
    r'"(text|partial_json|thinking)"[ \t\r\n]*:[ \t\r\n]*"'
    r'((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')
# A non-empty text, JSON fragment or thought, or the start of a tool call.
_TOKEN_RE: Final = re.compile(rb'"(?:text|partial_json|thinking)" ?: ?"[^"]|"type" ?: ?"tool_use"')
# A delta's piece (the count where no usage came; a block's start carries none).
_PIECE_RE: Final = re.compile(r'"(?:text|partial_json|thinking)" ?: ?"[^"]')

_OVERLOADED: Final = frozenset({ErrorCode.UPSTREAM_UNAVAILABLE, ErrorCode.SHUTDOWN})


def error_type(error: WireError) -> str:
    """The Anthropic error type of one of tokenwire's errors."""
    if isinstance(error, ClientError):
        return "invalid_request_error"
    if error.code in _OVERLOADED:
        return "overloaded_error"
    if error.code is ErrorCode.UPSTREAM_TIMEOUT:
        return "timeout_error"
    return "api_error"


class AnthropicDialect(Dialect):
    """Anthropic Messages; see the module docstring."""

    name = "anthropic.messages"
    merges = True
    error_is_terminal = True
    merge_names = frozenset({"content_block_delta"})
    terminal_event: str | None = "message_stop"

    def __init__(self) -> None:
        super().__init__(None)

    def confirms(self, event: SSEEvent) -> bool:
        return type_of(event) in EVENTS

    def classify(self, event: SSEEvent) -> int:
        kind = type_of(event)
        if kind == "message_stop":
            return TERMINAL
        if kind == "ping":
            return KEEPALIVE
        if kind == "error":
            return ERROR
        return CONTENT

    def error_payload(self, event: SSEEvent) -> dict[str, Any]:
        return parsed_object(event.data) or {}

    def own_error_event(self, error: WireError, merged: int) -> SSEEvent:
        body = {"type": "error", "error": {"type": error_type(error), "message": error.message,
                                           "tokenwire": error.tokenwire_fields()}}
        return SSEEvent(data=dumps(body), event="error")

    def usage(self, event: SSEEvent, current: dict[str, Any] | None) -> dict[str, Any] | None:
        data = event.data
        if data is None or '"usage"' not in data:
            return current
        obj = parsed_object(data)
        if obj is None:
            return current
        holder = obj.get("message") if obj.get("type") == "message_start" else obj
        found = holder.get("usage") if isinstance(holder, dict) else None
        if not isinstance(found, dict):
            return current
        # message_delta's counts are cumulative: they replace message_start's.
        return {**(current or {}), **found}

    def count_tokens(self, data: str) -> int:
        return len(_PIECE_RE.findall(data))

    def carries_token(self, data: bytes) -> bool:
        return _TOKEN_RE.search(data) is not None

    def text_value(self, data: str) -> re.Match[str] | None:
        return _TEXT_VALUE_RE.search(data)

    def text_slot(self, data: str, volatile: frozenset[str]) -> Found | None:
        obj = parsed_object(data)
        if (obj is None or obj.get("type") != "content_block_delta"
                or obj.keys() != {"type", "index", "delta"}):
            return None
        delta = obj["delta"]
        if not isinstance(delta, dict):
            return None
        field = DELTA_FIELDS.get(delta.get("type"))  # type: ignore[arg-type]
        if field is None or delta.keys() != {"type", field} or not isinstance(delta[field], str):
            return None
        index = obj["index"]
        if not isinstance(index, int) or isinstance(index, bool):
            return None
        return ("content_block_delta", index, delta["type"]), obj, delta, field
