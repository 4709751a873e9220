"""Per-upstream metrics, read from the balancer when scraped (no copies to keep in step).

Families (label ``upstream`` = the pod's address)::

    tokenwire_upstream_up                 1 if new streams may go there now
    tokenwire_upstream_open_streams       streams open on it from this sidecar
    tokenwire_upstream_requests_total     attempts sent to it
    tokenwire_upstream_failures_total     attempts that failed before their first byte
    tokenwire_upstream_resent_total       requests sent again after a reused keep-alive
                                          connection failed before any answer
    tokenwire_upstream_ejections_total    passive outlier ejections
    tokenwire_upstream_load_waiting       its last load reading (queue-aware): waiting,
    tokenwire_upstream_load_running       running,
    tokenwire_upstream_load_cache_use     KV-cache use 0..1
    tokenwire_upstream_picks_total        picks, by ``reason`` (the policy's, or its fallback)
    tokenwire_upstream_queue_depth        requests waiting for a free upstream now
    tokenwire_upstream_queue_timeouts_total  ... that waited queue_timeout_s and got 503
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .pools import UpstreamPools


# How the ``--workers`` supervisor reports these gauges once for the N workers
# (sidecar/process/workers.py): every worker reads the same pod (its health checks, its
# load polls), so a pod's figures are the pod's, reported once: the highest of
# the workers' readings (up: 1 if any worker may send new streams there, which
# is what ``up`` says; load: the most recent readings differ by a poll at most,
# and the highest never hides a backlog). A worker's own streams and queue are
# its own: they add up.
POD_GAUGES = frozenset({"tokenwire_upstream_up", "tokenwire_upstream_load_waiting",
                        "tokenwire_upstream_load_running", "tokenwire_upstream_load_cache_use"})
PROCESS_GAUGES = frozenset({"tokenwire_upstream_open_streams", "tokenwire_upstream_queue_depth"})


class UpstreamCollector(Collector):
    """The families above, for one sidecar's pools."""

    def __init__(self, pools: UpstreamPools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        balancer = self._pools.balancer
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            now = 0.0
        up = GaugeMetricFamily("tokenwire_upstream_up", "1 if new streams may go to the upstream now.",
                               labels=["upstream"])
        open_streams = GaugeMetricFamily("tokenwire_upstream_open_streams",
                                         "Streams open on the upstream from this sidecar.",
                                         labels=["upstream"])
        requests = CounterMetricFamily("tokenwire_upstream_requests", "Attempts sent to the upstream.",
                                       labels=["upstream"])
        failures = CounterMetricFamily("tokenwire_upstream_failures",
                                       "Attempts that failed before their first byte.", labels=["upstream"])
        resent = CounterMetricFamily("tokenwire_upstream_resent",
                                     "Requests sent again after a reused keep-alive connection "
                                     "failed before any answer.", labels=["upstream"])
        ejections = CounterMetricFamily("tokenwire_upstream_ejections", "Passive outlier ejections.",
                                        labels=["upstream"])
        waiting = GaugeMetricFamily("tokenwire_upstream_load_waiting",
                                    "Waiting requests in the upstream's last load reading.",
                                    labels=["upstream"])
        running = GaugeMetricFamily("tokenwire_upstream_load_running",
                                    "Running requests in the upstream's last load reading.",
                                    labels=["upstream"])
        cache = GaugeMetricFamily("tokenwire_upstream_load_cache_use",
                                  "KV-cache use (0..1) in the upstream's last load reading.",
                                  labels=["upstream"])
        picks = CounterMetricFamily("tokenwire_upstream_picks", "Picks of the upstream, by reason.",
                                    labels=["upstream", "reason"])
        for pod in balancer.pods:
            label = [pod.address]
            up.add_metric(label, 1.0 if pod.available(now) else 0.0)
            open_streams.add_metric(label, pod.open_streams)
            requests.add_metric(label, pod.requests)
            failures.add_metric(label, pod.failures)
            resent.add_metric(label, self._pools.resent(pod.address))
            ejections.add_metric(label, pod.ejections)
            if pod.load is not None:
                waiting.add_metric(label, pod.load.waiting)
                running.add_metric(label, pod.load.running)
                if pod.load.cache_use is not None:
                    cache.add_metric(label, pod.load.cache_use)
            for reason, count in sorted(pod.picks.items()):
                picks.add_metric([pod.address, reason], count)
        yield from (up, open_streams, requests, failures, resent, ejections, waiting, running, cache, picks)
        yield GaugeMetricFamily("tokenwire_upstream_queue_depth",
                                "Requests waiting for a free upstream now.", value=balancer.queue_depth)
        yield CounterMetricFamily("tokenwire_upstream_queue_timeouts",
                                  "Requests refused after waiting queue_timeout_s for a free upstream.",
                                  value=balancer.queue_timeouts)
