"""What every connection of one sidecar shares: config, pools, budget, metrics, log, registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Tracer
from tokenwire.middleware import RetryBudget
from tokenwire.middleware.core.dialects import DialectTable
from tokenwire.middleware.core.resume import CallerKey
from tokenwire.middleware.shared.replay_store import ReplayStore

from .exchange.departures import Departures
from .logs import StreamLog
from .process.metrics import SidecarMetrics
from .registry import StreamRegistry
from .settings import SidecarConfig
from .upstream.pools import UpstreamPools

if TYPE_CHECKING:
    from .downstream.connection import OpenConnection


@dataclass(slots=True)
class SidecarContext:
    """Shared services, passed to each connection (no module-level state)."""

    config: SidecarConfig
    pools: UpstreamPools
    retry_budget: RetryBudget
    metrics: SidecarMetrics
    log: StreamLog
    replay_store: ReplayStore | None = None
    """Where resumable streams are kept (``resume = true``), else None."""
    caller_key: CallerKey | None = None
    """Whose stream is whose (see ``tokenwire.middleware.core.resume``); set with the replay store."""
    admin_origins: tuple[str, ...] = ()
    """The admin port's own origins (its playground page), allowed by the proxy's CORS."""
    registry: StreamRegistry = field(default_factory=StreamRegistry)
    tracer: Tracer | None = None
    """Where each stream's span goes (``tokenwire.middleware.process.tracing``); None = tracing off."""
    connections: set[OpenConnection] = field(default_factory=set)
    buffered_body_bytes: int = 0
    """Request body bytes held by all connections now (``max_buffered_body_bytes``)."""
    draining: bool = False
    """Set on shutdown: no new requests; connections close after their current response."""
    store_reachable: bool = True
    """The replay store answered its last PING (``process/readiness.py``'s ``StoreWatch``)."""
    on_drain: list[Callable[[], None]] = field(default_factory=list)
    """Called once when shutdown begins (``draining`` is set): gRPC health watches."""
    begin_drain: Callable[[], None] | None = None
    """Begins the drain without exiting (the admin port's ``POST /drain``); set by the Sidecar."""
    departures: Departures = field(default_factory=Departures)
    """The bookkeeping of departed clients, run after their upstreams are closed."""
    dialects: DialectTable = field(init=False)
    """Which dialect each request path speaks (the config's ``dialect_routes``)."""

    def __post_init__(self) -> None:
        wire = self.config.wire
        self.dialects = DialectTable(wire.dialect_routes, wire.terminal_marker)
        self.metrics.count_open(lambda: len(self.registry), lambda: len(self.connections))
