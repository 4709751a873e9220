"""The upstream set: its members, their connection pools, and the balancer's driver.

Theory of operation
-------------------
:class:`UpstreamPools` is the driver of the balancing core
(:mod:`tokenwire.sidecar.balance`): it keeps the set's members
(:class:`~tokenwire.sidecar.upstream.membership.Membership`: the ``upstream``
entries, address files re-read on change and SIGHUP, names re-resolved every
``upstream_refresh_s``), runs the active probes
(:class:`~tokenwire.sidecar.upstream.probes.Probes`), arms the wait queue's
timer, and gives each attempt the pod the balancer picked
(:meth:`UpstreamPools.request`), or its refusal. It decides nothing: which
pod, when a pod is out, who waits, what counts as a pod's failure, all are the
balancer's answers.

Each pod (``http://host:port[/prefix]`` or ``unix:/path``) gets its
connection pool (:class:`~tokenwire.sidecar.upstream.pool.UpstreamPool` of
the sidecar's own HTTP/1.1 connections), made on its first attempt and closed
when it leaves the set with no stream open. An attempt on it is
:func:`~tokenwire.sidecar.upstream.attempt.run_attempt`.

The connections (:class:`~tokenwire.sidecar.upstream.conn.UpstreamConnection`)
write the request head and read the response head themselves, by h11's
rules (:mod:`~tokenwire.sidecar.upstream.head`: why a client of our own);
their bytes move through :mod:`~tokenwire.sidecar.upstream.transport`, and
they fail in their own exception family
(:mod:`~tokenwire.sidecar.upstream.errors`). httpcore is the client of the
probes and the abort calls (:mod:`~tokenwire.sidecar.upstream.abort`).

Compression: every upstream request asks for ``Accept-Encoding: identity``
(whatever the client sent), because the wire core parses the event stream. An
upstream that compresses an event stream anyway is refused by the core
(``invalid_stream``: 502 before the first byte) rather than decompressed, which
would let a small body expand without bound; a non-stream answer is not parsed
and goes through untouched, ``Content-Encoding`` and all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpcore

from ..balance import (
    Balancer,
    BalanceSettings,
    HealthSettings,
    Pick,
    Refusal,
    metric_names,
    parse_spec,
    prefix_key,
)
from ..settings import SidecarConfig
from ..tasks import spawn
from .abort import AbortClient
from .attempt import Upstream
from .conn import Origin
from .membership import Membership
from .pool import UpstreamPool
from .probes import Probes
from .transport import UpstreamBackend

logger = logging.getLogger("tokenwire.sidecar")

# Pods are http:// (or unix:): the port a Host header leaves out.
_HTTP_PORT: Final = 80


@dataclass(frozen=True, slots=True, init=False)
class Grant:
    """A pod given to one attempt: hand it back with :meth:`UpstreamPools.release`."""

    upstream: Upstream
    reason: str
    """Why the policy chose it (``least-outstanding``, ``prefix-affinity:overloaded``...)."""

    def __init__(self, upstream: Upstream, reason: str) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "upstream", upstream)
        object.__setattr__(self, "reason", reason)

    @property
    def address(self) -> str:
        return self.upstream.name


Answer = Callable[[Grant | Refusal], None]


def balance_settings(config: SidecarConfig) -> BalanceSettings:
    """The balancer's settings from the sidecar's."""
    return BalanceSettings(
        policy=config.balance,
        max_streams_per_upstream=config.max_streams_per_upstream,
        queue_max=config.queue_max,
        queue_timeout_s=config.queue_timeout_s,
        prefix_affinity_load_factor=config.prefix_affinity_load_factor,
        prefix_affinity_min_streams=config.prefix_affinity_min_streams,
        load_stale_after_s=3 * config.load_poll_s + config.health_timeout_s,
        health=HealthSettings(
            unhealthy_threshold=config.health_unhealthy_threshold,
            healthy_threshold=config.health_healthy_threshold,
            outlier_consecutive_failures=config.outlier_consecutive_failures,
            outlier_base_ejection_s=config.outlier_base_ejection_s,
            outlier_max_ejection_s=config.outlier_max_ejection_s,
            outlier_max_ejected_share=config.outlier_max_ejected_share),
        retry_after_s=max(1, math.ceil(config.health_interval_s)) if config.health_path else 1,
    )


class UpstreamPools:
    """The upstream set: its members, their pools, and the driver of the
    :class:`~tokenwire.sidecar.balance.Balancer` (timers, health checks, load
    scrapes, DNS and address-file refreshes). It decides nothing itself."""

    def __init__(self, config: SidecarConfig, *, rng: random.Random | None = None) -> None:
        self._config = config
        connect_timeout_s = config.upstream_connect_timeout_s
        self._timeouts: dict[str, float | None] = {"connect": connect_timeout_s, "pool": connect_timeout_s}
        self._aborts = AbortClient(config.abort_url, connect_timeout_s)
        self.balancer = Balancer(balance_settings(config), rng=rng)
        self._membership = Membership([parse_spec(entry) for entry in config.upstream])
        self._upstreams: dict[str, Upstream] = {}
        self._probes = Probes(config, self.balancer, self.upstream, metric_names(
            config.load_metrics, config.load_metric_waiting, config.load_metric_running,
            config.load_metric_cache))
        self._backend = UpstreamBackend()
        self._waiting: dict[Hashable, Answer] = {}
        self._queue_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._apply_members()

    # ------------------------------------------------------------ members

    def _build(self, name: str) -> Upstream:
        config = self._config
        uds: str | None = None
        if name.startswith("unix:"):
            uds = name[len("unix:"):]
            scheme, host, port, prefix = b"http", b"localhost", None, b""
        else:
            url = httpcore.URL(name)
            scheme, host, port = url.scheme, url.host, url.port
            prefix = url.target.rstrip(b"/")
        # The Host of a request that names none, as httpcore's stream() would add it.
        host_header = host if port is None or port == _HTTP_PORT else b"%b:%d" % (host, port)
        origin = Origin(host, _HTTP_PORT if port is None else port, host_header, uds=uds)
        pool = UpstreamPool(origin, max_connections=config.upstream_max_connections,
                            keepalive_expiry_s=config.upstream_keepalive_s, backend=self._backend)
        return Upstream(name, scheme, host, port, prefix, pool)

    def _apply_members(self) -> None:
        added, dropped = self.balancer.set_members(self._membership.members())
        for address in added:
            logger.info("upstream %s added", address)
        self._forget(dropped)
        self._answer_queue()

    def _forget(self, dropped: Sequence[str]) -> None:
        for address in dropped:
            logger.info("upstream %s removed (no open streams left)", address)
            upstream = self._upstreams.pop(address, None)
            probe = self._probes.forget(address)
            if upstream is not None or probe is not None:
                self._spawn(self._close_pools(upstream, probe))

    @staticmethod
    async def _close_pools(upstream: Upstream | None, probe: httpcore.AsyncConnectionPool | None) -> None:
        if upstream is not None:
            await upstream.pool.aclose()
        if probe is not None:
            await probe.aclose()

    async def refresh(self) -> None:
        """Resolve the names and re-read the files now (SIGHUP, and every ``upstream_refresh_s``)."""
        if await self._membership.refresh():
            self._apply_members()

    def reload(self) -> None:
        """SIGHUP: re-read the address files at once, changed or not."""
        self._membership.forget_file_stamps()
        self._spawn(self.refresh())

    # ------------------------------------------------------------ background

    async def start(self) -> None:
        """Resolve the names once (and check the pods' health once), then keep the
        set, health and load up to date."""
        await self.refresh()
        config = self._config
        if self._membership.dynamic:
            self._spawn(self._every(config.upstream_refresh_s, self.refresh))
        if config.health_path:
            # The first check now, not one interval on: ``/readyz`` is true from the
            # ready line (a check is bounded by health_timeout_s).
            await self._check_health()
            self._spawn(self._every(config.health_interval_s, self._check_health))
        elif config.ready_requires_upstream:
            self._spawn(self._every(config.health_interval_s, self._probes.check_connects))
        if config.balance == "queue-aware":
            self._spawn(self._every(config.load_poll_s, self._probes.poll_load))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            spawn(self._tasks, coro)
        except RuntimeError:
            coro.close()  # built outside a loop (a test): nothing to run it on

    @staticmethod
    async def _every(interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:
                logger.exception("upstream background job failed")

    async def _check_health(self) -> None:
        await self._probes.check_health()
        self._answer_queue()

    # ------------------------------------------------------------ streams

    def upstream(self, address: str) -> Upstream:
        """The pod at ``address`` and its pool (made on first use)."""
        upstream = self._upstreams.get(address)
        if upstream is None:
            upstream = self._upstreams[address] = self._build(address)
        return upstream

    def _grant(self, pick: Pick) -> Grant:
        return Grant(self.upstream(pick.address), pick.reason)

    def request(self, ticket: Hashable, *, body: bytes, exclude: frozenset[str],
                on_answer: Answer) -> Grant | Refusal | None:
        """A pod for one attempt: a :class:`Grant`, a :class:`Refusal`, or None
        when the request waits in the queue (``on_answer`` gets the answer later).
        ``exclude``: the pods this request already failed on."""
        key = (prefix_key(body, self._config.prefix_affinity_tokens)
               if self._config.balance == "prefix-affinity" else None)
        now = asyncio.get_running_loop().time()
        answer = self.balancer.request(ticket, key=key, exclude=exclude, now=now)
        if isinstance(answer, Pick):
            return self._grant(answer)
        if isinstance(answer, Refusal):
            return answer
        self._waiting[ticket] = on_answer
        self._arm_queue_timer()
        return None

    def cancel(self, ticket: Hashable) -> None:
        """A waiting request left."""
        if self._waiting.pop(ticket, None) is not None:
            self.balancer.cancel(ticket)

    def release(self, grant: Grant) -> None:
        """The attempt on ``grant`` ended (the stream, or a failed try)."""
        self._forget(self.balancer.release(grant.address))
        self._answer_queue()

    def report(self, grant: Grant, ok: bool) -> None:
        """How the attempt on ``grant`` went before its first byte: ok = its head came, not a 5xx."""
        if ok:
            self.balancer.attempt_succeeded(grant.address)
        elif self.balancer.attempt_failed(grant.address, asyncio.get_running_loop().time()):
            logger.warning("upstream %s ejected after %d failures in a row", grant.address,
                           self._config.outlier_consecutive_failures)

    def drain(self, address: str, draining: bool = True) -> bool:
        """Stop (or resume) new streams to ``address``; False if there is no such pod."""
        found = self.balancer.drain(address, draining)
        if found:
            logger.info("upstream %s %s", address, "draining" if draining else "undrained")
            self._answer_queue()
        return found

    def find(self, text: str) -> str | None:
        """The pod an operator means: its address, or its ``host:port``."""
        for pod in self.balancer.pods:
            if text in (pod.address, pod.address.split("://", 1)[-1]):
                return pod.address
        return None

    def describe(self) -> dict[str, Any]:
        """The ``GET /upstreams`` body."""
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            now = 0.0
        return self.balancer.describe(now)

    def _answer_queue(self) -> None:
        if not self._waiting:
            return
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            return
        for ticket, answer in self.balancer.grants(now):
            callback = self._waiting.pop(ticket, None)
            if callback is None:
                if isinstance(answer, Pick):  # nobody left to take it
                    self.balancer.release(answer.address)
                continue
            callback(self._grant(answer) if isinstance(answer, Pick) else answer)
        self._arm_queue_timer()

    def _arm_queue_timer(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None
        deadline = self.balancer.next_deadline()
        if deadline is not None:
            self._queue_timer = asyncio.get_running_loop().call_at(deadline, self._answer_queue)

    @property
    def upstreams(self) -> list[Upstream]:
        """The pools made so far, one per pod that had traffic."""
        return list(self._upstreams.values())

    def connected(self, address: str) -> bool | None:
        """How the last connect to ``address`` went; None = none tried yet (see :mod:`.probes`)."""
        upstream = self._upstreams.get(address)
        return None if upstream is None else upstream.counters.connected

    def resent(self, address: str) -> int:
        """Requests to ``address`` re-sent after a reused connection failed (see :mod:`.attempt`)."""
        upstream = self._upstreams.get(address)
        return 0 if upstream is None else upstream.counters.resent

    @property
    def names(self) -> list[str]:
        """The addresses of the pods in the set now."""
        return [pod.address for pod in self.balancer.pods if not pod.removed]

    @property
    def timeouts(self) -> dict[str, float | None]:
        # Only connecting has a driver timeout: how long the upstream may take
        # to answer, and to keep answering, is the wire core's business.
        # One dict for every request (only read).
        return self._timeouts

    def send_abort(self, request_id: str, upstream: str = "") -> None:
        """Fire the explicit abort call (``--abort-url``) in the background; best effort
        (:class:`~tokenwire.sidecar.upstream.abort.AbortClient`)."""
        self._aborts.send(request_id, upstream)

    async def aclose(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self._aborts.aclose()
        for upstream in self._upstreams.values():
            await upstream.pool.aclose()
        await self._probes.aclose()
