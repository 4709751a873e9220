"""One pod's state as this sidecar sees it, and its health rules.

Theory of operation
-------------------
A pod is *available* (new streams may go to it) unless one of four things
holds, each its own small machine:

* **membership**: it was removed from the set (DNS or the address file no
  longer lists it) or an operator drained it. Either way its open streams
  finish; a removed pod is forgotten once it has none.
* **active health**: with ``health_path`` set, a check every
  ``health_interval_s``. ``health_unhealthy_threshold`` failures in a row
  take the pod out, ``health_healthy_threshold`` successes in a row put it
  back. A pod starts healthy (no check has said otherwise yet); one that has
  never passed a check goes in on its first pass (an engine still loading its
  model at start-up has no flapping to damp), so readiness follows within one
  interval of its coming up.
* **passive outlier ejection**: ``outlier_consecutive_failures`` failures in
  a row *before the first byte* (a refused connection, a 5xx status, no
  answer in time) eject it for ``outlier_base_ejection_s`` x 2^(k-1), the k-th
  ejection without a success in between, at most ``outlier_max_ejection_s``;
  the ejection ends by itself. At most ``outlier_max_ejected_share`` of the
  set (rounded down) is ejected at once: a failure that would pass the share
  is counted but ejects nothing, so passive signals alone never take out the
  last pods (a set of one is never ejected; its active check can still take
  it out).
* **capacity**: ``max_streams_per_upstream`` open streams from this sidecar
  (0 = no limit); a full pod is available but not free.

Everything here takes ``now``; nothing sleeps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .load import LoadSample


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """The health and ejection rules (see the module docstring)."""

    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    outlier_consecutive_failures: int = 5
    """0 = no passive ejection."""
    outlier_base_ejection_s: float = 10.0
    outlier_max_ejection_s: float = 300.0
    outlier_max_ejected_share: float = 0.5


@dataclass(slots=True)
class PodState:
    """One pod: counters, health, load, as :class:`~.balancer.Balancer` keeps them."""

    address: str
    weight: int = 1
    open_streams: int = 0
    requests: int = 0
    failures: int = 0
    """Attempts that failed before their first byte, all time."""
    ejections: int = 0
    draining: bool = False
    removed: bool = False
    healthy: bool = True
    health_passed: bool = False
    """A check has passed since the pod joined the set (``/readyz`` asks for one)."""
    health_checks_failed: int = 0
    _health_streak: int = 0
    """Consecutive check results against the current state (successes while out, failures while in)."""
    consecutive_failures: int = 0
    ejected_until: float | None = None
    ejection_streak: int = 0
    load: LoadSample | None = None
    load_at: float | None = None
    sent_since_load: int = 0
    """Streams this sidecar sent since the last load reading (the reading does not know them yet)."""
    last_pick_reason: str = ""
    picks: Counter[str] = field(default_factory=Counter)

    def ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until

    def available(self, now: float) -> bool:
        """May new streams go here (whatever its capacity)."""
        return not self.draining and not self.removed and self.healthy and not self.ejected(now)

    def free(self, max_streams: int) -> bool:
        return max_streams <= 0 or self.open_streams < max_streams

    # ---------------------------------------------------------- active health

    def health_result(self, ok: bool, settings: HealthSettings) -> bool:
        """One active check's result; True if it changed ``healthy``."""
        if not ok:
            self.health_checks_failed += 1
        elif not self.health_passed:
            self.health_passed = True
            if not self.healthy:
                self.healthy = True
                self._health_streak = 0
                return True
        if ok == self.healthy:
            self._health_streak = 0
            return False
        self._health_streak += 1
        threshold = settings.healthy_threshold if ok else settings.unhealthy_threshold
        if self._health_streak < max(1, threshold):
            return False
        self.healthy = ok
        self._health_streak = 0
        if ok:
            # Back from an outage: its old passive record says nothing now.
            self.consecutive_failures = 0
            self.ejected_until = None
        return True

    # ---------------------------------------------------------- passive ejection

    def attempt_succeeded(self) -> None:
        """An attempt got a non-5xx answer."""
        self.consecutive_failures = 0
        self.ejection_streak = 0

    def attempt_failed(self, now: float, settings: HealthSettings, *, may_eject: bool) -> bool:
        """An attempt failed before its first byte; True if this ejected the pod.
        ``may_eject``: the set's ejected share leaves room for one more."""
        self.failures += 1
        self.consecutive_failures += 1
        threshold = settings.outlier_consecutive_failures
        if threshold <= 0 or self.consecutive_failures < threshold or self.ejected(now) or not may_eject:
            return False
        self.ejection_streak += 1
        self.ejections += 1
        self.consecutive_failures = 0
        duration_s = min(settings.outlier_base_ejection_s * 2 ** (self.ejection_streak - 1),
                         settings.outlier_max_ejection_s)
        self.ejected_until = now + duration_s
        return True

    # ---------------------------------------------------------- admin

    def state_name(self, now: float) -> str:
        if self.removed:
            return "removed"
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        if self.ejected(now):
            return "ejected"
        return "up"

    def describe(self, now: float) -> dict[str, Any]:
        """The ``GET /upstreams`` entry."""
        load = self.load
        load_age_s = None if self.load_at is None else round(now - self.load_at, 3)
        return {
            "address": self.address,
            "weight": self.weight,
            "state": self.state_name(now),
            "open_streams": self.open_streams,
            "requests": self.requests,
            "failures": self.failures,
            "ejections": self.ejections,
            "ejected_for_s": round(self.ejected_until - now, 3) if self.ejected(now)
            and self.ejected_until is not None else 0.0,
            "health_checks_failed": self.health_checks_failed,
            "load": None if load is None else {"waiting": load.waiting, "running": load.running,
                                               "cache_use": load.cache_use,
                                               "age_s": load_age_s},
            "last_pick_reason": self.last_pick_reason,
            "picks": dict(self.picks),
        }
