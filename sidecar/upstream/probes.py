"""The active probes of the pods: health checks (``health_path``), load scrapes, connects.

Each pod gets a small httpcore pool of its own for its probes (a few requests a
second at most, apart from the streams' connections). A probe is one ``GET``
bounded by ``health_timeout_s``; what it found goes to the balancer
(:meth:`~tokenwire.sidecar.balance.Balancer.health_result`,
:meth:`~tokenwire.sidecar.balance.Balancer.load_result`), which decides what
it means: when a pod is out, how stale a load reading may be.

With health checks off, ``/readyz`` knows a pod only by how its last connect
went (:attr:`~tokenwire.sidecar.upstream.attempt.UpstreamCounters.connected`).
A sidecar that is not ready gets no traffic to learn from, so
:meth:`Probes.check_connects` connects (and closes at once) to each pod whose
last connect failed: nothing while none did, so a ready sidecar pays nothing
for it (and a pod no attempt has reached yet is not probed: without health
checks, nothing is known of a pod before its first connect).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpcore

from ..balance import Balancer, LoadMetricNames, parse_load
from ..settings import SidecarConfig
from .attempt import Upstream

logger = logging.getLogger("tokenwire.sidecar")


class Probes:
    """Health checks and load scrapes of every pod in the balancer's set."""

    def __init__(self, config: SidecarConfig, balancer: Balancer, upstream: Callable[[str], Upstream],
                 load_names: LoadMetricNames) -> None:
        self._config = config
        self._balancer = balancer
        self._upstream = upstream
        self._load_names = load_names
        self._pools: dict[str, httpcore.AsyncConnectionPool] = {}

    def forget(self, address: str) -> httpcore.AsyncConnectionPool | None:
        """The probe pool of a pod that left the set, for its caller to close."""
        return self._pools.pop(address, None)

    async def check_health(self) -> None:
        """One health check of every pod in the set, all at once."""
        pods = [pod.address for pod in self._balancer.pods if not pod.removed]

        async def check(address: str) -> None:
            answer = await self._get(address, self._config.health_path)
            ok = answer is not None and 200 <= answer[0] < 300
            if self._balancer.health_result(address, ok):
                logger.warning("upstream %s is %s", address, "healthy again" if ok else "unhealthy")

        await asyncio.gather(*(check(address) for address in pods))

    async def check_connects(self) -> None:
        """One bare connect to every pod whose last connect failed, all at once."""
        upstreams = [self._upstream(pod.address) for pod in self._balancer.pods if not pod.removed]

        async def connect(upstream: Upstream) -> None:
            origin = upstream.pool.origin
            try:
                async with asyncio.timeout(self._config.health_timeout_s):
                    if origin.uds is not None:
                        _, writer = await asyncio.open_unix_connection(origin.uds)
                    else:
                        _, writer = await asyncio.open_connection(origin.host.decode("ascii"), origin.port)
            except (TimeoutError, OSError):
                upstream.counters.connected = False
                return
            writer.close()
            upstream.counters.connected = True

        await asyncio.gather(*(connect(upstream) for upstream in upstreams
                               if upstream.counters.connected is False))

    async def poll_load(self) -> None:
        """One load scrape of every pod in the set, all at once."""
        loop = asyncio.get_running_loop()
        pods = [pod.address for pod in self._balancer.pods if not pod.removed]

        async def poll(address: str) -> None:
            answer = await self._get(address, self._config.load_metrics_path)
            sample = None
            if answer is not None and answer[0] == 200:
                sample = parse_load(answer[1].decode("utf-8", "replace"), self._load_names)
            self._balancer.load_result(address, sample, loop.time())

        await asyncio.gather(*(poll(address) for address in pods))

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()

    def _pool(self, address: str) -> httpcore.AsyncConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            uds = address[len("unix:"):] if address.startswith("unix:") else None
            pool = httpcore.AsyncConnectionPool(max_connections=2, retries=0, uds=uds,
                                                keepalive_expiry=60.0)
            self._pools[address] = pool
        return pool

    async def _get(self, address: str, path: str) -> tuple[int, bytes] | None:
        """One GET to a pod; None if it failed or took too long."""
        timeout_s = self._config.health_timeout_s
        url = self._upstream(address).url(path.encode())
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._pool(address).request(
                    "GET", url, extensions={"timeout": {"connect": timeout_s, "read": timeout_s,
                                                        "write": timeout_s, "pool": timeout_s}})
        except (TimeoutError, httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                httpcore.UnsupportedProtocol):
            return None
        return response.status, response.content
