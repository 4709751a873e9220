"""The pending buffer: what waits for a slow socket, and how it shrinks.

Theory of operation
-------------------
While the downstream socket cannot take bytes (paused, or a write still
outstanding), events queue here instead of in the kernel. When it can, the
whole buffer leaves in one write.

What a chunk is — where its text is, which chunks have the same shape, how
their JSON merges — is ``chunks.py``'s; this module decides when to merge.
Under every policy, consecutive OpenAI chunks that carry nothing but text
(``delta.content``, ``delta.reasoning_content``, vLLM's and Ollama's newer
``delta.reasoning``, or a completion's ``text``) for the same id and choice are
merged into one chunk whose text is the exact concatenation. So are the
argument fragments of one tool call (``delta.tool_calls[0].function.arguments``
with no ``id`` or ``name``: the fragments after the call's first chunk), keyed
by the call's index, so a client accumulates exactly the same call. Anything
else — a role-only chunk, a tool call's first chunk, a finish reason, a
usage-only chunk, logprobs, unknown keys with values, non-JSON, comments — is
a barrier: kept as its own event, never merged across. Named events merge only
in a dialect that names which (``dialects/``: Responses and Anthropic deltas).

Top-level chunk fields other than ``choices``, ``created`` (a timestamp
that Ollama renews on every chunk) and ``usage`` (cumulative where an engine
sends it in every chunk: the merged chunk keeps the newest, the usage as of its
last text; chunks merge only if both or neither carry it) must be equal for chunks to merge, except
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

from typing import Any, Final

from .chunks import SENTINEL, Slot, same_shape, slot_by_parsing, volatile_value_re
from .dialects.base import Dialect
from .dialects.chat import ChatDialect
from .sse import SSEEvent, encode


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _same_shape(slot: Slot, name: str | None, event: SSEEvent | None) -> str | None:
    """The escaped text of ``event`` if it is an event named ``name`` with ``slot``'s shape."""
    if event is None or event.event != name or event.retry is not None or event.data is None:
        return None
    return same_shape(slot, event.data)


_SHAPE_CACHE_LIMIT: Final = 64


class _Unparsed:
    """Sentinel: the event has not been looked at for merging yet."""


_UNPARSED: Final = _Unparsed()


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
            slot: Slot = self.slot
            data = slot[1] + "".join(self.parts) + slot[2]
            if self.event.id is None and self.event.event is None and "\n" not in data:
                encoded = b"data: " + data.encode() + b"\n\n"
            else:
                encoded = encode(SSEEvent(data=data, event=self.event.event, id=self.event.id))
        if self.dropped_before:
            return _dropped_notice(self.dropped_before) + encoded
        return encoded


class PendingBuffer:
    """Bytes and events waiting for the socket; see the module docstring."""

    __slots__ = ("_dialect", "_items", "_keep_first", "_last_slot", "_names", "_operator_volatile",
                 "_shapes", "_volatile_re", "coalesced_events", "drop", "droppable_types",
                 "dropped_events", "merge", "pending_bytes", "volatile")

    def __init__(self, *, merge: bool, drop: bool, droppable_types: frozenset[str] = frozenset(),
                 volatile: frozenset[str] = frozenset({"obfuscation"}),
                 dialect: Dialect | None = None) -> None:
        """``merge``: merge text and tool-call argument deltas; ``drop``: let a new
        event of one of ``droppable_types`` replace the queued one of its type;
        ``volatile``: top-level chunk fields that do not block a merge;
        ``dialect``: where the text is and which events merge (default: Chat Completions)."""
        self._items: list[_Item] = []
        self._shapes: dict[tuple[str, str], Any] = {}
        self._last_slot: Slot | None = None
        self.pending_bytes = 0
        self.merge = merge
        self.drop = drop
        self.droppable_types = droppable_types
        self._operator_volatile = volatile
        self.volatile = volatile
        self._volatile_re = volatile_value_re(volatile)
        self._dialect: Dialect = ChatDialect() if dialect is None else dialect
        self._names: frozenset[str | None] = frozenset({None})
        self._keep_first = False
        self.use_dialect(self._dialect)
        self.coalesced_events = 0
        self.dropped_events = 0

    def use_dialect(self, dialect: Dialect) -> None:
        """Merge by ``dialect``'s rules from now on (before any event is queued)."""
        self._dialect = dialect
        self.merge = self.merge and dialect.merges
        self._names = dialect.merge_names
        self._keep_first = dialect.keep_first_volatile
        self.volatile = self._operator_volatile | dialect.volatile
        self._volatile_re = volatile_value_re(self.volatile)
        self._shapes = {}
        self._last_slot = None

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
            if previous is not None and last.event is not None:
                # Most chunks have the shape of the one before: no _Item, no regex search.
                escaped = _same_shape(previous, last.event.event, event)
                newest = previous
                if escaped is None:
                    if encoded is None:
                        encoded = encode(event)
                    item = _Item(event, encoded, 1, droppable)
                    slot = self._slot(item)  # cached on the item if it is queued instead
                    if (slot is not None and slot[0] == previous[0]
                            and event.event == last.event.event):
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

    def _merge(self, last: _Item, previous: Slot, event: SSEEvent, escaped: str, newest: Slot) -> None:
        if last.parts is None:
            last.parts = [previous[3]]
            last.encoded = None
        if (newest is not previous and not self._keep_first
                and (newest[1], newest[2]) != (previous[1], previous[2])):
            # Only volatile fields differ (the key is equal): keep the newest values.
            last.slot = (previous[0], newest[1], newest[2], previous[3])
            grown = (_utf8_len(newest[1]) + _utf8_len(newest[2])
                     - _utf8_len(previous[1]) - _utf8_len(previous[2]))
            last.size += grown
            self.pending_bytes += grown
        last.parts.append(escaped)
        if event.id is not None and last.event is not None:
            # The merged event stands for the newest one: keep its id.
            last.event = SSEEvent(data=last.event.data, event=last.event.event, id=event.id)
        added = _utf8_len(escaped)
        last.size += added
        self.pending_bytes += added
        self.coalesced_events += 1

    def _slot(self, item: _Item) -> Slot | None:
        """The item's merge template, or None if it is a barrier (cached on the item).

        Fast path: find the text value with a regex and validate the chunk's
        *shape* (the JSON around that value) once per shape, by parsing it with
        a sentinel in place of the text; a stream's chunks share a few shapes,
        so a client that lags costs no JSON parsing per event.
        """
        if item.slot is not _UNPARSED:
            cached: Slot | None = item.slot
            return cached
        event = item.event
        assert event is not None
        data = event.data
        slot: Slot | None = None
        last = self._last_slot
        if last is not None:
            escaped = _same_shape(last, event.event, event)
            if escaped is not None:
                slot = (last[0], last[1], last[2], escaped)
                item.slot = slot
                return slot
        dialect = self._dialect
        if event.event in self._names and event.retry is None and data and data[0] == "{":
            match = dialect.text_value(data)
            if match is None:
                slot = slot_by_parsing(dialect.text_slot(data, self.volatile))
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
                    found = dialect.text_slot(prefix + SENTINEL + suffix, self.volatile)
                    if found is None:
                        key = None
                    elif found[2][found[3]] == SENTINEL:
                        key = found[0]
                    # else: the regex did not find the value JSON reads (duplicate
                    # keys...): key stays _UNPARSED and the slow path decides.
                    if len(shapes) >= _SHAPE_CACHE_LIMIT:
                        shapes.clear()
                    shapes[shape] = key
                if key is _UNPARSED:
                    slot = slot_by_parsing(dialect.text_slot(data, self.volatile))
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
