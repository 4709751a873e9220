"""Prometheus metrics for the ASGI middleware: the sidecar's names, on the app's registry.

Theory of operation
-------------------
``TokenWireMiddleware(app, metrics=True)`` (or ``metrics=registry``) makes one
:class:`MiddlewareMetrics` per ``prometheus_client`` registry, shared by every
middleware of the process on it (a registry refuses a metric name twice). The
figures are the sidecar's (``sidecar/process/metrics.py``; ``middleware/`` does not
import it, so the pieces both need live here and the sidecar imports them),
with the same names, help and labels, so one dashboard reads both drivers:

* per-event figures (time to first token and byte, the inter-token gaps,
  bytes, events, heartbeats, coalesced and dropped events) are never observed
  event by event: a scrape adds the totals of the streams that are over
  (folded in once, when each request's ASGI call returns) to the records of
  the streams open now, read at scrape time, so a 10-minute stream counts
  while it runs. A live stream counts once committed (its status, hence its
  ``status_class``, is known), as in the sidecar. Folding and reading happen
  under one lock, so a scrape from another thread
  (``prometheus_client.start_http_server``) never sees a stream twice or not
  at all, and no counter goes down;
* what is only known at the end (duration and end reason, slow-client cuts
  among them; error codes; tokens from ``usage``) is counted from the final
  record, when the core finishes the stream (the ``on_finished`` moment);
* ``tokenwire_active_streams`` is the event-stream responses open now (a
  request the app has not answered yet is not known to be a stream).

Labels: ``upstream`` is ``app`` (the wire core's name for the application),
``status_class`` (``2xx``, ``4xx``, ``5xx``; ``none`` before a status was
sent) and ``http_version`` (of the request's scope: ``1.1``, ``2``).
Retries, replays and connections are the sidecar's alone.
"""

from __future__ import annotations

import platform
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.record import StreamRecord
from .figures import (
    DURATION_BUCKETS_S,
    EndFigures,
    LabelKey,
    StreamFigures,
    add_live,
    copy_figures,
    fold_record,
    status_class,
)

if TYPE_CHECKING:
    from ..asgi.exchange import Exchange

STREAM_LABELS = ("upstream", "status_class", "http_version")

# The per-stream figures both drivers export (attribute of StreamFigures, name, help).
STREAM_COUNTERS = (
    ("bytes_out", "tokenwire_bytes_out", "Body bytes written to clients."),
    ("events_in", "tokenwire_events_in", "Events read from upstreams."),
    ("events_out", "tokenwire_events_out", "Events written to clients (merged events count once)."),
    ("content_events", "tokenwire_content_events",
     "Events written from the first token on, the terminal marker excluded."),
    ("heartbeats", "tokenwire_heartbeats", "Heartbeat comments written."),
    ("coalesced_events", "tokenwire_coalesced_events", "Events merged into another while a client was slow."),
    ("dropped_events", "tokenwire_dropped_events", "Events replaced under the drop policy."),
)
STREAM_HISTOGRAMS = (
    ("ttft", "tokenwire_time_to_first_token_seconds",
     "Request start to the first event carrying a token (text, reasoning, a tool call) "
     "handed to the client's socket; the role-only chunk does not count."),
    ("ttfb", "tokenwire_time_to_first_byte_seconds",
     "Request start to the first event of any kind handed to the client's socket."),
    ("inter_token", "tokenwire_inter_token_seconds",
     "Gaps between writes to the client from the first token on (merged events are one arrival)."),
)
_ACTIVE = ("tokenwire_active_streams", "Streams open now.")


def build_version() -> str:
    try:
        return metadata.version("tokenwire")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_info_gauge(registry: CollectorRegistry, program: str) -> Gauge:
    """``tokenwire_build_info{version,python,program}``, set to 1."""
    gauge = Gauge("tokenwire_build_info", "Always 1; the labels say what runs.",
                  ["version", "python", "program"], registry=registry)
    gauge.labels(build_version(), platform.python_version(), program).set(1)
    return gauge


# The metrics counted from a stream's final record (name, help, labels); the
# middleware keeps them as prometheus_client metrics, the sidecar folds them
# (figures.EndFigures) and exports them from these when scraped.
_END_LABELS = (*STREAM_LABELS, "reason")
DURATION = ("tokenwire_stream_duration_seconds",
            "Request start to the end of the response, by how it ended.", _END_LABELS)
ENDED = ("tokenwire_streams_ended", "Finished streams by end reason.", _END_LABELS)
ERRORS = ("tokenwire_stream_errors",
          "Streams that ended with an error, by its stable code (number and name).", ("number", "code"))
TOKENS = ("tokenwire_tokens_out", "Tokens sent to clients, counted when each stream ends: from the "
          "upstream's usage (source=usage) where it sent one, else its content events (source=counted).",
          ("upstream", "source"))
REQUESTS = ("tokenwire_client_requests", "Requests read from clients, by protocol (http/1.1, h2).",
            ("protocol",))


@dataclass(slots=True)
class EndMetrics:
    """The metrics counted from a stream's final record (the middleware's)."""

    stream_duration: Histogram
    streams_ended: Counter
    stream_errors: Counter
    tokens_out: Counter

    @classmethod
    def on(cls, registry: CollectorRegistry) -> EndMetrics:
        return cls(
            Histogram(*DURATION, buckets=DURATION_BUCKETS_S, registry=registry),
            Counter(*ENDED, registry=registry),
            Counter(*ERRORS, registry=registry),
            Counter(*TOKENS, registry=registry),
        )

    def count(self, record: StreamRecord, http_version: str) -> None:
        """Count one finished stream (its final record): what ``EndFigures.fold`` folds."""
        labels = (record.upstream, status_class(record.status), http_version, record.end_reason.value)
        self.streams_ended.labels(*labels).inc()
        self.stream_duration.labels(*labels).observe(record.duration_s)
        if record.error_code is not None:
            self.stream_errors.labels(record.error_code.number, record.error_code.value).inc()
        tokens, source = record.tokens_out
        if tokens > 0:  # a counter never goes down, whatever an engine's usage says
            self.tokens_out.labels(record.upstream, source).inc(tokens)


def end_families(ends: EndFigures) -> Iterator[Metric]:
    """The exposition of what :class:`EndFigures` folded: the same families
    (names, help, labels) as :class:`EndMetrics` and the requests counter."""
    duration = HistogramMetricFamily(DURATION[0], DURATION[1], labels=DURATION[2])
    ended = CounterMetricFamily(ENDED[0], ENDED[1], labels=ENDED[2])
    for key, figures in sorted(ends.durations.items()):
        buckets, total = figures.exposition()
        duration.add_metric(list(key), buckets, total)
        ended.add_metric(list(key), float(sum(figures.counts)))
    yield duration
    yield ended
    for (name, documentation, labels), table in ((ERRORS, ends.errors), (TOKENS, ends.tokens)):
        family = CounterMetricFamily(name, documentation, labels=labels)
        for pair, value in sorted(table.items()):
            family.add_metric(list(pair), float(value))
        yield family
    requests = CounterMetricFamily(REQUESTS[0], REQUESTS[1], labels=REQUESTS[2])
    for protocol, count in sorted(ends.requests.items()):
        requests.add_metric([protocol], float(count))
    yield requests


def stream_families(totals: dict[LabelKey, StreamFigures]) -> Iterator[Metric]:
    """The exposition of the per-stream figures: the histograms, then the counters."""
    for attribute, name, documentation in STREAM_HISTOGRAMS:
        family = HistogramMetricFamily(name, documentation, labels=STREAM_LABELS)
        for key, figures in sorted(totals.items()):
            buckets, total = getattr(figures, attribute).exposition()
            family.add_metric(list(key), buckets, total)
        yield family
    for attribute, name, documentation in STREAM_COUNTERS:
        counter = CounterMetricFamily(name, documentation, labels=STREAM_LABELS)
        for key, figures in sorted(totals.items()):
            counter.add_metric(list(key), float(getattr(figures, attribute)))
        yield counter


@dataclass(slots=True)
class _Open:
    """A request being served: its HTTP version, and whether its end was counted."""

    http_version: str
    ended: bool = False


# The metrics of each registry. The registry holds its collectors (these among
# them), so a weak reference to the metrics lives as long as the registry, and
# neither is kept alive by this table.
_shared: weakref.WeakKeyDictionary[CollectorRegistry, weakref.ref[MiddlewareMetrics]] = (
    weakref.WeakKeyDictionary())
_shared_lock = threading.Lock()


class MiddlewareMetrics(Collector):
    """The middleware's metrics on ``registry`` (see the module docstring);
    :meth:`on` gives the one of a registry. Also the collector of the live
    figures (registered on it)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._lock = threading.Lock()
        self._open: dict[Exchange, _Open] = {}
        self._by_request: dict[str, list[Exchange]] = {}
        self._finished: dict[LabelKey, StreamFigures] = {}
        self.build_info = build_info_gauge(registry, "middleware")
        self.ended = EndMetrics.on(registry)
        registry.register(self)

    @classmethod
    def on(cls, registry: CollectorRegistry | None = None) -> MiddlewareMetrics:
        """The metrics of ``registry`` (default: ``prometheus_client.REGISTRY``,
        which ``prometheus_client.make_asgi_app()`` serves), made on first use."""
        target = REGISTRY if registry is None else registry
        with _shared_lock:
            known = _shared.get(target)
            metrics = None if known is None else known()
            if metrics is None:
                metrics = cls(target)
                _shared[target] = weakref.ref(metrics)
            return metrics

    def counting(self, on_finished: Callable[[StreamRecord], object] | None,
                 ) -> Callable[[StreamRecord], object]:
        """The middleware's ``on_finished``: counts the record, then calls
        ``on_finished`` (the app's hook, if any)."""

        def on_finished_counted(record: StreamRecord) -> object:
            self.observe_record(record)
            return None if on_finished is None else on_finished(record)

        return on_finished_counted

    def asgi_app(self) -> Callable[..., Any]:
        """An ASGI app answering any HTTP request with the registry's exposition."""
        app: Callable[..., Any] = make_asgi_app(self.registry)
        return app

    # ------------------------------------------------------------ the driver's calls

    def opened(self, exchange: Exchange, http_version: str) -> None:
        """A request's exchange starts (before its app is called)."""
        with self._lock:
            self._open[exchange] = _Open(http_version)
            self._by_request.setdefault(exchange.request_id, []).append(exchange)

    def observe_record(self, record: StreamRecord) -> None:
        """A stream finished (its final record): count what is only known at the end."""
        http_version = "1.1"
        with self._lock:
            for exchange in self._by_request.get(record.request_id, ()):
                state = self._open[exchange]
                stream = exchange.stream
                if not state.ended and stream is not None and stream.finished:
                    state.ended = True
                    http_version = state.http_version
                    break
        self.ended.count(record, http_version)

    def closed(self, exchange: Exchange) -> None:
        """The request's ASGI call returned: its figures move from live to finished."""
        with self._lock:
            state = self._open.pop(exchange, None)
            if state is None:
                return
            same = self._by_request.get(exchange.request_id)
            if same is not None:
                same.remove(exchange)
                if not same:
                    del self._by_request[exchange.request_id]
            stream = exchange.stream
            if stream is None:
                return  # passed through: not a stream
            fold_record(self._finished, stream.record(exchange.loop.time()), state.http_version)

    # ------------------------------------------------------------ the collector

    def _totals(self) -> tuple[dict[LabelKey, StreamFigures], int]:
        active = 0
        live: list[tuple[StreamRecord, str]] = []
        with self._lock:
            totals = copy_figures(self._finished)
            for exchange, state in self._open.items():
                stream = exchange.stream
                if stream is None:
                    continue
                if not stream.finished:
                    active += 1
                live.append((stream.record(exchange.loop.time()), state.http_version))
            add_live(totals, live)  # the uncommitted left out: see the module docstring
        return totals, active

    def collect(self) -> Iterator[Metric]:
        totals, active = self._totals()
        yield from stream_families(totals)
        yield GaugeMetricFamily(*_ACTIVE, value=active)

    def describe(self) -> Iterator[Metric]:
        """The names (so a registry refuses a second collector of them)."""
        for _, name, documentation in STREAM_HISTOGRAMS:
            yield HistogramMetricFamily(name, documentation, labels=STREAM_LABELS)
        for _, name, documentation in STREAM_COUNTERS:
            yield CounterMetricFamily(name, documentation, labels=STREAM_LABELS)
        yield GaugeMetricFamily(*_ACTIVE)
