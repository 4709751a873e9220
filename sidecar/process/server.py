"""The sidecar process: listeners, signals, graceful shutdown.

:class:`Sidecar` can run in-process (tests, benchmarks: ``await start()``,
``await shutdown()``) or as the ``tokenwire sidecar`` command (:func:`run`),
which adds uvloop, signal handlers and the ready line.

Shutdown (SIGTERM or :meth:`Sidecar.request_stop`): stop accepting, close idle
keep-alive connections, let open streams finish for ``drain_s``, then feed
``StopRequested(shutdown)`` to the rest (they end with an in-band ``shutdown``
error), wait briefly for those last bytes to go out, and exit 0.

With resume on and a store other replicas share (Redis: not the memory
store), the drain hands the open streams off instead of letting their clients
wait: every exchange is fed ``HandOff(drain end)``, so the core closes each
client once it holds an event id (the body cut without its terminal event, so
it reconnects, through the load balancer, to a replica that is not draining,
which serves it from the store), while this process keeps reading each
stream's upstream into the store until it ends or the drain runs out. The
clients are gone in a moment; the process exits once those streams have ended
(or at ``drain_s``): until then it is what generates them. Without a shared
store (or resume off) the drain is the plain one above.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import resource
import signal
import socket
import ssl
import sys
from collections.abc import Callable
from typing import TextIO

from opentelemetry.trace import TracerProvider
from tokenwire.middleware import ConfigError, EndReason, RetryBudget
from tokenwire.middleware.core.resume import CallerKey
from tokenwire.middleware.process.tracing import get_tracer, tracer_provider_from_env
from tokenwire.middleware.shared.open_store import open_replay_store
from tokenwire.middleware.shared.replay_store import MemoryReplayStore

from ..context import SidecarContext
from ..downstream.connection import accepted_peer
from ..downstream.cors import admin_origins
from ..downstream.http2 import StreamRoute
from ..logs import StreamLog
from ..registry import StreamRegistry
from ..settings import SidecarConfig, format_host_port, parse_host_port, read_admin_token
from ..upstream.metrics import UpstreamCollector
from ..upstream.pools import UpstreamPools
from .acceptor import Acceptor, bind_listeners
from .admin import AdminAccess, AdminHandler
from .admin import handler as admin_handler
from .listener import ProtocolSelector
from .metrics import SidecarMetrics
from .readiness import Pingable, StoreWatch
from .tls import alerting_protocol_factory, load_certificates, server_context

# Net allocations between young-generation collections (see serve()).
_YOUNG_GC_THRESHOLD = 10_000

logger = logging.getLogger("tokenwire.sidecar")

# After the shutdown error events are queued, how long the last bytes may take.
_FINAL_FLUSH_S = 2.0
_POLL_S = 0.05


class Sidecar:
    """One sidecar: the proxy listener, the admin listener and what they share."""

    def __init__(self, config: SidecarConfig, *, log: StreamLog | None = None,
                 reuse_port: bool = False, http2_route: StreamRoute | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        """``reuse_port``: bind the proxy port with SO_REUSEPORT (a ``--workers`` worker).
        ``http2_route``: gives some HTTP/2 streams to another handler than the proxy's
        exchange (see ``http2.StreamRoute``).
        ``tracer_provider``: where stream spans go (see ``tokenwire.middleware.process.tracing``);
        None = no tracing."""
        self.config = config
        self._http2_route = http2_route
        self._tracer_provider = tracer_provider
        self._log = log
        self._reuse_port = reuse_port
        self._server: Acceptor | None = None
        self._admin: asyncio.Server | None = None
        self._ssl: ssl.SSLContext | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.context: SidecarContext | None = None
        self._admin_handler: AdminHandler | None = None
        self._store_watch: asyncio.Task[None] | None = None
        self._drain: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind the listeners; after this the sidecar serves requests."""
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # What can refuse to start (the certificate, the address) comes first, so
        # a refusal is the only line a failed start prints.
        if config.tls:
            self._ssl = server_context(config)
        host, port = parse_host_port(config.listen, "listen")
        sockets = await bind_listeners(host, port, backlog=4096, reuse_port=self._reuse_port)
        try:
            await self._start_on(sockets)
        except BaseException:
            # Nothing serves them yet: clients must not queue in their backlog
            # while the failure unwinds (nor a test's listeners leak).
            for sock in sockets:
                sock.close()
            raise

    async def _start_on(self, sockets: list[socket.socket]) -> None:
        """The rest of :meth:`start`, once the proxy's listeners are bound."""
        config = self.config
        loop = asyncio.get_running_loop()
        wire = config.wire
        access: AdminAccess | None = None
        own_origins: tuple[str, ...] = ()
        if config.admin_listen:
            access = AdminAccess(read_admin_token(config), config.metrics_public)
            admin_host, admin_port = parse_host_port(config.admin_listen, "admin_listen")
            # Bound first (serving once all is ready): its port is part of the proxy's
            # CORS list, so the playground it serves can read the proxy's answers.
            self._admin = await asyncio.start_server(
                lambda reader, writer: self._serve_admin(reader, writer),
                admin_host, admin_port, reuse_address=True, start_serving=False)
            bound = self.admin_address
            assert bound is not None
            own_origins = tuple(admin_origins(*bound))
        registry = StreamRegistry()
        context = SidecarContext(
            config=config,
            pools=UpstreamPools(config),
            retry_budget=RetryBudget(ratio=wire.retry_budget_ratio, min_per_s=wire.retry_budget_min_per_s,
                                     now=loop.time()),
            metrics=SidecarMetrics(live=registry.live_records),
            registry=registry,
            tracer=get_tracer(self._tracer_provider),
            log=self._log if self._log is not None else StreamLog.open(config.log_file),
            replay_store=open_replay_store(config.resume_store, wire) if wire.resume else None,
            caller_key=CallerKey.from_config(wire) if wire.resume else None,
            admin_origins=own_origins,
            begin_drain=self.request_drain,
        )
        self.context = context
        context.metrics.registry.register(UpstreamCollector(context.pools))
        await context.pools.start()
        store = context.replay_store
        if isinstance(store, Pingable) and config.ready_requires_store:
            # The first PING before the ready line, so /readyz is true from it.
            watch = StoreWatch(context, store, interval_s=config.health_interval_s,
                               timeout_s=config.health_timeout_s)
            await watch.check()
            self._store_watch = loop.create_task(watch.run())
        # A TLS client that never finishes its handshake (or never sends a byte)
        # gets no more time than a plain one that never finishes its head; the
        # loop's default would hold the socket for 60 s, before the connection
        # (and its timers and connection count) even exists.
        handshake_timeout_s = (config.header_read_timeout_s or None) if self._ssl is not None else None
        route = self._http2_route if self._http2_route is not None else _grpc_route(context)
        tls = self._ssl is not None

        def factory(sock: socket.socket, address: object) -> asyncio.BaseProtocol:
            return ProtocolSelector(context, accepted_peer(context, sock, address, tls=tls), route)

        alerting = (alerting_protocol_factory(factory, self._ssl, handshake_timeout_s)
                    if self._ssl is not None and config.tls_client_ca else None)
        if alerting is not None:
            # mTLS: TLS is terminated by asyncio's protocol (with the handshake
            # alert fix, see tls.py) rather than uvloop's, which has no such fix.
            self._server = Acceptor(sockets, alerting)
        else:
            self._server = Acceptor(sockets, factory, tls=self._ssl,
                                    tls_handshake_timeout_s=handshake_timeout_s)
        self._server.start()
        if self._admin is not None:
            self._admin_handler = admin_handler(context, proxy_address=self.address, access=access)
            await self._admin.start_serving()

    async def _serve_admin(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._admin_handler is not None
        await self._admin_handler(reader, writer)

    @property
    def address(self) -> tuple[str, int]:
        """The proxy's bound (host, port), port 0 resolved."""
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def admin_address(self) -> tuple[str, int] | None:
        if self._admin is None:
            return None
        host, port = self._admin.sockets[0].getsockname()[:2]
        return str(host), int(port)

    def reload_tls(self) -> bool:
        """Reload the certificate files into the live context (SIGHUP); False if that failed."""
        if self._ssl is None:
            return False
        try:
            load_certificates(self._ssl, self.config)
        except ConfigError as error:
            # Keep serving with the old certificate rather than with none.
            logger.error("TLS reload failed, keeping the current certificate: %s", error)
            return False
        logger.info("TLS certificates reloaded")
        return True

    def reload(self) -> None:
        """SIGHUP: reload the certificates and re-read the upstream address files."""
        self.reload_tls()
        if self.context is not None:
            self.context.pools.reload()

    def request_stop(self) -> None:
        """Begin a graceful shutdown (safe from signal handlers; same loop)."""
        if self._stop is not None:
            self._stop.set()

    async def wait_stopped(self) -> None:
        assert self._stop is not None, "not started"
        await self._stop.wait()

    def request_drain(self) -> None:
        """Begin the drain of :meth:`shutdown` without exiting (the admin port's
        ``POST /drain``, from a Kubernetes preStop hook): the listener closes,
        ``/readyz`` says ``draining``, open streams finish or are handed off, and
        the process stays up, its admin port answering, until SIGTERM, whose
        shutdown then finds nothing left to drain. Idempotent."""
        if self._drain is None and self.context is not None:
            self.context.draining = True  # /readyz and GET /drain say so at once
            self._drain = asyncio.get_running_loop().create_task(self._drain_streams(self.context))

    async def shutdown(self) -> None:
        """Graceful shutdown; returns when everything is closed."""
        context = self.context
        if context is None:
            return
        self.request_drain()
        assert self._drain is not None
        await self._drain
        for connection in list(context.connections):
            connection.abort()
        context.departures.run_all()  # the records of clients that just left, before the log closes
        if self._admin is not None:
            self._admin.close()
        await context.pools.aclose()
        if self._store_watch is not None:
            self._store_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._store_watch
        if context.replay_store is not None:
            await context.replay_store.aclose()
        context.log.close()

    async def _drain_streams(self, context: SidecarContext) -> None:
        """Stop taking streams and let the open ones end (the module docstring)."""
        context.draining = True
        loop = asyncio.get_running_loop()
        began = loop.time()
        logger.info("draining: %d open streams on %d connections, for up to %g s",
                    len(context.registry), len(context.connections), self.config.drain_s)
        for listener in list(context.on_drain):
            listener()
        if self._server is not None:
            self._server.close()
            # The connections it took from the backlog, before any is looked at
            # (TLS handshakes are bounded by their own timeout; all by the drain).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.handed_over(), self.config.drain_s)
        for connection in list(context.connections):
            connection.close_if_idle()
        drain_until = began + self.config.drain_s
        store = context.replay_store
        if store is not None and not isinstance(store, MemoryReplayStore):
            # Shared: another replica can serve what this one stores (module docstring).
            handed = context.registry.hand_off(drain_until)
            logger.info("draining: %d open streams offered a hand-off to the replicas sharing the "
                        "resume store", handed)
        while len(context.registry) and loop.time() < drain_until:
            await asyncio.sleep(_POLL_S)
        stopped = context.registry.stop_all(EndReason.SHUTDOWN)
        if stopped:
            logger.info("drain time over: ended %d open streams", stopped)
        else:
            logger.info("drained in %.1f s: every stream ended", loop.time() - began)
        flush_until = loop.time() + _FINAL_FLUSH_S
        while context.connections and loop.time() < flush_until:
            for connection in list(context.connections):
                connection.close_if_idle()
            await asyncio.sleep(_POLL_S)


def _grpc_route(context: SidecarContext) -> StreamRoute | None:
    """gRPC on the HTTP/2 listener (``grpc_gateway``), where the ``grpc`` extra is installed."""
    try:
        # Imported here: it needs protobuf, which the sidecar alone does not.
        from ..grpc_gateway.driver import GrpcRouter
    except ImportError:
        return None
    return GrpcRouter(context)


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft open-file limit towards what ``max_connections`` needs; the new limit.

    Each proxied stream holds two descriptors (client and upstream), so the
    usual soft limit of 1,024 would refuse connections long before
    ``max_connections``. The soft limit goes up to at most the hard limit (which
    only the administrator can raise); a lower result is logged, not fatal.
    """
    wanted = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft < wanted:
        logger.warning("open-file limit %d (hard limit %s) is below the %d that max_connections=%d needs: "
                       "raise the hard limit (`ulimit -Hn %d` as root, LimitNOFILE=%d under systemd, "
                       "--ulimit nofile=%d for a container) or set --max-connections %d",
                       soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, wanted, max_connections,
                       wanted, wanted, wanted, max(1, (soft - 256) // 2))
    return soft


def run(config: SidecarConfig, *, out: TextIO = sys.stdout, reuse_port: bool = False,
        config_file: str | None = None) -> int:
    """Run until SIGTERM/SIGINT (the ``tokenwire sidecar`` command); the exit status.
    ``reuse_port``: this process is one of ``--workers`` (see ``workers.py``);
    ``config_file``: the file the config came from, for the start-up log line."""
    raise_fd_limit(config.max_connections)
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_serve(config, out, reuse_port, config_file))


async def _serve(config: SidecarConfig, out: TextIO, reuse_port: bool, config_file: str | None) -> int:
    provider = tracer_provider_from_env(os.environ, "tokenwire-sidecar")
    sidecar = Sidecar(config, reuse_port=reuse_port, tracer_provider=provider)
    await sidecar.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, sidecar.request_stop)
    loop.add_signal_handler(signal.SIGINT, sidecar.request_stop)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload)
    host, port = sidecar.address
    scheme = "https" if config.tls else "http"
    ready = f"ready listen={format_host_port(host, port)} scheme={scheme}"
    admin = sidecar.admin_address
    if admin is not None:
        ready += f" admin={format_host_port(*admin)}"
    # After the listeners are bound: a start that fails says only why.
    logger.info("started: listening on %s, config %s, upstreams %s", format_host_port(host, port),
                config_file or "(no file)", ", ".join(config.upstream))
    # Everything made so far (modules, config, metrics, pools) lives as long as
    # the process: out of the collector's sight, a full collection walks only
    # what streams made (a shorter stall of the loop: docs/perf/sidecar-http1.md).
    gc.collect()
    gc.freeze()
    # A young-generation pass every 700 net allocations (Python's default)
    # mostly re-walks the open streams' objects made since the last one (what
    # an event allocates dies by reference count), a measurable share of the
    # instructions per event (docs/perf/sidecar-http1.md, "sixth round"). Every
    # 10,000 walks the same objects once where it walked them many times, and
    # one such pass is short next to a stream's events.
    gc.set_threshold(_YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    print(ready, file=out, flush=True)
    await sidecar.wait_stopped()
    await sidecar.shutdown()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()  # the SDK's: exports the spans still batched
    logger.info("exiting")
    return 0
