"""What ``/readyz`` answers: whether this sidecar can take a new stream now.

Theory of operation
-------------------
The admin port's ``/readyz`` is 200 ``{"status":"ready"}`` unless one of these
holds; then it is 503, the body naming each (``{"status":"not_ready",
"reasons":[{"code":…,"message":…}]}``):

* ``draining``: SIGTERM came; the body is ``{"status":"draining"}`` alone.
* ``no_upstream``: the set is empty (a ``dns+http://`` name that resolves to
  nothing, an empty address file) or every pod in it is drained or ejected.
* ``no_healthy_upstream`` (``health_path`` set): no pod is in by its health
  checks. A pod is in from its first passed check (the first check runs at
  start-up, so the ready line already knows) until
  ``health_unhealthy_threshold`` checks in a row fail; one that fell out is
  back after ``health_healthy_threshold`` passes (:mod:`~tokenwire.sidecar.balance.pods`).
* ``upstreams_unreachable`` (health checks off): the last connect to every
  pod failed, an attempt's or a connect probe's
  (:meth:`~tokenwire.sidecar.upstream.probes.Probes.check_connects`: a pod
  that failed is connected to every ``health_interval_s`` until it answers,
  as a sidecar out of its Service gets no traffic to learn from). Without
  checks nothing is known of a pod before its first connect, so a sidecar
  starts ready, and a connect says the engine listens, not that it can
  generate: set ``health_path`` (``/readyz`` on the tokenwire engine,
  ``/health`` on vLLM) for readiness that knows before the first request.
* ``resume_store_unreachable`` (resume on, a store that answers ``ping``: the
  Redis one): the last PING, sent every ``health_interval_s`` by
  :class:`StoreWatch`, failed or took over ``health_timeout_s``. Streams would
  get ids no replica could resume.

``ready_requires_upstream = false`` drops the two upstream conditions,
``ready_requires_store = false`` the store's (draining always counts).
Everything is read from state the pools and the store watch keep already:
nothing on a request's path pays for it, and ``/readyz`` itself does no I/O.
``/healthz`` stays liveness only (200 while the process runs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..balance import PodState

if TYPE_CHECKING:
    from ..context import SidecarContext

logger = logging.getLogger("tokenwire.sidecar")


@dataclass(frozen=True, slots=True)
class NotReady:
    """One reason ``/readyz`` is 503."""

    code: str
    """``no_upstream``, ``no_healthy_upstream``, ``upstreams_unreachable``, ``resume_store_unreachable``."""
    message: str


@dataclass(frozen=True, slots=True)
class Readiness:
    """``/readyz``'s verdict."""

    reasons: tuple[NotReady, ...] = ()
    draining: bool = False

    @property
    def ready(self) -> bool:
        return not self.draining and not self.reasons

    @property
    def status(self) -> int:
        """The HTTP status ``/readyz`` answers."""
        return 200 if self.ready else 503

    def body(self) -> dict[str, object]:
        """The JSON body ``/readyz`` answers."""
        if self.draining:
            return {"status": "draining"}
        if not self.reasons:
            return {"status": "ready"}
        return {"status": "not_ready",
                "reasons": [{"code": reason.code, "message": reason.message} for reason in self.reasons]}


def upstream_reason(pods: Sequence[PodState], connected: Callable[[str], bool | None], *,
                    health_path: str, now: float) -> NotReady | None:
    """Why no upstream can take a stream (see the module docstring), or None when one can.
    ``connected``: how the last connect to a pod went (None: none tried)."""
    members = [pod for pod in pods if not pod.removed]
    if not members:
        return NotReady("no_upstream", "no upstream is listed")
    available = [pod for pod in members if pod.available(now)]
    if health_path:
        if any(pod.health_passed for pod in available):
            return None
        if any(not pod.draining and not pod.ejected(now) for pod in members):
            return NotReady("no_healthy_upstream",
                            f"no upstream is healthy: none of {len(members)} passes GET {health_path}")
    else:
        if any(connected(pod.address) is not False for pod in available):
            return None
        if available:
            return NotReady("upstreams_unreachable",
                            f"the last connect to every upstream failed ({len(available)})")
    return NotReady("no_upstream", f"every upstream is drained or ejected ({len(members)})")


STORE_UNREACHABLE = NotReady("resume_store_unreachable", "the resume store does not answer its PING")


def readiness(context: SidecarContext, now: float) -> Readiness:
    """``/readyz``'s verdict for ``context`` at loop time ``now``."""
    if context.draining:
        return Readiness(draining=True)
    config = context.config
    reasons: list[NotReady] = []
    if config.ready_requires_upstream:
        reason = upstream_reason(context.pools.balancer.pods, context.pools.connected,
                                 health_path=config.health_path, now=now)
        if reason is not None:
            reasons.append(reason)
    if config.ready_requires_store and context.replay_store is not None and not context.store_reachable:
        reasons.append(STORE_UNREACHABLE)
    return Readiness(tuple(reasons))


@runtime_checkable
class Pingable(Protocol):
    """A replay store that can say whether it is reachable (the Redis one)."""

    async def ping(self) -> bool:
        """True when the store answers now."""
        ...


class StoreWatch:
    """PINGs the resume store every ``interval_s`` and keeps the answer in
    ``context.store_reachable`` (see the module docstring)."""

    def __init__(self, context: SidecarContext, store: Pingable, *, interval_s: float,
                 timeout_s: float) -> None:
        self._context = context
        self._store = store
        self._interval_s = interval_s
        self._timeout_s = timeout_s

    async def check(self) -> bool:
        """One PING, bounded by ``timeout_s``; the answer is kept (and a change logged)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                reachable = await self._store.ping()
        except TimeoutError:
            reachable = False
        if reachable != self._context.store_reachable:
            if reachable:
                logger.warning("resume store reachable again: /readyz no longer names it")
            else:
                logger.error("resume store unreachable (PING failed): /readyz answers 503")
        self._context.store_reachable = reachable
        return reachable

    async def run(self) -> None:
        """PING every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception:
                logger.exception("resume store check failed")
