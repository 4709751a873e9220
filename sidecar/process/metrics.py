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

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from tokenwire.middleware import StreamRecord
from tokenwire.middleware.process.figures import EndFigures, add_live, copy_figures
from tokenwire.middleware.process.prometheus import build_info_gauge, end_families, stream_families

_ABORT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)

REPLAY_UPSTREAM = "replay"
"""The ``upstream`` label of streams served from the replay store (a reconnect)."""


# How the ``--workers`` supervisor reports the gauges below for its N workers
# (sidecar/process/workers.py; the pods' gauges: upstream_metrics.py). Counters and
# histograms add up; of the gauges, a process's own figures add up, its start
# time and descriptor limit are the earliest and lowest, ``*_info`` stays 1.
PROCESS_GAUGES = frozenset({"tokenwire_active_streams", "tokenwire_active_connections",
                            "process_virtual_memory_bytes", "process_resident_memory_bytes",
                            "process_open_fds"})
EARLIEST_GAUGES = frozenset({"tokenwire_start_time_seconds", "process_start_time_seconds",
                             "process_max_fds"})


LiveRecords = Callable[[], Iterable[tuple[StreamRecord, str]]]
"""The records of the open streams as of now, each with its client's HTTP version."""


class _StreamCollector(Collector):
    """Finished totals plus the open streams' records, and what the ends
    counted (:class:`~tokenwire.middleware.process.figures.EndFigures`), at scrape time."""

    def __init__(self, live: LiveRecords) -> None:
        self._live = live
        self.ends = EndFigures()

    def collect(self) -> Iterator[Metric]:
        totals = copy_figures(self.ends.finished)
        add_live(totals, self._live())  # the uncommitted left out: see the module docstring
        yield from stream_families(totals)
        yield from end_families(self.ends)

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
        self.build_info = build_info_gauge(r, "sidecar")
        self.start_time = Gauge("tokenwire_start_time_seconds", "When this process started serving "
                                "(Unix time).", registry=r)
        self.start_time.set(time.time())
        self.active_streams = Gauge("tokenwire_active_streams", "Streams open now.", registry=r)
        self.active_connections = Gauge("tokenwire_active_connections",
                                        "Client connections open now.", registry=r)
        self.streams = _StreamCollector(live or (lambda: ()))
        r.register(self.streams)
        # Counted once a stream in compiled code, exported when scraped (figures.py).
        self.ends = self.streams.ends
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
        # Counted by the --workers supervisor (SupervisorMetrics); 0 here, so the
        # series is there in every mode and the supervisor's sum is its own count.
        self.streams_lost = streams_lost_counter(r)
        self.replays = Counter("tokenwire_replays",
                               "Streams served from the replay store instead of an upstream, by kind "
                               "(reconnect: Last-Event-ID or GET /v1/streams; idempotent: a repeated "
                               "Idempotency-Key).", ["kind"], registry=r)

    def count_open(self, streams: Callable[[], int], connections: Callable[[], int]) -> None:
        """The two gauges read what they count when scraped (the registry's
        streams, the open connections) instead of being moved up and down by
        each stream: four interpreted ``prometheus_client`` calls a stream less."""
        self.active_streams.set_function(streams)
        self.active_connections.set_function(connections)

    def observe_record(self, record: StreamRecord, http_version: str = "1.1") -> None:
        """Count one finished stream (its final record)."""
        self.ends.fold(record, http_version)
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
