"""Prometheus metrics for one sidecar, on its own registry (no globals).

Most figures come from the accounting record of each finished stream, so a
stream is counted once, when it ends; the gauges are live.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from tokenwire.middleware import GAP_BUCKETS_S, StreamRecord

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ABORT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class _EventGapCollector(Collector):
    """The event gap histogram, summed from the per-stream bucket counts the core keeps.

    The core hands over counts per bucket, not the gaps themselves, so the
    histogram has no ``_sum``.
    """

    def __init__(self) -> None:
        self.bucket_counts = [0] * len(GAP_BUCKETS_S)

    def add(self, counts: tuple[int, ...]) -> None:
        for i, count in enumerate(counts):
            self.bucket_counts[i] += count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "tokenwire_event_gap_seconds",
            "Gaps between consecutive content writes to a client socket.")
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(GAP_BUCKETS_S, self.bucket_counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        family.add_metric([], buckets, None)
        yield family


class SidecarMetrics:
    """Every metric the sidecar exports; ``render()`` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_streams = Gauge("tokenwire_active_streams", "Streams open now.", registry=r)
        self.active_connections = Gauge("tokenwire_active_connections",
                                        "Client connections open now.", registry=r)
        self.ttfb = Histogram("tokenwire_ttfb_seconds",
                              "Request start to the first content byte handed to the socket.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.event_gaps = _EventGapCollector()
        r.register(self.event_gaps)
        self.streams_ended = Counter("tokenwire_streams_ended", "Finished streams by end reason.",
                                     ["reason"], registry=r)
        self.heartbeats = Counter("tokenwire_heartbeats", "Heartbeat comments written.", registry=r)
        self.coalesced_events = Counter("tokenwire_coalesced_events",
                                        "Events merged into another while a client was slow.", registry=r)
        self.dropped_events = Counter("tokenwire_dropped_events",
                                      "Events replaced under the drop policy.", registry=r)
        self.retries = Counter("tokenwire_retries", "Upstream retries made.", registry=r)
        self.refused_retries = Counter("tokenwire_refused_retries",
                                       "Upstream retries the retry budget refused.", registry=r)
        self.abort_propagation = Histogram(
            "tokenwire_abort_propagation_seconds",
            "From the decision to abort to the upstream connection being closed.",
            buckets=_ABORT_BUCKETS_S, registry=r)
        self.bytes_out = Counter("tokenwire_bytes_out", "Body bytes written to clients.", registry=r)
        self.events_in = Counter("tokenwire_events_in", "Events read from upstreams.", registry=r)
        self.events_out = Counter("tokenwire_events_out", "Events written to clients.", registry=r)
        self.rejected_requests = Counter("tokenwire_rejected_requests",
                                         "Requests refused before reaching an upstream, by status.",
                                         ["status"], registry=r)
        self.client_requests = Counter("tokenwire_client_requests",
                                       "Requests read from clients, by protocol (http/1.1, h2).",
                                       ["protocol"], registry=r)
        self.replays = Counter("tokenwire_replays",
                               "Streams served from the replay store instead of an upstream, by kind "
                               "(reconnect: Last-Event-ID or GET /v1/streams; idempotent: a repeated "
                               "Idempotency-Key).", ["kind"], registry=r)

    def observe_record(self, record: StreamRecord) -> None:
        """Count one finished stream."""
        self.streams_ended.labels(record.end_reason.value).inc()
        if record.ttfb_s is not None:
            self.ttfb.observe(record.ttfb_s)
        self.event_gaps.add(record.event_gap_buckets)
        self.heartbeats.inc(record.heartbeats)
        self.coalesced_events.inc(record.coalesced_events)
        self.dropped_events.inc(record.dropped_events)
        self.retries.inc(record.retries)
        self.refused_retries.inc(record.refused_retries)
        self.bytes_out.inc(record.bytes_out)
        self.events_in.inc(record.events_in)
        self.events_out.inc(record.events_out)

    def render(self) -> bytes:
        return generate_latest(self.registry)
