"""Accounting: the counters and timings of one response, and its record.

Theory of operation
-------------------
:class:`Accounting` has no states: it only counts, as the other parts of the
core report what happened (an event in, bytes out, a heartbeat, a retry), and
builds the one :class:`~tokenwire.middleware.core.record.StreamRecord` each
response ends with. Time to first byte, time to first token and the gaps
between tokens are measured where the bytes are handed to the socket, not
where they arrive; the token timing is its :class:`~tokenwire.middleware.core.meter.TokenMeter`'s.
"""

from __future__ import annotations

from typing import Any

from .dialects.base import Dialect
from .errors import ErrorCode
from .meter import GAP_BUCKETS_S as GAP_BUCKETS_S
from .meter import TokenMeter
from .record import EndReason, StreamRecord


class Accounting:
    """Counters of one response. See the module docstring."""

    __slots__ = ("bytes_out", "events_in", "events_out", "heartbeats", "idle_keepalives", "meter",
                 "paused_at", "pending_high_water_bytes", "producer_wait_s", "refused_retries", "retries",
                 "started_at", "tokens_in", "ttfb_s", "upstream_comments", "upstream_keepalives", "usage")

    def __init__(self, now: float, dialect: Dialect) -> None:
        """``dialect``: what carries a token in this stream (for the time to first token)."""
        self.started_at = now
        self.events_in = 0
        self.events_out = 0
        self.bytes_out = 0
        self.heartbeats = 0
        self.retries = 0
        self.refused_retries = 0
        self.upstream_comments = 0
        self.tokens_in = 0
        """Token pieces as the engine sent them, before merging (``Dialect.count_tokens``)."""
        self.upstream_keepalives = 0
        """Upstream comments and keepalive events (Anthropic's ``ping``)."""
        self.idle_keepalives = 0
        """Of those, the ones since the last event of content."""
        self.pending_high_water_bytes = 0
        self.producer_wait_s = 0.0
        """Time the upstream was not read for a slow reader (``PauseUpstream``), ended pauses."""
        self.paused_at: float | None = None
        self.ttfb_s: float | None = None
        self.meter = TokenMeter(now, dialect.carries_token)
        self.usage: dict[str, Any] | None = None

    def upstream_paused(self, now: float) -> None:
        self.paused_at = now

    def upstream_resumed(self, now: float) -> None:
        if self.paused_at is not None:
            self.producer_wait_s += now - self.paused_at
            self.paused_at = None

    def content_written(self, events: int, now: float) -> None:
        """``events`` events were handed to the socket at ``now``."""
        self.events_out += events
        if self.ttfb_s is None:
            self.ttfb_s = now - self.started_at
        self.meter.wrote(events, now)

    def record(self, now: float, *, request_id: str, upstream: str, status: int,
               end_reason: EndReason, error_code: ErrorCode | None, coalesced_events: int,
               dropped_events: int, stream_id: str | None = None, dialect: str = "") -> StreamRecord:
        """The record as of ``now``; the other parts say the rest."""
        return StreamRecord(
            request_id=request_id,
            upstream=upstream,
            status=status,
            end_reason=end_reason,
            error_code=error_code,
            started_at=self.started_at,
            duration_s=now - self.started_at,
            ttfb_s=self.ttfb_s,
            max_event_gap_s=self.meter.max_gap_s,
            event_gap_buckets=tuple(self.meter.gap_buckets),
            events_in=self.events_in,
            events_out=self.events_out,
            bytes_out=self.bytes_out,
            heartbeats=self.heartbeats,
            coalesced_events=coalesced_events,
            dropped_events=dropped_events,
            retries=self.retries,
            refused_retries=self.refused_retries,
            pending_high_water_bytes=self.pending_high_water_bytes,
            usage=self.usage,
            ttft_s=self.meter.ttft_s,
            event_gap_sum_s=self.meter.gap_sum_s,
            content_events=self.meter.content_events,
            stream_id=stream_id,
            dialect=dialect,
            upstream_keepalives=self.upstream_keepalives,
            tokens_counted=self.tokens_in,
            producer_wait_s=self.producer_wait_s + (0.0 if self.paused_at is None else now - self.paused_at),
        )
