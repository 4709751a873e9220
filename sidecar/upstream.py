"""The upstream side: httpcore connection pools, one attempt at a time.

Theory of operation
-------------------
Each configured upstream (``http://host:port[/prefix]`` or ``unix:/path``)
gets one :class:`httpcore.AsyncConnectionPool`. An *attempt* is one upstream
request, run as a task by :func:`run_attempt`; it reports what happened as
wire-core inputs through a callback and never decides anything itself.

A completed response is read to its end, so httpcore returns its connection
to the pool (keep-alive), but only if it ended exactly where its framing says
(nothing after a HEAD/204/304 head, the ``Content-Length`` and no more, the
chunked terminator and no more); anything extra closes it. A chunked body is
read by :class:`~tokenwire.sidecar.upstream_body.ChunkedBodyReader`, all the
chunks of a socket read at once, not through httpcore's layers. An aborted
attempt is cancelled: httpcore closes a connection whose response was not
read to the end instead of pooling it, so an aborted stream's connection is
never reused. httpcore's own retries are off;
retrying is the wire core's decision (``RetryUpstream``).

Each upstream's connections are split over ``_POOL_SHARDS`` pools taken in
turn: httpcore's pool re-examines every connection it holds whenever a request
starts or ends (and, for each idle one, counts them all again), which with
hundreds of pooled connections costs milliseconds of event-loop time per
request, and grows with the square of the pool.

The pools use :class:`~tokenwire.sidecar.upstream_io.UpstreamBackend` as their
network layer (see there why).

Exceptions are converted once, here, into :class:`FailureKind`.

Compression: every upstream request asks for ``Accept-Encoding: identity``
(whatever the client sent), because the wire core parses the event stream. An
upstream that compresses an event stream anyway is refused by the core
(``invalid_stream``: 502 before the first byte) rather than decompressed, which
would let a small body expand without bound; a non-stream answer is not parsed
and goes through untouched, ``Content-Encoding`` and all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import httpcore
from tokenwire.middleware import (
    FailureKind,
    Input,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
)

from .settings import SidecarConfig
from .upstream_body import ChunkedBodyReader
from .upstream_io import UpstreamBackend, UpstreamStream

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# The most a body read takes at once (all that is buffered, up to this).
_BODY_READ_BYTES = 256 * 1024
# Pools per upstream, at most (one per 64 allowed connections); see the module docstring.
_POOL_SHARDS = 16

_FAILURE_KINDS: tuple[tuple[type[Exception], FailureKind], ...] = (
    (httpcore.ConnectTimeout, FailureKind.CONNECT),
    (httpcore.PoolTimeout, FailureKind.CONNECT),
    (httpcore.ConnectError, FailureKind.CONNECT),
    (httpcore.UnsupportedProtocol, FailureKind.CONNECT),
    (httpcore.TimeoutException, FailureKind.TIMEOUT),
    (httpcore.NetworkError, FailureKind.PROTOCOL),
    (httpcore.ProtocolError, FailureKind.PROTOCOL),
)


def failure_kind(error: Exception) -> FailureKind:
    """How an httpcore exception maps onto the wire core's failure kinds."""
    for exc_type, kind in _FAILURE_KINDS:
        if isinstance(error, exc_type):
            return kind
    return FailureKind.PROTOCOL


@dataclass(frozen=True, slots=True)
class Upstream:
    """One configured upstream and its pool."""

    name: str
    """As configured, e.g. ``http://127.0.0.1:8000`` or ``unix:/run/engine.sock``."""
    scheme: bytes
    host: bytes
    port: int | None
    path_prefix: bytes
    pools: tuple[httpcore.AsyncConnectionPool, ...]
    _turn: Iterator[httpcore.AsyncConnectionPool] = field(init=False, repr=False, compare=False)
    _released: list[httpcore.AsyncConnectionPool] = field(default_factory=list, init=False, repr=False,
                                                          compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_turn", itertools.cycle(self.pools))

    def next_pool(self) -> httpcore.AsyncConnectionPool:
        """The pool for the next request: the last one a connection went back to
        (so keep-alive connections are reused), else each in turn."""
        return self._released.pop() if self._released else next(self._turn)

    def released(self, pool: httpcore.AsyncConnectionPool) -> None:
        """A response from ``pool`` was read to its end: its connection is idle there."""
        self._released.append(pool)

    def url(self, target: bytes) -> httpcore.URL:
        return httpcore.URL(scheme=self.scheme, host=self.host, port=self.port,
                            target=self.path_prefix + target)


class UpstreamPools:
    """The pools of every configured upstream, in retry order."""

    def __init__(self, config: SidecarConfig) -> None:
        self._connect_timeout_s = config.upstream_connect_timeout_s
        self._abort_url = config.abort_url
        self._abort_pool: httpcore.AsyncConnectionPool | None = None
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self.upstreams: list[Upstream] = [self._build(name, config) for name in config.upstream]

    @staticmethod
    def _build(name: str, config: SidecarConfig) -> Upstream:
        uds: str | None = None
        if name.startswith("unix:"):
            uds = name[len("unix:"):]
            scheme, host, port, prefix = b"http", b"localhost", None, b""
        else:
            url = httpcore.URL(name)
            scheme, host, port = url.scheme, url.host, url.port
            prefix = url.target.rstrip(b"/")
        backend = UpstreamBackend()
        # Small limits keep one pool; the total never exceeds the configured limit.
        shards = max(1, min(_POOL_SHARDS, config.upstream_max_connections // 64))
        per_pool = config.upstream_max_connections // shards
        pools = tuple(httpcore.AsyncConnectionPool(
            max_connections=per_pool,
            max_keepalive_connections=per_pool,
            keepalive_expiry=config.upstream_keepalive_s,
            uds=uds,
            retries=0,
            network_backend=backend,
        ) for _ in range(shards))
        return Upstream(name, scheme, host, port, prefix, pools)

    @property
    def names(self) -> list[str]:
        return [u.name for u in self.upstreams]

    @property
    def timeouts(self) -> dict[str, float | None]:
        # Only connecting has a driver timeout: how long the upstream may take
        # to answer, and to keep answering, is the wire core's business.
        return {"connect": self._connect_timeout_s, "pool": self._connect_timeout_s,
                "read": None, "write": None}

    def send_abort(self, request_id: str) -> None:
        """Fire the explicit abort call (``--abort-url``) in the background; best effort.

        ``request_id`` is the upstream's id for the request, the one it was
        sent (the sidecar's own, never a client's)."""
        if not self._abort_url:
            return
        task = asyncio.get_running_loop().create_task(self._abort(request_id))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def _abort(self, request_id: str) -> None:
        if self._abort_pool is None:
            self._abort_pool = httpcore.AsyncConnectionPool(max_connections=64, retries=0)
        # Percent-encoded whatever it holds: a value must never add a path, query or fragment.
        url = self._abort_url.replace("{request_id}", urllib.parse.quote(request_id, safe=""))
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
        for task in list(self._abort_tasks):
            task.cancel()
        for upstream in self.upstreams:
            for pool in upstream.pools:
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
    on_connection: Callable[[object], None] | None = None,
    feed_body: Callable[[list[bytes]], None] | None = None,
) -> None:
    """One upstream request; every outcome is reported through ``feed``.

    ``readable`` is cleared while the wire core wants the upstream paused
    (``PauseUpstream``); TCP then pushes back on the engine. Cancel the task
    to abort: the connection is closed, not pooled. ``on_connection`` gets
    the response's network stream, so an abort can close it without waiting
    for the cancellation to unwind. ``feed_body``, if given, takes the chunks
    of a chunked body, those of one read at once, straight from the socket's callback
    (pause it with the stream's ``pause_delivery``/``resume_delivery``);
    otherwise they come through ``feed`` as ``UpstreamData``.
    """
    pool = upstream.next_pool()
    reusable = True
    try:
        async with pool.stream(method, upstream.url(target), headers=list(headers),
                               content=body, extensions={"timeout": timeouts}) as response:
            network = response.extensions.get("network_stream")
            if on_connection is not None:
                on_connection(network)
            status = response.status
            response_headers = tuple((k.lower(), v) for k, v in response.headers)
            feed(UpstreamHeaders(status, response_headers))
            framing = _body_framing(method, status, response_headers)
            if isinstance(network, UpstreamStream) and framing == "chunked":
                if feed_body is not None:
                    if not readable.is_set():
                        network.pause_delivery()
                    await network.deliver_chunked(feed_body)
                else:
                    await _read_chunked(network, readable, feed)
                network.end_body()  # h11 ends the message: see upstream_io
            elif isinstance(network, UpstreamStream) and isinstance(framing, int):
                network.limit_reads(framing)
            async for chunk in response.aiter_stream():
                if not readable.is_set():
                    await readable.wait()
                if chunk:
                    feed(UpstreamData(chunk))
            if isinstance(network, UpstreamStream):
                network.limit_reads(None)
                if network.buffered:
                    # Bytes past the response's framing (a body after a HEAD
                    # answer, more than Content-Length said, anything after the
                    # last chunk): the next request on this connection would
                    # read them as its answer. Closed, never pooled.
                    reusable = False
                    network.abort()
    except asyncio.CancelledError:
        raise
    except Exception as error:
        kind = failure_kind(error)
        feed(UpstreamFailed(kind, f"{type(error).__name__}: {error}" if str(error)
                            else type(error).__name__))
        return
    if reusable:
        upstream.released(pool)
    feed(UpstreamEnded())


def _body_framing(method: bytes, status: int, headers: Sequence[Header]) -> str | int | None:
    """How the response body is delimited (RFC 9112 section 6.3): ``"none"``,
    ``"chunked"``, a ``Content-Length`` or None (until the upstream closes)."""
    if method == b"HEAD" or status < 200 or status in (204, 304):
        return "none"
    lengths: list[bytes] = []
    for name, value in headers:
        if name == b"transfer-encoding":
            # h11 accepted the head, so the only coding it allows is chunked.
            return "chunked"
        if name == b"content-length":
            lengths.append(value)
    if lengths:
        return int(lengths[0])
    return None


async def _read_chunked(network: UpstreamStream, readable: asyncio.Event,
                        feed: Callable[[Input], None]) -> None:
    """Read a chunked body to its last chunk: one ``UpstreamData`` per chunk."""
    reader = ChunkedBodyReader()
    while not reader.done:
        if not readable.is_set():
            await readable.wait()
        data = await network.read(_BODY_READ_BYTES)
        if not data:
            raise httpcore.RemoteProtocolError("the upstream closed before the end of its chunked body")
        for chunk in reader.feed(data):
            feed(UpstreamData(chunk))
    if reader.leftover:
        network.unread(reader.leftover)
