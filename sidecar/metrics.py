"""Prometheus metrics for one sidecar, on its own registry (no globals).

Theory of operation
-------------------
Per-event figures (time to first token, inter-token gaps, bytes, events,
heartbeats) are never observed event by event: the wire core already keeps
them per stream (``StreamRecord``, ``meter.py``), so a scrape adds up two
parts: the totals of finished streams, folded in once when each ends, and the
records of the streams open now, read at scrape time. A 10-minute stream is
therefore visible while it runs, and metrics cost nothing per event beyond
what the core counts anyway.

A live stream contributes only once committed (its status, hence its
``status_class``, is known and never changes after). Its upstream could only
change by a retry, which happens before the commit. Figures that are only
known at the end (duration, end reason, tokens from ``usage``, retries) are
counted at the end. At a stream's end its final record replaces its live one
in the same loop turn, so no counter ever goes down.

Labels: ``upstream`` (the engine's address as configured, or ``replay`` for a
stream served from the replay store), ``status_class`` (``2xx``, ``4xx``,
``5xx``), ``http_version`` (of the client's connection).
"""

from __future__ import annotations

import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from tokenwire.middleware import GAP_BUCKETS_S, StreamRecord
from tokenwire.middleware.meter import LATENCY_BUCKETS_S

_DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, float("inf"))
_ABORT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)

STREAM_LABELS = ("upstream", "status_class", "http_version")
REPLAY_UPSTREAM = "replay"
"""The ``upstream`` label of streams served from the replay store (a reconnect)."""
LabelKey = tuple[str, str, str]


# How the ``--workers`` supervisor reports the gauges below for its N workers
# (sidecar/workers.py; the pods' gauges: upstream_metrics.py). Counters and
# histograms add up; of the gauges, a process's own figures add up, its start
# time and descriptor limit are the earliest and lowest, ``*_info`` stays 1.
PROCESS_GAUGES = frozenset({"tokenwire_active_streams", "tokenwire_active_connections",
                            "process_virtual_memory_bytes", "process_resident_memory_bytes",
                            "process_open_fds"})
EARLIEST_GAUGES = frozenset({"tokenwire_start_time_seconds", "process_start_time_seconds",
                             "process_max_fds"})


def status_class(status: int) -> str:
    """``2xx``... for a status; ``none`` before one was sent."""
    return f"{status // 100}xx" if status >= 100 else "none"


def build_version() -> str:
    try:
        return metadata.version("tokenwire")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class _HistogramSum:
    """Bucket counts (not cumulative), sum and count of one labelled histogram."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.counts[min(bisect_left(self.bounds, value), len(self.bounds) - 1)] += 1
        self.total += value

    def add_counts(self, counts: Iterable[int], total: float) -> None:
        for i, count in enumerate(counts):
            self.counts[i] += count
        self.total += total

    def add(self, other: _HistogramSum) -> None:
        self.add_counts(other.counts, other.total)

    def exposition(self) -> tuple[list[tuple[str, float]], float]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        return buckets, self.total


@dataclass(slots=True)
class _StreamFigures:
    """What the streams of one label set add up to."""

    ttft: _HistogramSum = field(default_factory=lambda: _HistogramSum(LATENCY_BUCKETS_S))
    ttfb: _HistogramSum = field(default_factory=lambda: _HistogramSum(LATENCY_BUCKETS_S))
    inter_token: _HistogramSum = field(default_factory=lambda: _HistogramSum(GAP_BUCKETS_S))
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

    def add(self, other: _StreamFigures) -> None:
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


LiveRecords = Callable[[], Iterable[tuple[StreamRecord, str]]]
"""The records of the open streams as of now, each with its client's HTTP version."""


class _StreamCollector(Collector):
    """Finished totals plus the open streams' records, at scrape time."""

    _COUNTERS = (
        ("bytes_out", "tokenwire_bytes_out", "Body bytes written to clients."),
        ("events_in", "tokenwire_events_in", "Events read from upstreams."),
        ("events_out", "tokenwire_events_out", "Events written to clients (merged events count once)."),
        ("content_events", "tokenwire_content_events",
         "Events written from the first token on, the terminal marker excluded."),
        ("heartbeats", "tokenwire_heartbeats", "Heartbeat comments written."),
        ("coalesced_events", "tokenwire_coalesced_events",
         "Events merged into another while a client was slow."),
        ("dropped_events", "tokenwire_dropped_events", "Events replaced under the drop policy."),
    )

    def __init__(self, live: LiveRecords) -> None:
        self._live = live
        self._finished: dict[LabelKey, _StreamFigures] = {}

    def fold(self, record: StreamRecord, http_version: str) -> None:
        key = (record.upstream, status_class(record.status), http_version)
        figures = self._finished.get(key)
        if figures is None:
            figures = self._finished[key] = _StreamFigures()
        figures.add_record(record)

    def _totals(self) -> dict[LabelKey, _StreamFigures]:
        totals: dict[LabelKey, _StreamFigures] = {}
        for key, finished in self._finished.items():
            totals[key] = copy = _StreamFigures()
            copy.add(finished)
        for record, http_version in self._live():
            if record.status < 100:
                continue  # not committed yet: see the module docstring
            key = (record.upstream, status_class(record.status), http_version)
            live = totals.get(key)
            if live is None:
                live = totals[key] = _StreamFigures()
            live.add_record(record)
        return totals

    def collect(self) -> Iterator[Metric]:
        totals = self._totals()
        histograms = (
            ("ttft", "tokenwire_time_to_first_token_seconds",
             "Request start to the first event carrying a token (text, reasoning, a tool call) "
             "handed to the client's socket; the role-only chunk does not count."),
            ("ttfb", "tokenwire_time_to_first_byte_seconds",
             "Request start to the first event of any kind handed to the client's socket."),
            ("inter_token", "tokenwire_inter_token_seconds",
             "Gaps between writes to the client from the first token on (merged events are one "
             "arrival)."),
        )
        for attribute, name, documentation in histograms:
            family = HistogramMetricFamily(name, documentation, labels=STREAM_LABELS)
            for key, figures in sorted(totals.items()):
                buckets, total = getattr(figures, attribute).exposition()
                family.add_metric(list(key), buckets, total)
            yield family
        for attribute, name, documentation in self._COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=STREAM_LABELS)
            for key, figures in sorted(totals.items()):
                counter.add_metric(list(key), float(getattr(figures, attribute)))
            yield counter

    def describe(self) -> Iterator[Metric]:
        return iter(())


class SidecarMetrics:
    """Every metric the sidecar exports; ``render()`` is the /metrics body.

    ``live`` yields the records of the open streams (the registry's); without
    it only finished streams are counted.
    """

    def __init__(self, live: LiveRecords | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.build_info = Gauge("tokenwire_build_info", "Always 1; the labels say what runs.",
                                ["version", "python", "program"], registry=r)
        self.build_info.labels(build_version(), platform.python_version(), "sidecar").set(1)
        self.start_time = Gauge("tokenwire_start_time_seconds", "When this process started serving "
                                "(Unix time).", registry=r)
        self.start_time.set(time.time())
        self.active_streams = Gauge("tokenwire_active_streams", "Streams open now.", registry=r)
        self.active_connections = Gauge("tokenwire_active_connections",
                                        "Client connections open now.", registry=r)
        self.streams = _StreamCollector(live or (lambda: ()))
        r.register(self.streams)
        self.stream_duration = Histogram(
            "tokenwire_stream_duration_seconds", "Request start to the end of the response, "
            "by how it ended.", [*STREAM_LABELS, "reason"], buckets=_DURATION_BUCKETS_S, registry=r)
        self.streams_ended = Counter("tokenwire_streams_ended", "Finished streams by end reason.",
                                     [*STREAM_LABELS, "reason"], registry=r)
        self.stream_errors = Counter("tokenwire_stream_errors", "Streams that ended with an error, "
                                     "by its stable code (number and name).", ["number", "code"],
                                     registry=r)
        self.tokens_out = Counter("tokenwire_tokens_out", "Tokens sent to clients, counted when each "
                                  "stream ends: from the upstream's usage (source=usage) where it sent "
                                  "one, else its content events (source=counted).",
                                  ["upstream", "source"], registry=r)
        self.retries = Counter("tokenwire_retries", "Upstream retries made.", registry=r)
        self.refused_retries = Counter("tokenwire_refused_retries",
                                       "Upstream retries the retry budget refused.", registry=r)
        self.abort_propagation = Histogram(
            "tokenwire_abort_propagation_seconds",
            "From the decision to abort to the upstream connection being closed.",
            buckets=_ABORT_BUCKETS_S, registry=r)
        self.rejected_requests = Counter("tokenwire_rejected_requests",
                                         "Requests refused before reaching an upstream, by status.",
                                         ["status"], registry=r)
        self.client_requests = Counter("tokenwire_client_requests",
                                       "Requests read from clients, by protocol (http/1.1, h2).",
                                       ["protocol"], registry=r)
        # Counted by the --workers supervisor (SupervisorMetrics); 0 here, so the
        # series is there in every mode and the supervisor's sum is its own count.
        self.streams_lost = streams_lost_counter(r)
        self.replays = Counter("tokenwire_replays",
                               "Streams served from the replay store instead of an upstream, by kind "
                               "(reconnect: Last-Event-ID or GET /v1/streams; idempotent: a repeated "
                               "Idempotency-Key).", ["kind"], registry=r)
        # The labelled children of the per-stream metrics, by label values (never
        # removed: a label set once seen is exported for the process's life anyway).
        self._client_request_children: dict[str, Counter] = {}
        self._ended_children: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        self._tokens_children: dict[tuple[str, str], Counter] = {}

    def count_client_request(self, protocol: str) -> None:
        """One request read from a client over ``protocol`` (``http/1.1``, ``h2``)."""
        child = self._client_request_children.get(protocol)
        if child is None:
            child = self._client_request_children[protocol] = self.client_requests.labels(protocol)
        child.inc()

    def observe_record(self, record: StreamRecord, http_version: str = "1.1") -> None:
        """Count one finished stream (its final record)."""
        labels = (record.upstream, status_class(record.status), http_version, record.end_reason.value)
        self.streams.fold(record, http_version)
        # labels() checks and locks on every call: each label set's children are looked up once.
        children = self._ended_children.get(labels)
        if children is None:
            children = self._ended_children[labels] = (self.streams_ended.labels(*labels),
                                                       self.stream_duration.labels(*labels))
        ended, duration = children
        ended.inc()
        duration.observe(record.duration_s)
        if record.error_code is not None:
            self.stream_errors.labels(record.error_code.number, record.error_code.value).inc()
        tokens, source = record.tokens_out
        if tokens:
            key = (record.upstream, source)
            tokens_child = self._tokens_children.get(key)
            if tokens_child is None:
                tokens_child = self._tokens_children[key] = self.tokens_out.labels(*key)
            tokens_child.inc(tokens)
        if record.retries:
            self.retries.inc(record.retries)
        if record.refused_retries:
            self.refused_retries.inc(record.refused_retries)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def streams_lost_counter(registry: CollectorRegistry) -> Counter:
    """``tokenwire_streams_lost_total{reason}``, its ``worker_lost`` series at 0 from the start."""
    counter = Counter("tokenwire_streams_lost", "Streams lost with the process that served them, by "
                      "reason (worker_lost: open on a --workers worker that died; the supervisor logs a "
                      "worker_lost record for each).", ["reason"], registry=registry)
    counter.labels("worker_lost")
    return counter


class SupervisorMetrics:
    """What the ``--workers`` supervisor counts itself, beside its workers' figures."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.worker_lost = streams_lost_counter(self.registry).labels("worker_lost")
        self.worker_restarts = Counter("tokenwire_worker_restarts",
                                       "Worker processes that died (the supervisor starts each one again).",
                                       registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
