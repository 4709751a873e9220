"""The OpenAI Chat Completions and Completions dialects.

Theory of operation
-------------------
Both speak unnamed ``data:`` events of OpenAI chunks and end with
``data: [DONE]``; what is inside a chunk (where the text is, which chunks
merge, error objects, usage) is ``chunks.py``'s, shared with the tools. An
engine's error object is ``{"error": ...}`` without ``choices``; as the first
event it is the engine refusing the request, and the response becomes that
error with the status it carries (``first_error_is_status``). tokenwire's own
in-band error is the same shape (``WireError.sse_data``), which the OpenAI
SDKs raise as ``APIError``.

The route says which of the two a stream is; the rules are the same, so one
class serves both under two names.
"""

from __future__ import annotations

import re
from typing import Any, Final

from ..chunks import (
    chunk_object,
    dumps,
    error_object,
    text_slot,
    text_value,
    usage_of,
)
from ..errors import UpstreamErrorEvent
from ..sse import SSEEvent
from .base import CONTENT, ERROR, TERMINAL, Dialect, Found

DONE: Final = "[DONE]"
_ASK_USAGE: Final = b',"stream_options":{"include_usage":true}'
"""What a streaming request without ``stream_options`` gets before its closing brace."""


class ChatDialect(Dialect):
    """Chat Completions (``name="chat.completions"``) or Completions (``"completions"``)."""

    merges = True
    first_error_is_status = True

    def __init__(self, marker: str | None = DONE, name: str = "chat.completions") -> None:
        super().__init__(marker)
        self.name = name

    def confirms(self, event: SSEEvent) -> bool:
        # Unnamed events of JSON objects (or the marker): an OpenAI stream.
        data = event.data
        return (event.event is None and data is not None
                and (data.startswith("{") or data == self.marker))

    def classify(self, event: SSEEvent) -> int:
        data = event.data
        if data is None:
            return CONTENT
        if '"error"' in data and error_object(data) is not None:
            return ERROR
        if data == self.marker:
            return TERMINAL
        return CONTENT

    def error_payload(self, event: SSEEvent) -> dict[str, Any]:
        return error_object(event.data or "") or {}

    def forwarded_error(self, event: SSEEvent, payload: dict[str, Any]) -> SSEEvent:
        # The engine's object, field for field, with tokenwire's code beside it.
        return SSEEvent(data=UpstreamErrorEvent(payload).sse_data())

    def usage(self, event: SSEEvent, current: dict[str, Any] | None) -> dict[str, Any] | None:
        data = event.data
        if data is None or '"usage"' not in data:
            return current
        found = usage_of(data)
        return current if found is None else found

    def ask_usage(self, body: bytes) -> bytes | None:
        # A client that said anything about include_usage (true or false) is heard.
        if body.find(b'"stream"') == -1:
            return None
        obj = chunk_object(body.decode("utf-8", "replace"))
        if obj is None or obj.get("stream") is not True:
            return None
        if "stream_options" not in obj:
            # Spliced in before the object's closing brace: the client's bytes stay
            # as they came, and the engine reads the same object a dump would give
            # it (the dump was ~34 k instructions a stream, docs/perf/stream-cost.md).
            end = len(body.rstrip(b" \t\r\n")) - 1
            return body[:end] + _ASK_USAGE + body[end:]
        options = obj.get("stream_options")
        if options is None:
            options = {}
        elif not isinstance(options, dict) or "include_usage" in options:
            return None
        obj["stream_options"] = {**options, "include_usage": True}
        return dumps(obj).encode()

    def is_usage_only(self, event: SSEEvent) -> bool:
        data = event.data
        if data is None or '"usage"' not in data:
            return False
        obj = chunk_object(data)
        return obj is not None and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)

    def text_value(self, data: str) -> re.Match[str] | None:
        return text_value(data)

    def text_slot(self, data: str, volatile: frozenset[str]) -> Found | None:
        return text_slot(data, volatile)
