"""What a stream dialect is: the rules the core applies to the events of one API.

Theory of operation
-------------------
The wire core's rules — when a stream is finished, what an upstream error
event is, where the text is and which events merge for a slow reader, what
carries a token, where usage is, what tokenwire's own in-band error looks
like — depend on the API the stream speaks. A :class:`Dialect` answers those
questions for one API; the core asks it and decides nothing from an event's
content itself. The dialects (``chat.py``, ``responses.py``, ``anthropic.py``)
override this class; this class itself is the **generic** dialect, for a
stream of a shape tokenwire does not know: every event passes exactly as it
came, nothing merges, nothing is an error, and a clean end of body is a
complete stream unless the operator named a terminal marker for it.

Which dialect a stream speaks is decided per route (``routes.py``) and
confirmed by the first event (:meth:`Dialect.confirms`): a stream whose first
event does not fit its route's dialect is generic from then on, so a shape
tokenwire does not understand is never broken.

A dialect object is shared by every stream of its route, except where it
keeps state of its own per stream (the Responses dialect's numbering):
:meth:`Dialect.for_stream` hands each stream the object it may use.
"""

from __future__ import annotations

import re
from typing import Any, Final

from ..chunks import carries_token as _chat_carries_token
from ..chunks import chunk_object
from ..chunks import count_tokens as _chat_count_tokens
from ..errors import WireError
from ..sse import SSEEvent

GENERIC: Final = "generic"
"""The name of the generic dialect: a stream of a shape tokenwire does not know."""
CONTENT: Final = 0
"""An event of the answer: forwarded, and activity of the upstream."""
TERMINAL: Final = 1
"""The event that ends a complete stream (``[DONE]``, ``response.completed``, ``message_stop``)."""
FAILED: Final = 2
"""A terminal event that reports the engine's failure (``response.failed``): forwarded,
the body ends as a finished one, and the record says the upstream failed."""
ERROR: Final = 3
"""An upstream error event: forwarded in the dialect's shape, and the body is cut."""
KEEPALIVE: Final = 4
"""An event that only keeps the connection alive (Anthropic's ``ping``): forwarded, but
not activity: the content-inactivity timeout runs on."""

Slot = tuple[tuple[object, ...], str, str, str]
"""A mergeable event as a template (``chunks.Slot``): (merge key, prefix, suffix, escaped text)."""
Found = tuple[tuple[object, ...], dict[str, Any], dict[str, Any], str]
"""What :meth:`Dialect.text_slot` finds: (merge key, the parsed object, the holder, the text field)."""


def parsed_object(data: str | None) -> dict[str, Any] | None:
    """An event's data parsed, when it is a JSON object (else None, without parsing
    data that cannot be one)."""
    return chunk_object(data) if data and data.startswith("{") else None


def type_of(event: SSEEvent) -> str | None:
    """A named-event API's event type: its SSE name, else its data's ``type``."""
    if event.event is not None:
        return event.event
    obj = parsed_object(event.data)
    kind = obj.get("type") if obj is not None else None
    return kind if isinstance(kind, str) else None


class Dialect:
    """The generic dialect, and the base of the others; see the module docstring.

    ``marker``: the ``data`` that ends a complete stream (None: a clean end of
    body is complete)."""

    name: str = GENERIC
    merges: bool = False
    """Text deltas of consecutive events merge for a slow reader."""
    first_error_is_status: bool = False
    """An upstream error as the first event becomes the response's HTTP status
    (Chat Completions); otherwise it is forwarded in-band as the client would
    have read it directly (the Responses and Anthropic SDKs raise on it there)."""
    error_is_terminal: bool = False
    """The API's own error event is its terminal failure signal (its SDKs read it
    so, and its servers end the body after it): forwarded, then the body ends as a
    finished one would, recorded as the upstream's failure. Otherwise the body is cut."""
    renumbers: bool = False
    """Events carry a contiguous ``sequence_number`` that merging must keep contiguous."""
    keep_first_volatile: bool = False
    """A merged event keeps the first event's volatile values (its sequence number), not the newest."""
    merge_names: frozenset[str | None] = frozenset({None})
    """The SSE ``event:`` names whose events may merge (None: an unnamed event)."""
    volatile: frozenset[str] = frozenset()
    """Fields of a mergeable event that never block a merge (besides the operator's)."""
    terminal_event: str | None = None
    """The named event that ends a complete stream of an API of named events
    (``message_stop``, ``response.completed``); None: the dialect ends with ``marker``."""

    def __init__(self, marker: str | None = None) -> None:
        self.marker = marker

    @property
    def terminal_required(self) -> bool:
        """A stream that ends without its terminal event was cut short."""
        return self.marker is not None or self.terminal_event is not None

    @property
    def terminal_name(self) -> str:
        """The terminal event, as an error message names it."""
        return self.terminal_event or self.marker or ""

    @property
    def fast_path(self) -> bool:
        """A read of nothing but plain ``data:`` events may skip the parser (the
        keeps-up path): they hold no rule of this dialect but its marker. Not for
        an API of named events, whose every rule is in the events' names and types."""
        return self.terminal_event is None

    def for_stream(self) -> Dialect:
        """The object one stream uses (self, unless the dialect keeps per-stream state)."""
        return self

    def confirms(self, event: SSEEvent) -> bool:
        """Whether the stream's first event fits this dialect."""
        return True

    def classify(self, event: SSEEvent) -> int:
        """What an event (not a comment) is: CONTENT, TERMINAL, FAILED, ERROR or KEEPALIVE."""
        marker = self.marker
        if marker is not None and event.data == marker:
            return TERMINAL
        return CONTENT

    def error_payload(self, event: SSEEvent) -> dict[str, Any]:
        """The parsed error object of an ERROR event (``{}`` if it does not parse)."""
        return {}

    def forwarded_error(self, event: SSEEvent, payload: dict[str, Any]) -> SSEEvent:
        """The upstream error event as the client gets it (by default as it came)."""
        return event

    def own_error_event(self, error: WireError, merged: int) -> SSEEvent:
        """tokenwire's own in-band error (upstream died, a timeout, a slow client cut)
        in this dialect's shape; ``merged``: events merged away so far."""
        return SSEEvent(data=error.sse_data())

    def usage(self, event: SSEEvent, current: dict[str, Any] | None) -> dict[str, Any] | None:
        """The usage block after this event (``current`` if it carries none)."""
        return current

    def count_tokens(self, data: str) -> int:
        """The token pieces in a parsed event's data as the engine sent it, before
        any merge: the record's count where no usage came."""
        return _chat_count_tokens(data)

    def carries_token(self, data: bytes) -> bool:
        """Whether an event's data (or whole ``data:`` frames) holds a token, for the
        time to first token: any data but an empty one or a JSON shape without text."""
        return _chat_carries_token(data)

    def ask_usage(self, body: bytes) -> bytes | None:
        """The request body asking the engine for usage in the stream, where the API
        has a way to ask and the client did not; None: the body stays as it is."""
        return None

    def is_usage_only(self, event: SSEEvent) -> bool:
        """The event carries nothing but usage (the chunk :meth:`ask_usage` asked for)."""
        return False

    def stream_alias(self, event: SSEEvent) -> str | None:
        """The name the API gives the stream in its first event, by which a client
        may resume it (a Responses ``response.id``); None where it has none."""
        return None

    # ---------------------------------------------------------------- merging

    def text_value(self, data: str) -> re.Match[str] | None:
        """The escaped text of a mergeable event found without parsing (group 2)."""
        return None

    def text_slot(self, data: str, volatile: frozenset[str]) -> Found | None:
        """If ``data`` is a mergeable event: its merge key, the parsed object, and
        where in it the text is (``holder[field]``)."""
        return None

    # ---------------------------------------------------------------- numbering

    def renumber(self, event: SSEEvent, merged: int) -> SSEEvent:
        """The event as the client gets it once ``merged`` events before it were
        merged away (only where :attr:`renumbers`)."""
        return event

    def next_sequence(self, merged: int) -> int:
        """The number the next event the client gets carries (only where :attr:`renumbers`)."""
        return 0
