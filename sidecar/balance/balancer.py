"""The balancer: the pod set, the policy, the health rules and the wait queue.

Theory of operation
-------------------
Sans-IO: the driver (``tokenwire.sidecar.upstream.pools``) tells it what happened
(members listed, a stream started or ended on a pod, an attempt failed before
its first byte, a health check's result, a load reading, an operator's
drain, time passing) and asks it where a stream goes. It never sleeps and
never reads a clock: every call takes ``now``.

A request asks with :meth:`Balancer.request`, naming the pods that already
failed it (a retry goes to a different pod when there is one). The answer is
one of

* :class:`Pick`: the pod; its open-stream count is already taken (hand it
  back with :meth:`release` when the stream ends);
* :class:`Refusal`: no pod can take it, with why. ``ALL_DOWN`` (no pod is
  available: unhealthy, ejected, drained or none listed) comes at once, not
  after a timeout; ``QUEUE_FULL`` when every available pod is at
  ``max_streams_per_upstream`` and the wait queue holds ``queue_max``;
* :data:`QUEUED`: every available pod is full and the request waits in a FIFO
  queue for up to ``queue_timeout_s``.

Whatever frees a slot or changes availability returns nothing itself; the
driver then calls :meth:`grants`, which answers queued requests in order:
a :class:`Pick` for as many as there are free slots, a ``ALL_DOWN``
:class:`Refusal` for all of them when no pod is left, a ``QUEUE_TIMEOUT``
refusal for those past their time (:meth:`next_deadline` says when to ask).
While a request waits its client sees what any slow upstream gives it: the
wire core's commit deadline and heartbeats.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from .load import LoadSample
from .pods import HealthSettings, PodState
from .policies import Policy, build_policy


class RefusalReason(StrEnum):
    ALL_DOWN = "all_down"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"


@dataclass(frozen=True, slots=True, init=False)
class Pick:
    """Where a stream goes."""

    address: str
    reason: str

    def __init__(self, address: str, reason: str) -> None:
        # Written out, not generated (a compiled init: see sse.py's SSEEvent).
        object.__setattr__(self, "address", address)
        object.__setattr__(self, "reason", reason)


@dataclass(frozen=True, slots=True)
class Refusal:
    """No pod takes the stream."""

    reason: RefusalReason
    retry_after_s: int
    """What the 503's ``Retry-After`` says."""

    @property
    def message(self) -> str:
        if self.reason is RefusalReason.ALL_DOWN:
            return "no upstream is available (every one is unhealthy, ejected or draining)"
        if self.reason is RefusalReason.QUEUE_FULL:
            return "every upstream is at its stream limit and the wait queue is full"
        return "every upstream stayed at its stream limit for the whole queue timeout"


class _Queued:
    __slots__ = ()

    def __repr__(self) -> str:
        return "QUEUED"


QUEUED: Final = _Queued()


@dataclass(frozen=True, slots=True)
class BalanceSettings:
    """The balancer's configuration (``SidecarConfig``'s balancing keys)."""

    policy: str = "least-outstanding"
    max_streams_per_upstream: int = 0
    """0 = no limit, no queue."""
    queue_max: int = 1000
    queue_timeout_s: float = 30.0
    prefix_affinity_load_factor: float = 2.0
    prefix_affinity_min_streams: int = 8
    load_stale_after_s: float = 3.0
    health: HealthSettings = field(default_factory=HealthSettings)
    retry_after_s: int = 1
    """Retry-After of a refusal."""


@dataclass(slots=True)
class _Waiter:
    key: bytes | None
    exclude: frozenset[str]
    deadline: float


class Balancer:
    """See the module docstring."""

    def __init__(self, settings: BalanceSettings, *, rng: random.Random | None = None) -> None:
        self.settings = settings
        self._rng = rng if rng is not None else random.Random()
        self.policy: Policy = build_policy(settings.policy, self._rng,
                                           load_factor=settings.prefix_affinity_load_factor,
                                           stale_after_s=settings.load_stale_after_s,
                                           min_streams=settings.prefix_affinity_min_streams)
        self._pods: dict[str, PodState] = {}
        self._queue: OrderedDict[Hashable, _Waiter] = OrderedDict()
        self.queue_timeouts = 0
        self.queue_refusals = 0

    # ------------------------------------------------------------ membership

    @property
    def pods(self) -> list[PodState]:
        return list(self._pods.values())

    def pod(self, address: str) -> PodState | None:
        return self._pods.get(address)

    def set_members(self, members: Mapping[str, int]) -> tuple[list[str], list[str]]:
        """The set is now ``members`` (address -> weight); (added, dropped).

        A pod no longer listed is *removed*: no new streams, its open ones
        finish; it is dropped (and reported so, for its connections to be
        closed) once it has none. A listed pod that was removed comes back."""
        added: list[str] = []
        for address, weight in members.items():
            pod = self._pods.get(address)
            if pod is None:
                self._pods[address] = PodState(address, weight)
                added.append(address)
            else:
                pod.weight = weight
                pod.removed = False
        for address, pod in self._pods.items():
            if address not in members:
                pod.removed = True
        return added, self._collect()

    def _collect(self) -> list[str]:
        dropped = [address for address, pod in self._pods.items() if pod.removed and not pod.open_streams]
        for address in dropped:
            del self._pods[address]
        return dropped

    def drain(self, address: str, draining: bool = True) -> bool:
        """An operator's drain (or undrain); False if there is no such pod."""
        pod = self._pods.get(address)
        if pod is None:
            return False
        pod.draining = draining
        return True

    # ------------------------------------------------------------ picking

    def _available(self, now: float) -> list[PodState]:
        return [pod for pod in self._pods.values() if pod.available(now)]

    def _try_pick(self, key: bytes | None, exclude: frozenset[str],
                  available: Sequence[PodState], now: float) -> tuple[PodState, str] | None:
        limit = self.settings.max_streams_per_upstream
        untried = [pod for pod in available if pod.address not in exclude] or list(available)
        free = [pod for pod in untried if pod.free(limit)]
        if not free:
            return None
        return self.policy.pick(free, available, key, now)

    def request(self, ticket: Hashable, *, key: bytes | None = None,
                exclude: frozenset[str] = frozenset(), now: float) -> Pick | Refusal | _Queued:
        """Where a new stream (or a retry, ``exclude`` naming the pods that
        failed it) goes; see the module docstring. ``ticket`` names a queued
        request in :meth:`grants` and :meth:`cancel`."""
        available = self._available(now)
        if not available:
            return self._refuse(RefusalReason.ALL_DOWN)
        if not self._queue:
            picked = self._try_pick(key, exclude, available, now)
            if picked is not None:
                return self._take(*picked)
        if self.settings.max_streams_per_upstream <= 0:
            # Unreachable without a limit (some pod is always free); kept for clarity.
            return self._refuse(RefusalReason.QUEUE_FULL)
        if len(self._queue) >= self.settings.queue_max:
            self.queue_refusals += 1
            return self._refuse(RefusalReason.QUEUE_FULL)
        self._queue[ticket] = _Waiter(key, exclude, now + self.settings.queue_timeout_s)
        return QUEUED

    def _refuse(self, reason: RefusalReason) -> Refusal:
        return Refusal(reason, self.settings.retry_after_s)

    def _take(self, pod: PodState, reason: str) -> Pick:
        pod.open_streams += 1
        pod.requests += 1
        pod.sent_since_load += 1
        pod.last_pick_reason = reason
        pod.picks[reason] += 1
        return Pick(pod.address, reason)

    def cancel(self, ticket: Hashable) -> None:
        """A queued request left (its client went away)."""
        self._queue.pop(ticket, None)

    def grants(self, now: float) -> list[tuple[Hashable, Pick | Refusal]]:
        """Answers for queued requests (see the module docstring), in queue order."""
        answers: list[tuple[Hashable, Pick | Refusal]] = []
        if not self._queue:
            return answers
        for ticket, waiter in list(self._queue.items()):
            if now >= waiter.deadline:
                del self._queue[ticket]
                self.queue_timeouts += 1
                answers.append((ticket, self._refuse(RefusalReason.QUEUE_TIMEOUT)))
        available = self._available(now)
        if not available:
            for ticket in list(self._queue):
                answers.append((ticket, self._refuse(RefusalReason.ALL_DOWN)))
            self._queue.clear()
            return answers
        while self._queue:
            ticket, waiter = next(iter(self._queue.items()))
            picked = self._try_pick(waiter.key, waiter.exclude, available, now)
            if picked is None:
                break  # FIFO: the head waits for a slot; nobody overtakes it
            del self._queue[ticket]
            answers.append((ticket, self._take(*picked)))
        return answers

    def next_deadline(self) -> float | None:
        """When the oldest queued request times out (call :meth:`grants` then)."""
        if not self._queue:
            return None
        return next(iter(self._queue.values())).deadline

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------ outcomes

    def release(self, address: str) -> list[str]:
        """A stream on ``address`` ended; the pods this dropped (removed, now idle)."""
        pod = self._pods.get(address)
        if pod is None:
            return []
        pod.open_streams = max(0, pod.open_streams - 1)
        return self._collect() if pod.removed else []

    def attempt_succeeded(self, address: str) -> None:
        """An attempt on ``address`` got its answer's head (not a 5xx)."""
        pod = self._pods.get(address)
        if pod is not None:
            pod.attempt_succeeded()

    def attempt_failed(self, address: str, now: float) -> bool:
        """An attempt on ``address`` failed before its first byte; True if that ejected it."""
        pod = self._pods.get(address)
        if pod is None:
            return False
        members = [p for p in self._pods.values() if not p.removed]
        ejected_now = sum(1 for p in members if p.ejected(now))
        allowed = math.floor(self.settings.health.outlier_max_ejected_share * len(members) + 1e-9)
        return pod.attempt_failed(now, self.settings.health, may_eject=ejected_now < allowed)

    def health_result(self, address: str, ok: bool) -> bool:
        """An active check's result; True if it changed the pod's health."""
        pod = self._pods.get(address)
        return pod is not None and pod.health_result(ok, self.settings.health)

    def load_result(self, address: str, sample: LoadSample | None, now: float) -> None:
        """A load reading (None: the scrape failed or lacked the figures)."""
        pod = self._pods.get(address)
        if pod is None:
            return
        if sample is not None:
            pod.load = sample
            pod.load_at = now
            pod.sent_since_load = 0

    # ------------------------------------------------------------ admin

    def describe(self, now: float) -> dict[str, Any]:
        """The ``GET /upstreams`` body."""
        return {"policy": self.settings.policy, "queue_depth": len(self._queue),
                "queue_timeouts": self.queue_timeouts, "queue_refusals": self.queue_refusals,
                "upstreams": [pod.describe(now) for pod in self._pods.values()]}
