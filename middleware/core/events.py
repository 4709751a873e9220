"""Inputs to and actions out of the wire core: frozen, slotted dataclasses
(``Finished`` aside: its record is built when first read, see there).

Drivers turn what happens on their sockets into *inputs* and feed them to
:meth:`tokenwire.middleware.WireStream.handle`; the core answers with a list of
*actions* (and bytes from ``data_to_send()``). Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from .errors import WireError
from .record import EndReason, StreamRecord
from .sse import SSEEvent

Headers = tuple[tuple[bytes, bytes], ...]


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


@dataclass(frozen=True, slots=True, init=False)
class UpstreamHeaders:
    """The upstream's status line and headers (names lower-case)."""

    status: int
    headers: Headers = ()

    def __init__(self, status: int, headers: Headers = ()) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "headers", headers)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not 100 <= self.status <= 599:
            raise ValueError(f"status must be 100..599, got {self.status}")


@dataclass(frozen=True, slots=True, init=False)
class UpstreamData:
    """Raw body bytes from the upstream; the core parses SSE itself."""

    data: bytes

    def __init__(self, data: bytes) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "data", data)


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


@dataclass(frozen=True, slots=True, init=False)
class CommitHeaders:
    """Send the response status line and headers now.

    ``streaming`` is False for a plain (non-SSE) upstream response that the
    driver forwards unchanged, and for an error response whose body comes from
    ``data_to_send()``.
    """

    status: int
    headers: Headers
    streaming: bool = True

    def __init__(self, status: int, headers: Headers, streaming: bool = True) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "headers", headers)
        object.__setattr__(self, "streaming", streaming)


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


@dataclass(frozen=True, slots=True, init=False)
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

    def __init__(self, abrupt: bool, reset: bool = False) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "abrupt", abrupt)
        object.__setattr__(self, "reset", reset)


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
