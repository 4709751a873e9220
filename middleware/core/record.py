"""The accounting record of a stream, :class:`StreamRecord`, and why the
stream ended, :class:`EndReason`: what a driver logs and counts once a stream
is over (from :class:`~tokenwire.middleware.core.events.Finished`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import ErrorCode


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
