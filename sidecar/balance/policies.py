"""The balancing policies: which free pod gets the next stream.

Each policy is handed the pods that may take a stream now (``free``: available
and below ``max_streams_per_upstream``; never empty) and the available ones
whatever their capacity (``available``, for the affinity hash, which must not
move when a pod is merely busy), and returns its pick with the reason, a
short label that the metrics and ``GET /upstreams`` show. Randomness comes
from the ``random.Random`` each policy is built with, so tests seed it.

* ``least-outstanding``: power of two choices (Mitzenmacher; Envoy's
  LEAST_REQUEST): two distinct free pods drawn at random, the one with fewer
  open streams from this sidecar per unit of weight wins, a tie is a coin toss.
  Two random candidates instead of the global minimum keep many sidecars that
  share a pod set from all herding onto the same idlest pod.
* ``round-robin``: smooth weighted round robin (nginx's): each pick adds every
  pod's weight to its credit and takes the pod with the most, which then pays
  back the total. Weight 2 gets two turns in three with a weight-1 pod,
  interleaved, never two bursts.
* ``queue-aware``: fewest requests *waiting* in the engine (its last reading
  plus the streams this sidecar sent since, which that reading cannot know),
  then fewest *running*, then lowest KV-cache use, each per unit of weight,
  ties at random. Without a fresh reading for every free pod it falls back to
  least-outstanding for that pick (reason ``no-load-signal``).
* ``prefix-affinity``: weighted rendezvous hashing (highest random weight) of
  the request's prefix key (see ``prefix.py``) over the available pods, a
  consistent hash: removing a pod moves only the keys it held. When that pod
  is not free, or its open streams are at least ``load_factor`` x its fair
  share (its weight's part of all open streams here) and at least
  ``min_streams``, or the request has no key, the pick falls back to
  least-outstanding. The floor keeps noise from spilling prompts: at a few
  streams an engine that batches dozens is not loaded, while each spilled
  request evicts another pod's cached prefix for one that will not come back.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from typing import Final, Protocol

from .pods import PodState

POLICIES: Final = ("least-outstanding", "round-robin", "queue-aware", "prefix-affinity")


class Policy(Protocol):
    name: str

    def pick(self, free: Sequence[PodState], available: Sequence[PodState], key: bytes | None,
             now: float) -> tuple[PodState, str]: ...


def _load(pod: PodState) -> float:
    return pod.open_streams / pod.weight


class LeastOutstanding:
    name = "least-outstanding"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, free: Sequence[PodState], available: Sequence[PodState], key: bytes | None,
             now: float) -> tuple[PodState, str]:
        if len(free) == 1:
            return free[0], "least-outstanding:only"
        first, second = self._rng.sample(range(len(free)), 2)
        a, b = free[first], free[second]
        if _load(a) == _load(b):
            return (a if self._rng.random() < 0.5 else b), "least-outstanding:tie"
        return (a if _load(a) < _load(b) else b), "least-outstanding"


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._credit: dict[str, int] = {}

    def pick(self, free: Sequence[PodState], available: Sequence[PodState], key: bytes | None,
             now: float) -> tuple[PodState, str]:
        credit = self._credit
        total = 0
        best: PodState | None = None
        for pod in free:
            credit[pod.address] = credit.get(pod.address, 0) + pod.weight
            total += pod.weight
            if best is None or credit[pod.address] > credit[best.address]:
                best = pod
        assert best is not None
        credit[best.address] -= total
        if len(credit) > 4 * len(available) + 16:
            # Pods long gone: forget their credit.
            keep = {pod.address for pod in available}
            self._credit = {address: value for address, value in credit.items() if address in keep}
        return best, "round-robin"


class QueueAware:
    name = "queue-aware"

    def __init__(self, rng: random.Random, *, stale_after_s: float) -> None:
        self._rng = rng
        self._fallback = LeastOutstanding(rng)
        self._stale_after_s = stale_after_s

    def pick(self, free: Sequence[PodState], available: Sequence[PodState], key: bytes | None,
             now: float) -> tuple[PodState, str]:
        scores: list[tuple[float, float, float]] = []
        for pod in free:
            load = pod.load
            if load is None or pod.load_at is None or now - pod.load_at > self._stale_after_s:
                chosen, _ = self._fallback.pick(free, available, key, now)
                return chosen, "queue-aware:no-load-signal"
            weight = pod.weight
            scores.append(((load.waiting + pod.sent_since_load) / weight, load.running / weight,
                           load.cache_use or 0.0))
        best = min(scores)
        tied = [pod for pod, score in zip(free, scores, strict=True) if score == best]
        return (tied[0] if len(tied) == 1 else self._rng.choice(tied)), "queue-aware"


def rendezvous_score(key: bytes, pod: PodState) -> float:
    """Weighted highest-random-weight score of ``pod`` for ``key`` (higher wins)."""
    digest = hashlib.blake2b(pod.address.encode() + b"\x00" + key, digest_size=8).digest()
    # A uniform draw in (0, 1); -w / ln(u) gives each pod its weight's share of keys.
    u = (int.from_bytes(digest, "big") + 1) / (2 ** 64 + 2)
    return -pod.weight / math.log(u)


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, rng: random.Random, *, load_factor: float, min_streams: int = 1) -> None:
        self._fallback = LeastOutstanding(rng)
        self._load_factor = load_factor
        self._min_streams = min_streams

    def owner(self, key: bytes, available: Sequence[PodState]) -> PodState:
        """The pod the hash gives ``key`` among ``available``."""
        return max(available, key=lambda pod: rendezvous_score(key, pod))

    def pick(self, free: Sequence[PodState], available: Sequence[PodState], key: bytes | None,
             now: float) -> tuple[PodState, str]:
        if key is None:
            chosen, _ = self._fallback.pick(free, available, key, now)
            return chosen, "prefix-affinity:no-prefix"
        owner = self.owner(key, available)
        if not any(pod is owner for pod in free):
            chosen, _ = self._fallback.pick(free, available, key, now)
            return chosen, "prefix-affinity:owner-full"
        total_open = sum(pod.open_streams for pod in available)
        total_weight = sum(pod.weight for pod in available)
        fair_share = total_open * owner.weight / total_weight
        if owner.open_streams >= max(self._min_streams, self._load_factor * fair_share):
            chosen, _ = self._fallback.pick(free, available, key, now)
            return chosen, "prefix-affinity:overloaded"
        return owner, "prefix-affinity"


def build_policy(name: str, rng: random.Random, *, load_factor: float, stale_after_s: float,
                 min_streams: int = 1) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    if name == "least-outstanding":
        return LeastOutstanding(rng)
    if name == "round-robin":
        return RoundRobin()
    if name == "queue-aware":
        return QueueAware(rng, stale_after_s=stale_after_s)
    if name == "prefix-affinity":
        return PrefixAffinity(rng, load_factor=load_factor, min_streams=min_streams)
    raise ValueError(f"unknown balancing policy {name!r}")
