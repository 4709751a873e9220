"""Server-Sent Events: a WHATWG-conformant incremental parser and its inverse.

Theory of operation
-------------------
:class:`SSEParser` takes bytes as they arrive (``feed``) and returns the events
completed by them; ``close()`` is EOF. It follows the EventSource "interpret
an event stream" algorithm:

* line ends are CRLF, LF or CR, and a CRLF may be split across two feeds (a
  feed that ends in CR ends the line; a LF at the start of the next is dropped);
* one leading UTF-8 BOM is stripped; bytes are decoded as UTF-8 with
  replacement, line by line, so a multi-byte character split across feeds is
  never broken;
* ``data`` lines are joined with ``\\n``; ``event`` sets the type; ``id`` with a
  NUL is ignored; ``retry`` is taken only if it is all ASCII digits; a field
  without a colon has an empty value; one space after the colon is removed;
  unknown fields are ignored — except ``error``, llama.cpp server's way of
  reporting a failure mid-stream (``error: {json}`` then ``data: [DONE]``):
  ignoring it would make a failed answer look complete, so its value becomes
  the data ``{"error": value}``, which the wire core maps like any upstream
  error event;
* an empty line dispatches the event; an event without data is not dispatched
  unless it carried ``id`` or ``retry`` (a proxy must not swallow those);
* comment lines are surfaced as their own events (``comment`` set), so a proxy
  can count, forward or replace them;
* at EOF an unterminated last event is discarded (``discarded_bytes`` tells how
  much), which is how a truncated stream is told from a finished one.

Unlike a browser, ``SSEEvent.id`` is the id field *of that event block* (None if
it had none), not the sticky "last event ID", so re-encoding writes back exactly
what came in.

Memory is bounded: a line longer than ``max_line_bytes`` or an event larger than
``max_event_bytes`` raises :class:`~tokenwire.middleware.core.errors.SSEProtocolError`
before it is buffered further.

:func:`encode` is the exact inverse for every event the parser produces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from .errors import SSEProtocolError

_BOM: Final = b"\xef\xbb\xbf"
# A line feed as an int: ``bytes in bytes`` first tries its needle as an int and formats
# the TypeError it gets (~400 instructions) before it searches; an int needle is a memchr.
_LF: Final = 0x0A


@dataclass(frozen=True, slots=True, init=False)
class SSEEvent:
    """One Server-Sent Event, or one comment line (``comment`` set, all else default).

    ``data`` is None for an event that carried only ``id``/``retry``.
    """

    data: str | None = None
    event: str | None = None
    id: str | None = None
    retry: int | None = None
    comment: str | None = None

    def __init__(self, data: str | None = None, event: str | None = None, id: str | None = None,
                 retry: int | None = None, comment: str | None = None) -> None:
        # Written out, not generated: dataclass's __init__ is interpreted, an
        # object.__setattr__ call a field; this one is compiled (a stream's set-up,
        # docs/perf/stream-cost.md). tests/middleware/test_written_inits.py holds it to the fields.
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "event", event)
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "retry", retry)
        object.__setattr__(self, "comment", comment)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.comment is not None:
            if (self.data, self.event, self.id, self.retry) != (None, None, None, None):
                raise ValueError("a comment event carries no other field")
            _check_single_line("comment", self.comment)
            return
        if self.data is not None and "\r" in self.data:
            raise ValueError("data must not contain CR (it is a line end)")
        if self.event is not None:
            _check_single_line("event", self.event)
        if self.id is not None:
            _check_single_line("id", self.id)
            if "\0" in self.id:
                raise ValueError("id must not contain NUL")
        if self.retry is not None and self.retry < 0:
            raise ValueError("retry must be >= 0")


def _check_single_line(name: str, value: str) -> None:
    if "\r" in value or "\n" in value:
        raise ValueError(f"{name} must not contain a line end")


def encode(event: SSEEvent) -> bytes:
    """The wire bytes of ``event``, terminated by a blank line."""
    if event.comment is not None:
        return b":" + event.comment.encode() + b"\n\n"
    data = event.data
    if (event.event is None and event.id is None and event.retry is None
            and data is not None and "\n" not in data):
        # The hot path: a plain data event (every OpenAI chunk).
        return b"data: " + data.encode() + b"\n\n"
    parts: list[str] = []
    if event.event is not None:
        parts.append(f"event: {event.event}\n")
    if data is not None:
        for line in data.split("\n"):
            parts.append(f"data: {line}\n")
    if event.id is not None:
        parts.append(f"id: {event.id}\n")
    if event.retry is not None:
        parts.append(f"retry: {event.retry}\n")
    parts.append("\n")
    return "".join(parts).encode()


class SSEParser:
    """Incremental EventSource parser; see the module docstring."""

    __slots__ = (
        "_at_start",
        "_buffer",
        "_closed",
        "_data",
        "_data_bytes",
        "_event",
        "_id",
        "_retry",
        "_skip_lf",
        "discarded_bytes",
        "max_event_bytes",
        "max_line_bytes",
    )

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20) -> None:
        if max_line_bytes <= 0 or max_event_bytes <= 0:
            raise ValueError("size limits must be > 0")
        self.max_line_bytes = max_line_bytes
        self.max_event_bytes = max_event_bytes
        self._buffer = b""
        self._skip_lf = False
        self._at_start = True
        self._data: list[str] = []
        self._data_bytes = 0
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self.discarded_bytes = 0
        """Bytes of an unterminated final event thrown away at EOF."""
        self._closed = False

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Parse ``data``; return the events it completes (possibly none)."""
        if self._closed:
            raise RuntimeError("feed() after close()")
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buffer = self._buffer + data if self._buffer else data
        if self._at_start:
            if len(buffer) < 3 and _BOM.startswith(buffer):
                self._buffer = buffer
                return []
            self._at_start = False
            if buffer.startswith(_BOM):
                buffer = buffer[3:]
        if buffer.find(b"\r") >= 0:  # not ``in``: see chunks.plain_event_count
            # A final CR ends a line; a LF opening the next feed belongs to it.
            # (Checked before replacing: turning it into LF first would make a
            # preceding CR and it one CRLF, losing a line end.)
            self._skip_lf = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        max_line_bytes = self.max_line_bytes
        if len(buffer) > max_line_bytes:
            for line in buffer.split(b"\n"):
                if len(line) > max_line_bytes:
                    raise SSEProtocolError(f"SSE line longer than {max_line_bytes} bytes")
        events: list[SSEEvent] = []
        if not self._data and self._event is None and self._id is None and self._retry is None:
            # The hot path: whole blocks (``data: ...\n\n``) at an event boundary,
            # one check per event; any other block takes the full algorithm.
            blocks = buffer.split(b"\n\n")
            buffer = blocks.pop()
            max_event_bytes = self.max_event_bytes
            for block in blocks:
                if block[:6] == b"data: " and _LF not in block and len(block) < max_event_bytes:
                    events.append(SSEEvent(block[6:].decode("utf-8", "replace")))
                else:
                    for line in block.split(b"\n"):
                        self._line(line, events)
                    self._dispatch(events)
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        # The hot path inlines ``data: `` lines and plain dispatches; every other
        # line goes through ``_line``, which holds the full algorithm.
        for line in lines:
            if line[:6] == b"data: ":
                self._data_bytes += len(line) + 1
                if self._data_bytes > self.max_event_bytes:
                    raise SSEProtocolError(f"SSE event larger than {self.max_event_bytes} bytes")
                self._data.append(line[6:].decode("utf-8", "replace"))
            elif not line and len(self._data) == 1 and self._event is None and self._id is None \
                    and self._retry is None:
                events.append(SSEEvent(self._data[0]))
                self._data = []
                self._data_bytes = 0
            else:
                self._line(line, events)
        return events

    def close(self) -> list[SSEEvent]:
        """EOF: an unterminated last event is discarded, as the spec says."""
        if self._closed:
            return []
        self._closed = True
        pending = len(self._buffer) + self._data_bytes
        if pending or self._event is not None or self._id is not None or self._retry is not None:
            self.discarded_bytes = max(pending, 1)
        self._buffer = b""
        self._reset_event()
        return []

    @property
    def at_boundary(self) -> bool:
        """True between events: nothing buffered, no event half-read, past the
        BOM check and with no CR waiting for its LF."""
        return not (self._buffer or self._data or self._at_start or self._skip_lf
                    or self._event is not None or self._id is not None or self._retry is not None)

    @property
    def in_event(self) -> bool:
        """True while part of an event (or line) is buffered."""
        return bool(self._buffer or self._data or self._event is not None
                    or self._id is not None or self._retry is not None)

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            self._dispatch(events)
            return
        line = raw.decode("utf-8", "replace")
        if line[0] == ":":
            events.append(SSEEvent(comment=line[1:]))
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data_bytes += len(raw) + 1
            if self._data_bytes > self.max_event_bytes:
                raise SSEProtocolError(f"SSE event larger than {self.max_event_bytes} bytes")
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry" and value and value.isascii() and value.isdigit():
            self._retry = int(value)
        elif name == "error":
            self._data_bytes += len(raw) + 12
            if self._data_bytes > self.max_event_bytes:
                raise SSEProtocolError(f"SSE event larger than {self.max_event_bytes} bytes")
            try:
                json.loads(value)
                payload = value
            except ValueError:
                payload = json.dumps(value)  # a bare message: kept as a JSON string
            self._data.append('{"error":' + payload + "}")
        # Any other field name is ignored, as the spec says.

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data:
            data: str | None = "\n".join(self._data)
        elif self._id is not None or self._retry is not None:
            data = None
        else:
            self._reset_event()
            return
        events.append(SSEEvent(data=data, event=self._event, id=self._id, retry=self._retry))
        self._reset_event()

    def _reset_event(self) -> None:
        self._data = []
        self._data_bytes = 0
        self._event = None
        self._id = None
        self._retry = None
