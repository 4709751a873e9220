"""Prometheus metrics for one engine app, on its own registry (no globals).

The engine's side of the sidecar's figures, on the same buckets so the two can
be compared: time to first token, inter-token gaps, queue wait and prefill
time per request, tokens in and out, and the batch's load after every step.
"""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Sequence
from functools import partial
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tokenwire.engine.backend import BackendStats
from tokenwire.middleware.core.meter import GAP_BUCKETS_S, LATENCY_BUCKETS_S

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _histogram(registry: CollectorRegistry, name: str, documentation: str, buckets_s: tuple[float, ...],
               labels: tuple[str, ...] = ()) -> Histogram:
    """One of the engine's latency histograms: ``tokenwire_engine_<name>`` on ``registry``."""
    return Histogram(f"tokenwire_engine_{name}", documentation, labels, buckets=buckets_s, registry=registry)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(amount)`` for each of ``amounts`` (an unlabelled histogram).

    The step's hand-off observes one inter-token gap per streamed row: 64 ``observe``
    calls take 128 locks and walk the buckets 64 times; this takes one lock per bucket
    hit (the gaps of one step mostly share one or two) and one for the sum.
    prometheus_client has no weighted ``observe``, so this adds to the histogram's
    own bucket and sum values (the same ones ``observe`` adds to)."""
    if not amounts:
        return
    bounds: Sequence[float] = histogram._upper_bounds
    counts = [0] * len(bounds)
    for amount in amounts:
        counts[bisect_left(bounds, amount)] += 1  # the first bound >= amount, as observe
    histogram._sum.inc(sum(amounts))
    buckets = histogram._buckets
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)


class EngineMetrics:
    """The engine's gauges, counters and histograms. Safe to update from any thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        ProcessCollector(registry=registry)
        try:
            version = metadata.version("tokenwire")
        except metadata.PackageNotFoundError:
            version = "unknown"
        self.build_info = Gauge("tokenwire_build_info", "Always 1; the labels say what runs.",
                                ["version", "python", "program"], registry=registry)
        self.build_info.labels(version, platform.python_version(), "engine").set(1)
        self.running = Gauge("tokenwire_engine_running", "Sequences admitted (decoding or "
                             "prefilling).", registry=registry)
        self.waiting = Gauge("tokenwire_engine_waiting", "Requests queued for admission.",
                             registry=registry)
        self.kv_tokens_in_use = Gauge("tokenwire_engine_kv_tokens_in_use",
                                      "Real tokens held in KV caches.", registry=registry)
        self.kv_cells_allocated = Gauge("tokenwire_engine_kv_cells_allocated",
                                        "Padded KV slots occupied (rows x columns).",
                                        registry=registry)
        self.kv_tokens_reserved = Gauge("tokenwire_engine_kv_tokens_reserved",
                                        "Admission reservations (prompt + max_tokens).",
                                        registry=registry)
        histogram = partial(_histogram, registry)
        self.step_seconds = histogram("step_seconds", "Duration of one scheduler step.", _STEP_BUCKETS_S)
        self.time_to_first_token_seconds = histogram(
            "time_to_first_token_seconds", "Request received to first token handed to the response.",
            LATENCY_BUCKETS_S)
        self.queue_wait_seconds = histogram(
            "queue_wait_seconds", "Request received to admitted into the batch (it left the waiting queue).",
            LATENCY_BUCKETS_S)
        self.prefill_seconds = histogram(
            "prefill_seconds", "Admitted to first token handed to the response: the prompt's prefill.",
            LATENCY_BUCKETS_S)
        self.inter_token_seconds = histogram(
            "inter_token_seconds", "Gaps between a request's successive token deliveries, from its first "
            "token on.", GAP_BUCKETS_S)
        self.request_duration_seconds = histogram(
            "request_duration_seconds", "Request received to its last output, by finish reason.",
            _DURATION_BUCKETS_S, labels=("finish_reason",))
        self.generated_tokens = Counter("tokenwire_engine_generated_tokens",
                                        "Tokens generated, aborted requests included.",
                                        registry=registry)
        self.prompt_tokens = Counter("tokenwire_engine_prompt_tokens",
                                     "Prompt tokens of finished requests.", registry=registry)
        self.requests_finished = Counter("tokenwire_engine_requests_finished",
                                         "Finished requests by finish reason.",
                                         ["finish_reason"], registry=registry)

    def observe_step(self, step_s: float, stats: BackendStats) -> None:
        """Engine thread, after each step."""
        self.step_seconds.observe(step_s)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_tokens_in_use.set(stats.kv_tokens_in_use)
        self.kv_cells_allocated.set(stats.kv_cells_allocated)
        self.kv_tokens_reserved.set(stats.kv_tokens_reserved)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
