"""The upstream side: the pod set, their connection pools, one attempt at a time.

Theory of operation
-------------------
:class:`UpstreamPools` is the driver of the balancing core
(:mod:`tokenwire.sidecar.balance`): it lists the pods (the ``upstream``
entries, address files re-read on change and SIGHUP, names re-resolved every
``upstream_refresh_s``), runs the active health checks and the load scrapes,
arms the wait queue's timer, and gives each attempt the pod the balancer
picked (:meth:`UpstreamPools.request`), or its refusal. It decides nothing:
which pod, when a pod is out, who waits, all are the balancer's answers.

Each pod (``http://host:port[/prefix]`` or ``unix:/path``) gets its
connection pool (:class:`~tokenwire.sidecar.upstream.pool.UpstreamPool` of
the sidecar's own HTTP/1.1 connections), made on its first attempt and closed
when it leaves the set with no stream open. An *attempt* is one upstream
request, run as a task by :func:`run_attempt`; it reports what happened as
wire-core inputs through a callback and never decides anything itself.

A completed response is read to its end, so its connection goes back to the
pool (keep-alive), but only if it ended exactly where its framing says
(nothing after a HEAD/204/304 head, the ``Content-Length`` and no more, the
chunked terminator and no more, a head that allowed keep-alive); anything
else closes it. A chunked body is read by
:class:`~tokenwire.sidecar.upstream.body.ChunkedBodyReader`, all the chunks of
a socket read at once. An aborted attempt is cancelled: a connection whose
response was not read to its end is closed, not pooled, so an aborted
stream's connection is never reused. Nothing below retries; retrying is the
wire core's decision (``RetryUpstream``).

One re-send happens below the core, because it is not a failure of the
upstream but of the connection: a request that went out on a *reused*
keep-alive connection and failed before any byte of answer came back (the
upstream closed that idle connection just as the request was sent, a race
every keep-alive client has) is sent once more, on the connection the pool
gives next (:func:`_send`); the core sees one attempt. As nginx's
``proxy_next_upstream error`` on a cached connection, it is done only for a
request that may reach the upstream twice (an idempotent method or an
``Idempotency-Key``: :func:`~tokenwire.middleware.core.retry.may_repeat`, the
core's own rule) or none of which was written: the upstream may have read a
POST before it closed, and one more generation is not ours to start.

The connections (:class:`~tokenwire.sidecar.upstream.conn.UpstreamConnection`)
write the request head and read the response head themselves, by h11's
rules (:mod:`~tokenwire.sidecar.upstream.head`: why a client of our own);
their bytes move through :mod:`~tokenwire.sidecar.upstream.transport`. httpcore is
still the client of the health checks, load scrapes and abort calls (a
few requests a second at most), and its exception types name the
failures of both. Exceptions are converted once, here, into :class:`FailureKind`.

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
import os
import random
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpcore
from tokenwire.middleware import (
    ConfigError,
    FailureKind,
    Input,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
)
from tokenwire.middleware.core.retry import may_repeat

from ..balance import (
    Balancer,
    BalanceSettings,
    HealthSettings,
    Pick,
    Refusal,
    SourceKind,
    UpstreamSpec,
    metric_names,
    parse_address_file,
    parse_load,
    parse_spec,
    prefix_key,
)
from ..settings import SidecarConfig
from ..tasks import spawn
from .conn import Origin, UpstreamConnection
from .head import CHUNKED, ResponseHead
from .pool import UpstreamPool
from .transport import UpstreamBackend, UpstreamStream

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# The most a body read takes at once (all that is buffered, up to this).
_BODY_READ_BYTES = 256 * 1024
# Pods are http:// (or unix:): the port a Host header leaves out.
_HTTP_PORT = 80

_FAILURE_KINDS: tuple[tuple[type[Exception], FailureKind], ...] = (
    (httpcore.ConnectTimeout, FailureKind.CONNECT),
    (httpcore.PoolTimeout, FailureKind.CONNECT),
    (httpcore.ConnectError, FailureKind.CONNECT),
    (httpcore.UnsupportedProtocol, FailureKind.CONNECT),
    (httpcore.TimeoutException, FailureKind.TIMEOUT),
    (httpcore.NetworkError, FailureKind.PROTOCOL),
    (httpcore.ProtocolError, FailureKind.PROTOCOL),
)


# How a request on a connection the upstream had closed fails (a timeout is not that).
_STALE_CONNECTION_ERRORS = (httpcore.ReadError, httpcore.WriteError, httpcore.RemoteProtocolError)


def failure_kind(error: Exception) -> FailureKind:
    """How an httpcore exception maps onto the wire core's failure kinds."""
    for exc_type, kind in _FAILURE_KINDS:
        if isinstance(error, exc_type):
            return kind
    return FailureKind.PROTOCOL


class UpstreamCounters:
    """What the attempts on one upstream count, for the metrics."""

    __slots__ = ("resent",)

    def __init__(self) -> None:
        self.resent = 0
        """Requests re-sent after a reused connection failed before any answer (see :func:`_send`)."""


@dataclass(frozen=True, slots=True)
class Upstream:
    """One configured upstream and its connection pool."""

    name: str
    """As configured, e.g. ``http://127.0.0.1:8000`` or ``unix:/run/engine.sock``."""
    scheme: bytes
    host: bytes
    port: int | None
    path_prefix: bytes
    pool: UpstreamPool
    counters: UpstreamCounters = field(default_factory=UpstreamCounters, init=False, repr=False,
                                       compare=False)

    def url(self, target: bytes) -> httpcore.URL:
        """The URL of ``target`` on this pod (for the health and load probes)."""
        return httpcore.URL(scheme=self.scheme, host=self.host, port=self.port,
                            target=self.path_prefix + target)


@dataclass(frozen=True, slots=True)
class Grant:
    """A pod given to one attempt: hand it back with :meth:`UpstreamPools.release`."""

    upstream: Upstream
    reason: str
    """Why the policy chose it (``least-outstanding``, ``prefix-affinity:overloaded``...)."""

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
        self._connect_timeout_s = config.upstream_connect_timeout_s
        self._timeouts: dict[str, float | None] = {
            "connect": self._connect_timeout_s, "pool": self._connect_timeout_s}
        self._abort_url = config.abort_url
        self._abort_pool: httpcore.AsyncConnectionPool | None = None
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self.balancer = Balancer(balance_settings(config), rng=rng)
        self._specs = [parse_spec(entry) for entry in config.upstream]
        self._file_members: dict[str, dict[str, int]] = {}
        self._file_stamps: dict[str, tuple[float, int] | None] = {}
        self._dns_members: dict[str, dict[str, int]] = {}
        self._upstreams: dict[str, Upstream] = {}
        self._probe_pools: dict[str, httpcore.AsyncConnectionPool] = {}
        self._backend = UpstreamBackend()
        self._waiting: dict[Hashable, Answer] = {}
        self._queue_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._load_names = metric_names(config.load_metrics, config.load_metric_waiting,
                                        config.load_metric_running, config.load_metric_cache)
        for spec in self._specs:
            if spec.kind is SourceKind.FILE:
                self._read_file(spec.address)
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

    def _members(self) -> dict[str, int]:
        members: dict[str, int] = {}
        for spec in self._specs:
            if spec.kind is SourceKind.STATIC:
                found = {spec.address: spec.weight}
            elif spec.kind is SourceKind.DNS:
                found = self._dns_members.get(spec.address, {})
            else:
                found = self._file_members.get(spec.address, {})
            for address, weight in found.items():
                members[address] = max(weight, members.get(address, 0))
        return members

    def _apply_members(self) -> None:
        added, dropped = self.balancer.set_members(self._members())
        for address in added:
            logger.info("upstream %s added", address)
        self._forget(dropped)
        self._answer_queue()

    def _forget(self, dropped: Sequence[str]) -> None:
        for address in dropped:
            logger.info("upstream %s removed (no open streams left)", address)
            upstream = self._upstreams.pop(address, None)
            probe = self._probe_pools.pop(address, None)
            if upstream is not None or probe is not None:
                self._spawn(self._close_pools(upstream, probe))

    @staticmethod
    async def _close_pools(upstream: Upstream | None, probe: httpcore.AsyncConnectionPool | None) -> None:
        if upstream is not None:
            await upstream.pool.aclose()
        if probe is not None:
            await probe.aclose()

    def _read_file(self, path: str) -> bool:
        """(Re-)read an address file if it changed; True if its members did."""
        try:
            info = os.stat(path)
            stamp: tuple[float, int] | None = (info.st_mtime, info.st_size)
        except OSError:
            stamp = None
        if path in self._file_stamps and self._file_stamps[path] == stamp:
            return False
        self._file_stamps[path] = stamp
        try:
            with open(path, encoding="utf-8") as file:
                specs = parse_address_file(file.read(), path)
        except (OSError, UnicodeDecodeError, ConfigError) as error:
            # Keep serving the last good list rather than none.
            logger.error("upstream file %s not read, keeping its last list: %s", path, error)
            return False
        members: dict[str, int] = {}
        for spec in specs:
            if spec.kind is SourceKind.DNS:
                # A name in the file: resolved with the others on each refresh.
                members.update(self._dns_members.get(spec.address, {}))
                if spec not in self._specs:
                    self._specs.append(spec)
            else:
                members[spec.address] = max(spec.weight, members.get(spec.address, 0))
        changed = members != self._file_members.get(path)
        self._file_members[path] = members
        return changed

    async def _resolve(self, spec: UpstreamSpec) -> bool:
        loop = asyncio.get_running_loop()
        port = int(spec.address.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        try:
            infos = await loop.getaddrinfo(spec.dns_name, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            logger.warning("upstream name %s not resolved, keeping its last addresses: %s",
                           spec.dns_name, error)
            return False
        members = {spec.resolved(str(info[4][0])): spec.weight for info in infos}
        changed = members != self._dns_members.get(spec.address)
        self._dns_members[spec.address] = members
        return changed

    async def refresh(self) -> None:
        """Resolve the names and re-read the files now (SIGHUP, and every ``upstream_refresh_s``)."""
        changed = False
        for spec in list(self._specs):
            if spec.kind is SourceKind.FILE:
                changed = self._read_file(spec.address) or changed
            elif spec.kind is SourceKind.DNS:
                changed = await self._resolve(spec) or changed
        if changed:
            self._apply_members()

    def reload(self) -> None:
        """SIGHUP: re-read the address files at once, changed or not."""
        self._file_stamps.clear()
        self._spawn(self.refresh())

    # ------------------------------------------------------------ background

    async def start(self) -> None:
        """Resolve the names once, then keep the set, health and load up to date."""
        await self.refresh()
        config = self._config
        if any(spec.kind is not SourceKind.STATIC for spec in self._specs):
            self._spawn(self._every(config.upstream_refresh_s, self.refresh))
        if config.health_path:
            self._spawn(self._every(config.health_interval_s, self._check_health))
        if config.balance == "queue-aware":
            self._spawn(self._every(config.load_poll_s, self._poll_load))

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

    def _probe_pool(self, address: str) -> httpcore.AsyncConnectionPool:
        pool = self._probe_pools.get(address)
        if pool is None:
            uds = address[len("unix:"):] if address.startswith("unix:") else None
            pool = httpcore.AsyncConnectionPool(max_connections=2, retries=0, uds=uds,
                                                keepalive_expiry=60.0)
            self._probe_pools[address] = pool
        return pool

    async def _get(self, address: str, path: str) -> tuple[int, bytes] | None:
        """One GET to a pod (a health check or a load scrape); None if it failed or took too long."""
        upstream = self.upstream(address)
        timeout_s = self._config.health_timeout_s
        url = upstream.url(path.encode())
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._probe_pool(address).request(
                    "GET", url, extensions={"timeout": {"connect": timeout_s, "read": timeout_s,
                                                        "write": timeout_s, "pool": timeout_s}})
        except (TimeoutError, httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                httpcore.UnsupportedProtocol):
            return None
        return response.status, response.content

    async def _check_health(self) -> None:
        pods = [pod.address for pod in self.balancer.pods if not pod.removed]

        async def check(address: str) -> None:
            answer = await self._get(address, self._config.health_path)
            ok = answer is not None and 200 <= answer[0] < 300
            if self.balancer.health_result(address, ok):
                logger.warning("upstream %s is %s", address, "healthy again" if ok else "unhealthy")

        await asyncio.gather(*(check(address) for address in pods))
        self._answer_queue()

    async def _poll_load(self) -> None:
        loop = asyncio.get_running_loop()
        pods = [pod.address for pod in self.balancer.pods if not pod.removed]

        async def poll(address: str) -> None:
            answer = await self._get(address, self._config.load_metrics_path)
            sample = None
            if answer is not None and answer[0] == 200:
                sample = parse_load(answer[1].decode("utf-8", "replace"), self._load_names)
            self.balancer.load_result(address, sample, loop.time())

        await asyncio.gather(*(poll(address) for address in pods))

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

    def resent(self, address: str) -> int:
        """Requests to ``address`` re-sent after a reused connection failed (see :func:`_send`)."""
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
        """Fire the explicit abort call (``--abort-url``) in the background; best effort.

        ``request_id`` is the upstream's id for the request, the one it was
        sent (the sidecar's own, never a client's). An ``abort_url`` that is a
        path (``/v1/abort/{request_id}``) goes to ``upstream``, the pod that ran it."""
        if not self._abort_url or (self._abort_url.startswith("/") and not upstream.startswith("http")):
            return
        spawn(self._abort_tasks, self._abort(request_id, upstream))

    async def _abort(self, request_id: str, upstream: str = "") -> None:
        if self._abort_pool is None:
            self._abort_pool = httpcore.AsyncConnectionPool(max_connections=64, retries=0)
        # Percent-encoded whatever it holds: a value must never add a path, query or fragment.
        url = self._abort_url.replace("{request_id}", urllib.parse.quote(request_id, safe=""))
        if url.startswith("/"):
            url = upstream.rstrip("/") + url
        try:
            response = await self._abort_pool.request(
                "POST", url, headers=[(b"content-length", b"0")],
                extensions={"timeout": {"connect": self._connect_timeout_s, "read": 10.0,
                                        "write": 10.0, "pool": self._connect_timeout_s}})
            if response.status >= 400 and response.status != 404:
                logger.warning("abort call for %s answered %d", request_id, response.status)
        except httpcore.TimeoutException:
            logger.warning("abort call for %s timed out", request_id)
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as error:
            logger.warning("abort call for %s failed: %s", request_id, error)

    async def aclose(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
        for task in list(self._abort_tasks) + list(self._tasks):
            task.cancel()
        for upstream in self._upstreams.values():
            await upstream.pool.aclose()
        for pool in self._probe_pools.values():
            await pool.aclose()
        if self._abort_pool is not None:
            await self._abort_pool.aclose()


async def run_attempt(
    upstream: Upstream,
    *,
    method: bytes,
    target: bytes,
    headers: Sequence[Header],
    body: bytes,
    timeouts: dict[str, float | None],
    readable: asyncio.Event,
    feed: Callable[[Input], None],
    feed_body: Callable[[list[bytes]], None],
    on_connection: Callable[[object], None] | None = None,
) -> None:
    """One upstream request; every outcome is reported through ``feed``.

    ``readable`` is cleared while the wire core wants the upstream paused
    (``PauseUpstream``); TCP then pushes back on the engine. Cancel the task
    to abort: the connection is closed, not pooled. ``on_connection`` gets
    the response's network stream, so an abort can close it without waiting
    for the cancellation to unwind. ``feed_body`` takes the chunks of a
    chunked body, those of one read at once, straight from the socket's
    callback (pause it with the stream's ``pause_delivery``/``resume_delivery``);
    other bodies come through ``feed`` as ``UpstreamData``.
    """
    connection: UpstreamConnection | None = None
    clean = False
    try:
        connection, head = await _send(upstream, method=method, target=target, headers=headers, body=body,
                                       timeouts=timeouts)
        network = connection.stream
        assert network is not None  # connected: it sent a head
        if on_connection is not None:
            on_connection(network)
        feed(UpstreamHeaders(head.status, head.headers))
        framing = head.framing
        if framing == CHUNKED:
            if not readable.is_set():
                network.pause_delivery()
            await network.deliver_chunked(feed_body)
            # One loop turn before the connection goes back to the pool: what
            # the loop read with the last chunk (a client's reset: its
            # connection_lost is queued behind this task's wake-up) runs first,
            # so a connection cut for that client is known as cut when the pool
            # takes it.
            await asyncio.sleep(0)
        elif isinstance(framing, int):
            await _read_length(network, framing, readable, feed)
        elif framing is None:
            await _read_to_close(network, readable, feed)
        # Bytes past the response's framing (a body after a HEAD answer, more
        # than Content-Length said, anything after the last chunk) would be
        # read by the next request on this connection as its answer: then it
        # is closed, not pooled (finish looks at what is buffered).
        clean = head.keep_alive
    except asyncio.CancelledError:
        raise
    except Exception as error:
        feed(UpstreamFailed(failure_kind(error), f"{type(error).__name__}: {error}" if str(error)
                            else type(error).__name__))
        return
    finally:
        if connection is not None:  # _send releases a connection it could not use
            connection.finish(clean)
            upstream.pool.release(connection)
    feed(UpstreamEnded())


async def _send(upstream: Upstream, *, method: bytes, target: bytes, headers: Sequence[Header],
                body: bytes, timeouts: dict[str, float | None]) -> tuple[UpstreamConnection, ResponseHead]:
    """The request sent on a pooled or new connection and its response head
    read, with the one re-send of a request whose reused connection failed
    before any answer (see the module docstring). The caller finishes and
    releases the connection."""
    pool = upstream.pool
    target = upstream.path_prefix + target
    connect_timeout_s = timeouts.get("connect")
    for last_try in (False, True):
        connection = await pool.acquire(timeouts.get("pool"))
        try:
            return connection, await connection.send(method, target, headers, body,
                                                     connect_timeout_s=connect_timeout_s)
        except BaseException as error:
            connection.finish(False)
            pool.release(connection)
            if (last_try or not isinstance(error, _STALE_CONNECTION_ERRORS)
                    or not (connection.requests > 1 and not connection.answered
                            and (not connection.written or may_repeat(method, headers)))):
                raise
            upstream.counters.resent += 1
            # The path without its query, which may hold a credential.
            logger.info("upstream %s: %s %s re-sent: the reused connection it went out on "
                        "failed before any answer (%s: %s)", upstream.name, method.decode("latin-1"),
                        target.partition(b"?")[0].decode("latin-1"), type(error).__name__, error)
    raise AssertionError("unreachable: the last try returns or raises")


async def _read_length(network: UpstreamStream, length: int, readable: asyncio.Event,
                       feed: Callable[[Input], None]) -> None:
    """Read a ``Content-Length`` body: ``length`` bytes, as they come."""
    remaining = length
    while remaining > 0:
        if not readable.is_set():
            await readable.wait()
        data = await network.read(min(remaining, _BODY_READ_BYTES))
        if not data:
            raise httpcore.RemoteProtocolError(
                f"the upstream closed {remaining} bytes before the end of its {length}-byte body")
        remaining -= len(data)
        feed(UpstreamData(data))


async def _read_to_close(network: UpstreamStream, readable: asyncio.Event,
                         feed: Callable[[Input], None]) -> None:
    """Read a body without framing: everything until the upstream closes."""
    while True:
        if not readable.is_set():
            await readable.wait()
        data = await network.read(_BODY_READ_BYTES)
        if not data:
            return
        feed(UpstreamData(data))
