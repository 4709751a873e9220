"""How many HTTP/2 PINGs a client may send: gRPC's keepalive enforcement.

gRPC clients send PINGs to keep idle connections alive (``keepalive_time``).
A server accepts them at a bounded rate, as gRPC servers do (grpc-go's
``EnforcementPolicy``, grpc-core's ``min_recv_ping_interval_without_data``):
a PING sooner than ``min_ping_interval_s`` after the previous one, or any
PING while no call is open unless ``permit_without_calls``, is a *strike*;
past ``max_ping_strikes`` the connection is ended with GOAWAY
``ENHANCE_YOUR_CALM`` and the debug data ``too_many_pings``, on which gRPC
clients double their keepalive interval. Sending headers or data to the
client forgives the strikes (the connection is in use).

Sans-IO: the HTTP/2 connection calls :meth:`PingPolicy.on_ping` for each PING
it receives (not the ACKs) with the loop time, and :meth:`PingPolicy.on_sent`
when it sends headers or data.
"""

from __future__ import annotations

from dataclasses import dataclass

TOO_MANY_PINGS = b"too_many_pings"
"""GOAWAY debug data gRPC clients recognise."""


@dataclass(frozen=True, slots=True)
class PingLimits:
    """The enforcement policy; the sidecar's ``grpc_keepalive_*`` keys."""

    min_ping_interval_s: float = 300.0
    """PINGs closer together than this are strikes (grpc-go's default, 5 minutes)."""
    max_ping_strikes: int = 2
    """Strikes allowed before GOAWAY too_many_pings."""
    permit_without_calls: bool = False
    """Accept keepalive PINGs on a connection with no open call."""

    def __post_init__(self) -> None:
        if self.min_ping_interval_s < 0:
            raise ValueError("min_ping_interval_s must be >= 0")
        if self.max_ping_strikes < 0:
            raise ValueError("max_ping_strikes must be >= 0")


class PingPolicy:
    """One connection's PING accounting. See the module docstring."""

    def __init__(self, limits: PingLimits) -> None:
        self._limits = limits
        self._last_ping_at: float | None = None
        self.strikes = 0

    def on_ping(self, now: float, *, open_calls: int) -> bool:
        """A PING arrived; True if the connection must now be ended (too many)."""
        limits = self._limits
        last, self._last_ping_at = self._last_ping_at, now
        idle = open_calls == 0 and not limits.permit_without_calls
        if idle or (last is not None and now - last < limits.min_ping_interval_s):
            self.strikes += 1
        return self.strikes > limits.max_ping_strikes

    def on_sent(self) -> None:
        """Headers or data went to the client: the connection is in use."""
        self.strikes = 0
        self._last_ping_at = None
