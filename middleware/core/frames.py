"""tokenwire's own frames: named events a client asks for, never sent unasked.

Theory of operation
-------------------
An SDK reads the events of its API and nothing else; an event it does not
know may break it (a decoder that fails on an unknown ``event:`` name, a
JSON parser on data it has no type for). So tokenwire adds events of its own
to a stream only for a client that asked, by a request header:

* ``Tokenwire-Frames: open, done`` (any of ``open``, ``done``, ``summary``);
* ``Tokenwire-Summary: true``, the older spelling of ``summary``;
* the query parameter ``tokenwire_frames=open,done``, for a client that can
  set no header (a browser ``EventSource``): the drivers read it as that
  header (:func:`with_query`) before anything else looks at the request, so
  it is checked, passed on and applied as the header is. The header wins
  where both are given.

``event: tokenwire.open`` is the first event of the response: the stream id
(None without resume), whether it is a resume, the sequence number of the
first event it carries, the slow-client policy and the bytes that may wait for
the reader. ``event: tokenwire.done`` comes just before the stream's last
event (the dialect's terminal event, or tokenwire's in-band error): the
tokens, where the delivery started, the events merged and dropped for a slow
reader, the time the producer was made to wait (``block``) and the end
reason. ``event: tokenwire.summary`` (the figures of vLLM's per-request
metrics) comes before a complete stream's terminal event. None of them is
numbered: they are the response's, not the stream's, and a resume never
replays them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote_to_bytes

from .chunks import dumps
from .errors import ClientError, ErrorCode
from .headers import SUMMARY_HEADER, Header
from .record import EndReason, StreamRecord
from .sse import SSEEvent

if TYPE_CHECKING:
    from .config import WireConfig

FRAMES_HEADER: Final = b"tokenwire-frames"
"""A request header: the comma-separated frames the client asks for."""
QUERY_PARAM: Final = b"tokenwire_frames"
"""The query parameter that stands for :data:`FRAMES_HEADER`."""

OPEN: Final = "open"
DONE: Final = "done"
SUMMARY: Final = "summary"
NAMES: Final = (OPEN, DONE, SUMMARY)
"""The frames a client may ask for."""
_NONE: Final[frozenset[str]] = frozenset()
_NOT_A_LIST: Final = re.compile(rb"[^A-Za-z, \t]")
"""A byte no list of frame names holds: a query's value is percent-decoded, so
it could carry a line break into the header it becomes."""


def check_frames(value: bytes) -> ClientError | None:
    """The refusal of a ``Tokenwire-Frames`` value naming an unknown frame (or
    holding anything but names, commas and blanks), or None."""
    if _NOT_A_LIST.search(value):
        return ClientError(f"tokenwire-frames: {value[:40]!r} is not a list of frame names "
                           f"(of {', '.join(NAMES)})", ErrorCode.BAD_REQUEST)
    for name in value.decode("latin-1").split(","):
        name = name.strip().lower()
        if name and name not in NAMES:
            return ClientError(f"tokenwire-frames: {name[:40]!r} is not a frame (one of {', '.join(NAMES)})",
                               ErrorCode.BAD_REQUEST)
    return None


def with_query(headers: Sequence[Header], query: bytes) -> Sequence[Header]:
    """``headers`` with the ``tokenwire_frames`` parameter of ``query`` (the
    target's part after ``?``, percent-encoded) as a ``Tokenwire-Frames``
    header, unless the request has that header or no such parameter; the
    same headers, not a copy, when nothing is added."""
    if QUERY_PARAM not in query or any(name == FRAMES_HEADER for name, _ in headers):
        return headers
    for part in query.split(b"&"):
        name, _, value = part.partition(b"=")
        if name == QUERY_PARAM:
            return [*headers, (FRAMES_HEADER, unquote_to_bytes(value.replace(b"+", b" ")))]
    return headers


def asked(headers: Iterable[Header]) -> frozenset[str]:
    """The frames a request asked for (an unknown name is refused by :func:`check_frames`
    before the stream starts; here it is only left out)."""
    # Asked of every request: one pass over the headers, nothing built when none asks.
    listed: bytes | None = None
    summary: bytes | None = None
    for name, value in headers:
        if name == FRAMES_HEADER and listed is None:
            listed = value
        elif name == SUMMARY_HEADER and summary is None:
            summary = value
    if listed is None and summary is None:
        return _NONE
    frames: set[str] = set()
    if listed is not None:
        frames.update(name.strip().lower() for name in listed.decode("latin-1").split(","))
    if summary is not None and summary.strip().lower() in (b"true", b"1", b"yes"):
        frames.add(SUMMARY)
    return frozenset(frames.intersection(NAMES))


def open_event(stream_id: str | None, resumed: bool, start_index: int | None,
               config: WireConfig) -> SSEEvent:
    """``event: tokenwire.open``: how this response will carry its stream."""
    body = {"stream_id": stream_id, "resumed": resumed, "start_index": start_index,
            "policy": config.slow_client_policy.value, "buffer_bytes": config.max_pending_bytes}
    return SSEEvent(data=dumps(body), event="tokenwire.open")


def done_event(record: StreamRecord, *, delivered_from: int | None, reason: EndReason) -> SSEEvent:
    """``event: tokenwire.done``: what this response delivered, as of its last event."""
    tokens, source = record.tokens_out
    body = {"end_reason": reason.value, "tokens": tokens, "tokens_source": source,
            "delivered_from": delivered_from, "coalesced": record.coalesced_events,
            "dropped": record.dropped_events, "producer_wait_s": round(record.producer_wait_s, 6)}
    return SSEEvent(data=dumps(body), event="tokenwire.done")


def summary_event(record: StreamRecord, first_token_at: float | None, now: float) -> SSEEvent:
    """``event: tokenwire.summary``: time to first token, tokens and their source,
    tokens per second from the first token on, the duration (in the spirit of
    vLLM's per-request metrics)."""
    tokens, source = record.tokens_out
    rate = tokens / (now - first_token_at) if first_token_at is not None and now > first_token_at else None
    body = {"ttft_s": None if record.ttft_s is None else round(record.ttft_s, 6), "tokens": tokens,
            "tokens_source": source, "tokens_per_s": None if rate is None else round(rate, 3),
            "duration_s": round(record.duration_s, 6), "events_out": record.events_out,
            "coalesced_events": record.coalesced_events, "retries": record.retries}
    return SSEEvent(data=dumps(body), event="tokenwire.summary")
