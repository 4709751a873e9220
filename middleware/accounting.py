"""Accounting: the counters and timings of one response, and its record.

Theory of operation
-------------------
:class:`Accounting` has no states: it only counts, as the other parts of the
core report what happened (an event in, bytes out, a heartbeat, a retry), and
builds the one :class:`~tokenwire.middleware.events.StreamRecord` each
response ends with. Time to first byte and the gaps between content writes
are measured where the bytes are handed to the socket, not where they arrive.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, overload

from .chunks import usage_of
from .errors import ErrorCode
from .events import EndReason, StreamRecord

GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))
"""Upper bounds of the inter-event gap histogram carried in each record."""


class Accounting:
    """Counters of one response. See the module docstring."""

    __slots__ = ("bytes_out", "events_in", "events_out", "gap_buckets", "heartbeats",
                 "last_content_at", "max_gap_s", "pending_high_water_bytes", "refused_retries",
                 "retries", "started_at", "ttfb_s", "upstream_comments", "usage")

    def __init__(self, now: float) -> None:
        self.started_at = now
        self.events_in = 0
        self.events_out = 0
        self.bytes_out = 0
        self.heartbeats = 0
        self.retries = 0
        self.refused_retries = 0
        self.upstream_comments = 0
        self.pending_high_water_bytes = 0
        self.ttfb_s: float | None = None
        self.last_content_at: float | None = None
        self.max_gap_s = 0.0
        self.gap_buckets = [0] * len(GAP_BUCKETS_S)
        self.usage: dict[str, Any] | None = None

    def content_written(self, events: int, now: float) -> None:
        """``events`` events were handed to the socket at ``now``."""
        self.events_out += events
        if self.ttfb_s is None:
            self.ttfb_s = now - self.started_at
        elif self.last_content_at is not None:
            gap_s = now - self.last_content_at
            if gap_s > self.max_gap_s:
                self.max_gap_s = gap_s
            for i, bound in enumerate(GAP_BUCKETS_S):
                if gap_s <= bound:
                    self.gap_buckets[i] += 1
                    break
        self.last_content_at = now

    def capture_usage(self, data: str) -> None:
        """Keep the chunk's usage block, if it has one (the last one wins)."""
        usage = usage_of(data)
        if usage is not None:
            self.usage = usage

    def record(self, now: float, *, request_id: str, upstream: str, status: int,
               end_reason: EndReason, error_code: ErrorCode | None, coalesced_events: int,
               dropped_events: int) -> StreamRecord:
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
            max_event_gap_s=self.max_gap_s,
            event_gap_buckets=tuple(self.gap_buckets),
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
        )


_T = TypeVar("_T")


class _Accounted(Protocol):
    _acct: Accounting


class Counted(Generic[_T]):
    """A read-only attribute that reads the same-named field of its owner's
    ``_acct`` (an :class:`Accounting`): how ``WireStream`` shows its counters."""

    __slots__ = ("_name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Counted[_T]: ...

    @overload
    def __get__(self, obj: _Accounted, objtype: type | None = None) -> _T: ...

    def __get__(self, obj: _Accounted | None, objtype: type | None = None) -> _T | Counted[_T]:
        if obj is None:
            return self
        value: _T = getattr(obj._acct, self._name)
        return value

    def __set__(self, obj: _Accounted, value: _T) -> None:
        raise AttributeError(f"{self._name} is read-only: the Accounting part counts it")
