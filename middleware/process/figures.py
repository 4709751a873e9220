"""What the metrics of finished and open streams add up to: plain numbers by
label set, folded once a stream (compiled: no ``prometheus_client`` call a
stream) and turned into metric families only when scraped
(``prometheus.py`` for the middleware, ``sidecar/process/metrics.py``).

The per-event figures of a label set (:class:`StreamFigures`) are what both
drivers export live; :class:`EndFigures` adds what the sidecar counts from a
stream's final record (its duration and end reason, its error code, its
tokens, the requests read by protocol), which the middleware keeps as
``prometheus_client`` metrics of the app's registry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from ..core.meter import GAP_BUCKETS_S, LATENCY_BUCKETS_S
from ..core.record import StreamRecord

LabelKey = tuple[str, str, str]
"""``upstream``, ``status_class``, ``http_version``."""
EndKey = tuple[str, str, str, str]
"""A :data:`LabelKey` and the end ``reason``."""
DURATION_BUCKETS_S: Final[tuple[float, ...]] = (
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, float("inf"))


def status_class(status: int) -> str:
    """``2xx``... for a status; ``none`` before one was sent."""
    return f"{status // 100}xx" if status >= 100 else "none"


@dataclass(slots=True)
class HistogramSum:
    """Bucket counts (not cumulative), sum and count of one labelled histogram."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        counts = self.counts
        i = min(bisect_left(self.bounds, value), len(self.bounds) - 1)
        counts[i] = counts[i] + 1
        self.total += value

    def add_counts(self, counts: Iterable[int], total: float) -> None:
        mine = self.counts
        for i, count in enumerate(counts):
            mine[i] = mine[i] + count
        self.total += total

    def add(self, other: HistogramSum) -> None:
        self.add_counts(other.counts, other.total)

    def exposition(self) -> tuple[list[tuple[str, float]], float]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        return buckets, self.total


@dataclass(slots=True)
class StreamFigures:
    """What the streams of one label set add up to."""

    ttft: HistogramSum = field(default_factory=lambda: HistogramSum(LATENCY_BUCKETS_S))
    ttfb: HistogramSum = field(default_factory=lambda: HistogramSum(LATENCY_BUCKETS_S))
    inter_token: HistogramSum = field(default_factory=lambda: HistogramSum(GAP_BUCKETS_S))
    bytes_out: int = 0
    events_in: int = 0
    events_out: int = 0
    content_events: int = 0
    heartbeats: int = 0
    coalesced_events: int = 0
    dropped_events: int = 0

    def add_record(self, record: StreamRecord) -> None:
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.ttfb_s is not None:
            self.ttfb.observe(record.ttfb_s)
        self.inter_token.add_counts(record.event_gap_buckets, record.event_gap_sum_s)
        self.bytes_out += record.bytes_out
        self.events_in += record.events_in
        self.events_out += record.events_out
        self.content_events += record.content_events
        self.heartbeats += record.heartbeats
        self.coalesced_events += record.coalesced_events
        self.dropped_events += record.dropped_events

    def add(self, other: StreamFigures) -> None:
        self.ttft.add(other.ttft)
        self.ttfb.add(other.ttfb)
        self.inter_token.add(other.inter_token)
        self.bytes_out += other.bytes_out
        self.events_in += other.events_in
        self.events_out += other.events_out
        self.content_events += other.content_events
        self.heartbeats += other.heartbeats
        self.coalesced_events += other.coalesced_events
        self.dropped_events += other.dropped_events


def fold_record(table: dict[LabelKey, StreamFigures], record: StreamRecord, http_version: str) -> None:
    """Adds ``record`` to the figures of its label set in ``table``."""
    _fold_at(table, (record.upstream, status_class(record.status), http_version), record)


def _fold_at(table: dict[LabelKey, StreamFigures], key: LabelKey, record: StreamRecord) -> None:
    figures = table.get(key)
    if figures is None:
        figures = table[key] = StreamFigures()
    figures.add_record(record)


def copy_figures(table: dict[LabelKey, StreamFigures]) -> dict[LabelKey, StreamFigures]:
    """A copy of ``table`` that adding to leaves ``table`` as it is."""
    totals: dict[LabelKey, StreamFigures] = {}
    for key, figures in table.items():
        totals[key] = copy = StreamFigures()
        copy.add(figures)
    return totals


def add_live(totals: dict[LabelKey, StreamFigures], live: Iterable[tuple[StreamRecord, str]]) -> None:
    """Adds the records of the open streams (each with its HTTP version) to
    ``totals``, those not committed yet (no status: no ``status_class``) left out."""
    for record, http_version in live:
        if record.status >= 100:
            fold_record(totals, record, http_version)


class EndFigures:
    """One sidecar's figures of its finished streams, folded once a stream
    (:meth:`fold`) and read when scraped; requests counted as they are read."""

    def __init__(self) -> None:
        self.finished: dict[LabelKey, StreamFigures] = {}
        """The per-event figures of the streams that are over."""
        self.durations: dict[EndKey, HistogramSum] = {}
        """Durations by label set and end reason (their count: the streams ended)."""
        self.errors: dict[tuple[str, str], int] = {}
        """Streams ended with an error, by its number and code."""
        self.tokens: dict[tuple[str, str], int] = {}
        """Tokens sent, by upstream and source (``usage``, ``counted``)."""
        self.requests: dict[str, int] = {}
        """Requests read from clients, by protocol (``http/1.1``, ``h2``)."""

    def count_request(self, protocol: str) -> None:
        requests = self.requests
        requests[protocol] = requests.get(protocol, 0) + 1

    def fold(self, record: StreamRecord, http_version: str) -> None:
        """Count one finished stream (its final record)."""
        upstream = record.upstream
        label_class = status_class(record.status)
        _fold_at(self.finished, (upstream, label_class, http_version), record)
        # str() of a StrEnum member is its value, in C; .value is an interpreted
        # descriptor (and hashing a member, an interpreted __hash__).
        key = (upstream, label_class, http_version, str(record.end_reason))
        durations = self.durations.get(key)
        if durations is None:
            durations = self.durations[key] = HistogramSum(DURATION_BUCKETS_S)
        durations.observe(record.duration_s)
        code = record.error_code
        if code is not None:
            errors = self.errors
            error_key = (str(code.number), str(code))
            errors[error_key] = errors.get(error_key, 0) + 1
        tokens, source = record.tokens_out
        if tokens > 0:  # a counter never goes down, whatever an engine's usage says
            counted = self.tokens
            token_key = (record.upstream, source)
            counted[token_key] = counted.get(token_key, 0) + tokens
