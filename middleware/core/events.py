"""Inputs to and actions out of the wire core: frozen, slotted dataclasses
(``Finished`` aside: its record is built when first read, see there).

Drivers turn what happens on their sockets into *inputs* and feed them to
:meth:`tokenwire.middleware.WireStream.handle`; the core answers with a list of
*actions* (and bytes from ``data_to_send()``). Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import ErrorCode, WireError
from .sse import SSEEvent

Headers = tuple[tuple[bytes, bytes], ...]


class EndReason(StrEnum):
    """Why a stream ended; one per accounting record."""

    COMPLETE = "complete"
    CLIENT_GONE = "client_gone"
    SLOW_CLIENT = "slow_client"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    SHUTDOWN = "shutdown"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    DETACHED = "detached"
    """The client left, a resuming reader attached within ``resume_grace_s``, and
    the answer was completed into the replay store for it."""
    DEPARTED = "departed"
    """The client left and no reader attached while the answer was completed into
    the replay store during ``resume_grace_s``: generated, but its client got only
    ``events_out`` events (a later reader may still replay it)."""
    UPSTREAM_STATUS = "upstream_status"
    """The upstream answered with an error status (>= 400), passed through as it came."""
    NOT_EVENT_STREAM = "not_event_stream"
    """A streaming request was answered with a body that is not an event stream
    (a wrong port's HTML page): refused with 502 or passed through, as
    ``non_event_stream_answer`` says."""
    WORKER_LOST = "worker_lost"
    """The sidecar worker process serving the stream died (``--workers``); written
    by the supervisor, never by the core."""


class FailureKind(StrEnum):
    """How an upstream failed, as the driver saw it."""

    CONNECT = "connect"
    """No connection (refused, DNS, TLS): nothing reached the engine."""
    TIMEOUT = "timeout"
    """No status line within ``upstream_headers_timeout_s``, or a read timeout."""
    PROTOCOL = "protocol"
    """The connection broke or the HTTP framing was bad after it was made."""
    INVALID_STREAM = "invalid_stream"
    """The SSE body was malformed or over the size limits."""


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class UpstreamHeaders:
    """The upstream's status line and headers (names lower-case)."""

    status: int
    headers: Headers = ()

    def __post_init__(self) -> None:
        if not 100 <= self.status <= 599:
            raise ValueError(f"status must be 100..599, got {self.status}")


@dataclass(frozen=True, slots=True)
class UpstreamData:
    """Raw body bytes from the upstream; the core parses SSE itself."""

    data: bytes


@dataclass(frozen=True, slots=True)
class UpstreamEvent:
    """One parsed SSE event from the upstream."""

    event: SSEEvent


@dataclass(frozen=True, slots=True)
class UpstreamEnded:
    """The upstream body ended cleanly (EOF after a complete last event)."""


@dataclass(frozen=True, slots=True)
class UpstreamFailed:
    """The upstream failed (an error status arrives as :class:`UpstreamHeaders` instead)."""

    kind: FailureKind
    message: str


@dataclass(frozen=True, slots=True)
class SocketPaused:
    """The downstream transport's buffer is above its high-water mark."""


@dataclass(frozen=True, slots=True)
class SocketResumed:
    """The downstream transport drained below its low-water mark."""


@dataclass(frozen=True, slots=True)
class WriteCompleted:
    """The bytes last taken from ``data_to_send()`` were handed to the socket."""


@dataclass(frozen=True, slots=True)
class ClientGone:
    """The client closed or reset the connection."""


@dataclass(frozen=True, slots=True)
class StopRequested:
    """An operator ends the stream: ``shutdown`` (drain expired) or ``cancelled``."""

    reason: EndReason

    def __post_init__(self) -> None:
        if self.reason not in (EndReason.SHUTDOWN, EndReason.CANCELLED):
            raise ValueError(f"StopRequested takes shutdown or cancelled, got {self.reason}")


@dataclass(frozen=True, slots=True)
class Rejected:
    """The driver found the request cannot be served (an unknown stream to
    resume, a reused idempotency key): a real status before the first byte,
    in-band after it."""

    error: WireError


@dataclass(frozen=True, slots=True)
class ReplaySource:
    """Resume: this response replays stream ``stream_id`` after event ``after_seq``.

    Fed before ``UpstreamHeaders`` by a driver whose "upstream" is the replay
    store: events are then numbered on from ``after_seq`` under the original
    stream id (so they get the ids they had the first time) and are not
    recorded again.
    """

    stream_id: str
    after_seq: int


@dataclass(frozen=True, slots=True)
class ReaderAttached:
    """Resume: a reader attached to this stream while its client was gone
    (the driver learnt it from the replay store after ``AwaitReader``)."""


@dataclass(frozen=True, slots=True)
class HandOff:
    """Resume with a store other processes share: this one is going away (its
    drain began), so the stream moves to another replica. Once the client holds
    an event id to resume from (its first numbered event written), the client is
    closed without the terminal event, which makes it reconnect (an EventSource
    by itself, an SDK by its retry, with ``Last-Event-ID``), and the upstream
    keeps running into the store for whoever reads it there, until ``until``
    (loop time: the drain's end), when the stream ends as ``shutdown``. A reader
    (a replay) is closed the same way and ends: the store stays readable
    elsewhere. A stream that cannot be resumed (resume off, past
    ``resume_max_bytes``, not an event stream) ignores it: the drain ends it as
    before, with ``StopRequested(shutdown)``."""

    until: float


@dataclass(frozen=True, slots=True)
class Tick:
    """Time has passed; timers that are due fire. The time is ``handle``'s ``now``."""


Input = (
    UpstreamHeaders | UpstreamData | UpstreamEvent | UpstreamEnded | UpstreamFailed | SocketPaused
    | SocketResumed | WriteCompleted | ClientGone | StopRequested | Rejected | ReplaySource
    | ReaderAttached | HandOff
    | Tick
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class CommitHeaders:
    """Send the response status line and headers now.

    ``streaming`` is False for a plain (non-SSE) upstream response that the
    driver forwards unchanged, and for an error response whose body comes from
    ``data_to_send()``.
    """

    status: int
    headers: Headers
    streaming: bool = True


@dataclass(frozen=True, slots=True)
class AbortUpstream:
    """Close the upstream connection now; never return it to a pool.

    ``final`` is True when the stream itself is ending: then the engine should
    also be told (the explicit abort call, if configured). False when only one
    attempt is dropped before a retry, which reuses the request id, so an abort
    call would cancel the retry as well, and when the upstream is a replay
    (nothing is generating).
    """

    reason: EndReason
    final: bool = True


@dataclass(frozen=True, slots=True)
class RetryUpstream:
    """Start a fresh upstream request now (the backoff has already elapsed).

    ``attempt`` numbers it (1 for the first retry). Which upstream it goes to is
    the driver's: the sidecar's balancer picks a pod other than those this
    request failed on."""

    attempt: int


@dataclass(frozen=True, slots=True)
class PauseUpstream:
    """Stop reading the upstream body (``block`` policy): let TCP push back."""


@dataclass(frozen=True, slots=True)
class ResumeUpstream:
    """Read the upstream body again."""


@dataclass(frozen=True, slots=True)
class CloseClient:
    """End the downstream response.

    ``abrupt=False``: a clean end (chunked terminator, keep-alive allowed).
    ``abrupt=True``: write what is pending, then close the connection without
    the chunked terminator, so a client that ignores the error event still sees
    a truncated body. ``reset=True``: drop pending bytes and reset the
    connection at once (a client that stopped reading).
    """

    abrupt: bool
    reset: bool = False


@dataclass(frozen=True, slots=True)
class ReplayAppend:
    """Resume: append to stream ``stream_id`` in the replay store.

    ``frames`` are whole events as encoded for the wire but without their
    ``id:`` line, numbered ``first_seq``, ``first_seq + 1``...; replaying them
    through a core fed ``ReplaySource`` gives every event its original id.
    ``end`` is set once, with the last append. ``overflow``: the stream passed
    ``resume_max_bytes`` and nothing more of it will be stored. ``discard``:
    the stream failed before its first event, so there is nothing to resume and
    its idempotency key is released for a retry. ``alias``: another name the
    stream may be resumed by while it is kept (a Responses ``response.id``:
    ``GET /v1/responses/{alias}?stream=true``).
    """

    stream_id: str
    first_seq: int
    frames: tuple[bytes, ...]
    end: EndReason | None = None
    overflow: bool = False
    discard: bool = False
    alias: str | None = None


@dataclass(frozen=True, slots=True)
class AwaitReader:
    """Resume: the client left but the stream is held until ``until`` (loop time)
    for a reconnect; feed ``ReaderAttached`` if a reader attaches by then."""

    stream_id: str
    until: float


@dataclass(frozen=True, slots=True, init=False)
class StreamRecord:
    """The accounting record: one per stream, whatever happened to it."""

    request_id: str
    upstream: str
    status: int
    end_reason: EndReason
    error_code: ErrorCode | None
    started_at: float
    duration_s: float
    ttfb_s: float | None
    """Start to the first event (of any kind, the role-only chunk included) handed to the socket."""
    max_event_gap_s: float
    """The longest gap between writes from the first token on (see ``meter.py``)."""
    event_gap_buckets: tuple[int, ...]
    """Counts of those gaps, per ``meter.GAP_BUCKETS_S`` bound."""
    events_in: int
    events_out: int
    bytes_out: int
    heartbeats: int
    coalesced_events: int
    dropped_events: int
    retries: int
    refused_retries: int
    pending_high_water_bytes: int
    usage: dict[str, Any] | None = field(default=None, compare=False)
    ttft_s: float | None = None
    """Start to the first event that carries a token (text, reasoning, a tool call)."""
    event_gap_sum_s: float = 0.0
    """The sum of the gaps counted in ``event_gap_buckets``."""
    content_events: int = 0
    """Events written from the first token on, the terminal marker excluded."""
    stream_id: str | None = None
    """The resume id of the stream (``config.resume``), else None."""
    dialect: str = ""
    """The dialect the stream spoke (``chat.completions``, ``responses``, ``generic``...)."""
    upstream_keepalives: int = 0
    """Upstream comments and keepalive events (Anthropic's ``ping``): never counted as
    the upstream's activity by ``upstream_idle_timeout_s``."""
    tokens_counted: int = 0
    """Token pieces the engine sent, counted before any merge: a parsed event's texts
    and tool-call fragments (never a role chunk, a finish reason, usage or another
    named event), and one for each plain chunk that took the keeps-up path unparsed
    (so a finish chunk that came that way counts one)."""
    producer_wait_s: float = 0.0
    """Time the upstream was not read because a slow reader had enough waiting
    (``PauseUpstream``: under ``block``, past ``block_window_bytes``): how long the
    engine was made to wait."""

    def __init__(
            self, request_id: str, upstream: str, status: int, end_reason: EndReason,
            error_code: ErrorCode | None, started_at: float, duration_s: float, ttfb_s: float | None,
            max_event_gap_s: float, event_gap_buckets: tuple[int, ...], events_in: int, events_out: int,
            bytes_out: int, heartbeats: int, coalesced_events: int, dropped_events: int, retries: int,
            refused_retries: int, pending_high_water_bytes: int, usage: dict[str, Any] | None = None,
            ttft_s: float | None = None, event_gap_sum_s: float = 0.0, content_events: int = 0,
            stream_id: str | None = None, dialect: str = "", upstream_keepalives: int = 0,
            tokens_counted: int = 0, producer_wait_s: float = 0.0
    ) -> None:
        # Written out, not generated: dataclass's __init__ is interpreted, an
        # object.__setattr__ call a field; this one is compiled (~44 k instructions a stream,
        # docs/perf/stream-cost.md). tests/middleware/test_written_inits.py holds it to the fields.
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "upstream", upstream)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "end_reason", end_reason)
        object.__setattr__(self, "error_code", error_code)
        object.__setattr__(self, "started_at", started_at)
        object.__setattr__(self, "duration_s", duration_s)
        object.__setattr__(self, "ttfb_s", ttfb_s)
        object.__setattr__(self, "max_event_gap_s", max_event_gap_s)
        object.__setattr__(self, "event_gap_buckets", event_gap_buckets)
        object.__setattr__(self, "events_in", events_in)
        object.__setattr__(self, "events_out", events_out)
        object.__setattr__(self, "bytes_out", bytes_out)
        object.__setattr__(self, "heartbeats", heartbeats)
        object.__setattr__(self, "coalesced_events", coalesced_events)
        object.__setattr__(self, "dropped_events", dropped_events)
        object.__setattr__(self, "retries", retries)
        object.__setattr__(self, "refused_retries", refused_retries)
        object.__setattr__(self, "pending_high_water_bytes", pending_high_water_bytes)
        object.__setattr__(self, "usage", usage)
        object.__setattr__(self, "ttft_s", ttft_s)
        object.__setattr__(self, "event_gap_sum_s", event_gap_sum_s)
        object.__setattr__(self, "content_events", content_events)
        object.__setattr__(self, "stream_id", stream_id)
        object.__setattr__(self, "dialect", dialect)
        object.__setattr__(self, "upstream_keepalives", upstream_keepalives)
        object.__setattr__(self, "tokens_counted", tokens_counted)
        object.__setattr__(self, "producer_wait_s", producer_wait_s)

    @property
    def tokens_out(self) -> tuple[int, str]:
        """(tokens, source): the upstream's ``usage.completion_tokens`` where it
        sent one (source ``usage``), else ``tokens_counted`` (source ``counted``)."""
        usage = self.usage
        if usage is not None:
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if isinstance(completion, int) and not isinstance(completion, bool):
                return completion, "usage"
        return self.tokens_counted, "counted"

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (one log line)."""
        return {
            "request_id": self.request_id,
            "upstream": self.upstream,
            "status": self.status,
            "end_reason": self.end_reason.value,
            "error_code": self.error_code.value if self.error_code else None,
            "error_number": self.error_code.number if self.error_code else None,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 6),
            "ttfb_s": None if self.ttfb_s is None else round(self.ttfb_s, 6),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "max_event_gap_s": round(self.max_event_gap_s, 6),
            "event_gap_buckets": list(self.event_gap_buckets),
            "event_gap_sum_s": round(self.event_gap_sum_s, 6),
            "content_events": self.content_events,
            "tokens_out": self.tokens_out[0],
            "tokens_source": self.tokens_out[1],
            "stream_id": self.stream_id,
            "dialect": self.dialect,
            "upstream_keepalives": self.upstream_keepalives,
            "tokens_counted": self.tokens_counted,
            "events_in": self.events_in,
            "events_out": self.events_out,
            "bytes_out": self.bytes_out,
            "heartbeats": self.heartbeats,
            "coalesced_events": self.coalesced_events,
            "dropped_events": self.dropped_events,
            "retries": self.retries,
            "refused_retries": self.refused_retries,
            "pending_high_water_bytes": self.pending_high_water_bytes,
            "producer_wait_s": round(self.producer_wait_s, 6),
            "usage": self.usage,
        }


class Finished:
    """The stream is over; nothing more will be produced. Log and count ``record``.

    The one action that is not a dataclass: the core emits it with the means to
    build its record (``build`` and ``at``), and the record is built when first
    read, then kept. A driver can so act first on what comes before it in the
    same list (close a departed client's upstream) and pay for the record
    after. The stream changes no more once finished, so the record is the one
    it would have been when emitted. ``Finished(record)`` carries a ready one.
    """

    __slots__ = ("_at", "_build", "_record")

    def __init__(self, record: StreamRecord | None = None, *,
                 build: Callable[[float, str | None], StreamRecord] | None = None,
                 at: float = 0.0) -> None:
        if record is None and build is None:
            raise TypeError("Finished needs a record or a way to build one")
        self._record = record
        self._build = build
        self._at = at

    @property
    def record(self) -> StreamRecord:
        """The stream's final accounting record (built on first read)."""
        record = self._record
        if record is None:
            assert self._build is not None
            record = self._record = self._build(self._at, None)
        return record

    def record_as(self, upstream: str) -> StreamRecord:
        """The record with ``upstream`` as its pod: for a driver whose own
        balancer picked the pod (the core knows only a placeholder). Built
        once, with that value, instead of built and then copied."""
        if self._record is None and self._build is not None:
            return self._build(self._at, upstream)
        return dataclasses.replace(self.record, upstream=upstream)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Finished):
            return NotImplemented
        return self.record == other.record

    def __hash__(self) -> int:
        return hash(self.record)

    def __repr__(self) -> str:
        return f"Finished(record={self.record!r})"


Action = (
    CommitHeaders | AbortUpstream | RetryUpstream | PauseUpstream | ResumeUpstream
    | CloseClient | ReplayAppend | AwaitReader | Finished
)
