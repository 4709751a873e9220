"""The pending buffer: what waits for a slow socket, and how it shrinks.

Theory of operation
-------------------
While the downstream socket cannot take bytes (paused, or a write still
outstanding), events queue here instead of in the kernel. When it can, the
whole buffer leaves in one write.

Under the ``coalesce`` and ``block`` policies, consecutive OpenAI chunks that
carry nothing but text (``delta.content``, ``delta.reasoning_content`` or a
completion's ``text``) for the same id and choice are merged into one chunk
whose text is the exact concatenation. Anything else — a role, tool calls, a
finish reason, usage, logprobs, unknown keys with values, non-JSON, named
events, comments — is a barrier: kept as its own event, never merged across.
JSON is parsed only when a second event queues behind the first, so a client
that keeps up costs no parsing at all.

Under ``drop``, a new event replaces the queued event of the same type (the
newest state wins); events the caller marks as not droppable (terminal marker,
errors) are never replaced.

``pending_bytes`` is the buffer's size as it would be written; merged text is
counted by its JSON-escaped length, so the figure the cap is checked against
never under-counts by more than the separators a re-serialised chunk saves.
"""

from __future__ import annotations

import json
from typing import Any

from .sse import SSEEvent

# Top-level chunk keys that may differ or repeat between merged chunks.
_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "system_fingerprint",
                         "service_tier", "choices", "usage", "obfuscation"})
_CHOICE_KEYS = frozenset({"index", "delta", "text", "finish_reason", "logprobs", "stop_reason",
                          "matched_stop"})
_TEXT_FIELDS = ("content", "reasoning_content")


def _text_slot(data: str) -> tuple[tuple[object, ...], dict[str, Any], dict[str, Any], str] | None:
    """If ``data`` is a text-only OpenAI chunk: (merge key, chunk, holder, field).

    ``holder[field]`` is the text; the key says what it may merge with.
    """
    if not data.startswith("{"):
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or not chunk.keys() <= _CHUNK_KEYS:
        return None
    if chunk.get("usage") is not None:
        return None
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
        return (chunk.get("id"), choice.get("index"), "text"), chunk, choice, "text"
    if not isinstance(delta, dict) or "text" in choice:
        return None
    fields = [k for k, v in delta.items() if v is not None]
    if len(fields) != 1 or fields[0] not in _TEXT_FIELDS or not isinstance(delta[fields[0]], str):
        return None
    field = fields[0]
    return (chunk.get("id"), choice.get("index"), field), chunk, delta, field


def _escaped_len(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


class _Unparsed:
    """Sentinel: the event has not been looked at for merging yet."""


_UNPARSED = _Unparsed()


class _Item:
    __slots__ = ("droppable", "encoded", "event", "events", "parts", "size", "slot")

    def __init__(self, event: SSEEvent | None, encoded: bytes, events: int, droppable: bool) -> None:
        self.event = event
        self.encoded: bytes | None = encoded
        self.size = len(encoded)
        self.events = events
        self.droppable = droppable
        self.slot: Any = _UNPARSED if event is not None else None
        self.parts: list[str] | None = None

    def merge_slot(self) -> Any:
        if self.slot is _UNPARSED:
            event = self.event
            assert event is not None
            mergeable = event.event is None and event.retry is None and event.data is not None
            self.slot = _text_slot(event.data) if mergeable and event.data else None
        return self.slot

    def to_bytes(self) -> bytes:
        if self.encoded is not None:
            return self.encoded
        assert self.parts is not None and self.event is not None
        _, chunk, holder, field = self.slot
        holder[field] = "".join(self.parts)
        data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        encoded = b"data: " + data.encode() + b"\n"
        if self.event.id is not None:
            encoded += f"id: {self.event.id}\n".encode()
        return encoded + b"\n"


class PendingBuffer:
    """Bytes and events waiting for the socket; see the module docstring."""

    __slots__ = ("_items", "coalesced_events", "drop", "dropped_events", "merge", "pending_bytes")

    def __init__(self, *, merge: bool, drop: bool) -> None:
        self._items: list[_Item] = []
        self.pending_bytes = 0
        self.merge = merge
        self.drop = drop
        self.coalesced_events = 0
        self.dropped_events = 0

    def __bool__(self) -> bool:
        return bool(self._items)

    def add_bytes(self, data: bytes) -> None:
        """Queue raw bytes (a heartbeat, a passthrough body); never merged."""
        if data:
            self._items.append(_Item(None, data, 0, False))
            self.pending_bytes += len(data)

    def add_event(self, event: SSEEvent, encoded: bytes, *, droppable: bool = True) -> None:
        """Queue one encoded event, merging or replacing per the policy."""
        items = self._items
        item = _Item(event, encoded, 1, droppable)
        if items and self.merge and self._try_merge(items[-1], item):
            return
        if items and self.drop and droppable:
            for i, queued in enumerate(items):
                if queued.droppable and queued.event is not None and queued.event.event == event.event:
                    del items[i]
                    self.pending_bytes -= queued.size
                    self.dropped_events += 1
                    break
        items.append(item)
        self.pending_bytes += len(encoded)

    def _try_merge(self, last: _Item, item: _Item) -> bool:
        if last.event is None or last.merge_slot() is None:
            return False
        slot = item.merge_slot()  # cached on the item if it is queued instead
        previous = last.slot
        if slot is None or slot[0] != previous[0]:
            return False
        text: str = slot[2][slot[3]]
        if last.parts is None:
            last.parts = [previous[2][previous[3]]]
            last.encoded = None
        last.parts.append(text)
        new_id = item.event.id if item.event is not None else None
        if new_id is not None and last.event is not None:
            # The merged event stands for the newest one: keep its id.
            last.event = SSEEvent(data=last.event.data, id=new_id)
        added = _escaped_len(text)
        last.size += added
        self.pending_bytes += added
        self.coalesced_events += 1
        return True

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
