"""When a request may go upstream again: the retry budget, and which requests.

Two questions decide a retry, both here. *May this request be sent twice?*
(:func:`may_repeat`: its method is idempotent or it carries an
``Idempotency-Key``; otherwise only a failure proving nothing was processed
allows it, which ``WireStream`` judges from what the driver reports.) And
*can the proxy afford it?* (the budget below).

A per-stream attempt limit is not enough: when every request fails, each one
retrying twice triples the load on an engine that is already down. Envoy's
answer is a budget shared by all streams of a proxy: retries may be at most
``ratio`` of recent requests, plus a small floor of ``min_per_s`` so a quiet
proxy can still retry at all. It is a token bucket: each request deposits
``ratio`` tokens, time deposits ``min_per_s`` tokens per second, each retry
withdraws one, and the bucket holds at most ``capacity`` so a long quiet spell
cannot save up a burst.

Sans-IO like the rest of the core: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final


class RetryBudget:
    """A token bucket shared by every stream of one driver."""

    __slots__ = ("_tokens", "_updated_at", "capacity", "granted", "min_per_s", "ratio", "refused")

    def __init__(self, *, ratio: float, min_per_s: float, now: float,
                 capacity: float | None = None) -> None:
        if ratio < 0 or min_per_s < 0:
            raise ValueError("ratio and min_per_s must be >= 0")
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.capacity = capacity if capacity is not None else max(1.0, min_per_s) + 100 * ratio
        self._tokens = self.capacity
        self._updated_at = now
        self.granted = 0
        self.refused = 0

    def _refill(self, now: float) -> None:
        elapsed_s = max(0.0, now - self._updated_at)
        self._updated_at = max(self._updated_at, now)
        self._tokens = min(self.capacity, self._tokens + elapsed_s * self.min_per_s)

    def on_request(self, now: float) -> None:
        """A new request arrived: it earns the budget ``ratio`` of a retry."""
        self._refill(now)
        self._tokens = min(self.capacity, self._tokens + self.ratio)

    def try_acquire(self, now: float) -> bool:
        """Take one retry from the budget; False if there is none to take."""
        self._refill(now)
        # The epsilon absorbs float sums: ten deposits of 0.2 make 1.9999999999999998.
        if self._tokens >= 1.0 - 1e-9:
            self._tokens = max(0.0, self._tokens - 1.0)
            self.granted += 1
            return True
        self.refused += 1
        return False

    @property
    def tokens(self) -> float:
        return self._tokens


# RFC 9110 section 9.2.2: methods whose repetition has the effect of one request.
IDEMPOTENT_METHODS: Final = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
IDEMPOTENCY_KEY_HEADER: Final = b"idempotency-key"


def may_repeat(method: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request may be sent to an upstream again after the upstream
    may have read it: its method is idempotent, or the client said so with an
    ``Idempotency-Key`` (header names lower-case).

    A request that may not be repeated is still retried when the failure
    proves the upstream never processed it (see ``WireStream``): nginx's
    ``proxy_next_upstream`` rule for non-idempotent requests, plus a 503.
    """
    if method.upper() in IDEMPOTENT_METHODS:
        return True
    return any(name == IDEMPOTENCY_KEY_HEADER and value.strip() for name, value in headers)
