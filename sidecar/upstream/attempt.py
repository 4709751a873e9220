"""One attempt: one upstream request on the sidecar's own client, reported as core inputs.

An attempt is run as a task by :func:`run_attempt`; it reports what happened
as wire-core inputs through a callback and never decides anything itself.

A completed response is read to its end, so its connection goes back to the
pool (keep-alive), but only if it ended exactly where its framing says
(nothing after a HEAD/204/304 head, the ``Content-Length`` and no more, the
chunked terminator and no more, a head that allowed keep-alive); anything
else closes it. A chunked body is read by
:class:`~tokenwire.sidecar.upstream.body.ChunkedBodyReader`, all the chunks of
a socket read at once. An aborted attempt is cancelled: a connection whose
response was not read to its end is closed, not pooled, so an aborted
stream's connection is never reused. Nothing here retries; retrying is the
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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import httpcore
from tokenwire.middleware import Input, UpstreamData, UpstreamEnded, UpstreamFailed, UpstreamHeaders
from tokenwire.middleware.core.retry import may_repeat

from .conn import UpstreamConnection
from .errors import (
    STALE_CONNECTION_ERRORS,
    ConnectFailed,
    CutShort,
    PoolTimedOut,
    caller_message,
    failure_kind,
)
from .head import CHUNKED, ResponseHead
from .pool import UpstreamPool
from .transport import UpstreamStream

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# The most a body read takes at once (all that is buffered, up to this).
_BODY_READ_BYTES: Final = 256 * 1024


class UpstreamCounters:
    """What the attempts on one upstream count, for the metrics."""

    __slots__ = ("connected", "resent")

    def __init__(self) -> None:
        self.resent = 0
        """Requests re-sent after a reused connection failed before any answer (see :func:`_send`)."""
        self.connected: bool | None = None
        """How the last connect to the pod went (an attempt's, or a connect probe's:
        :meth:`~tokenwire.sidecar.upstream.probes.Probes.check_connects`); None = none tried
        yet. ``/readyz`` reads it when health checks are off."""


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
    # The connection is got (or the attempt fails) before the try that releases
    # it: an optional connection assigned inside that try, from a tuple, was
    # typed by mypyc as never None, so its finally's None check raised TypeError.
    try:
        connection, head = await _send(upstream, method=method, target=target, headers=headers,
                                       body=body, timeouts=timeouts)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # _send released the connection it could not use
        _failed(upstream, method, target, error, feed)
        return
    clean = False
    try:
        upstream.counters.connected = True
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
        _failed(upstream, method, target, error, feed)
        return
    finally:
        connection.finish(clean)
        upstream.pool.release(connection)
    feed(UpstreamEnded())


def _failed(upstream: Upstream, method: bytes, target: bytes, error: Exception,
            feed: Callable[[Input], None]) -> None:
    """An attempt failed: the caller reads what went wrong; the operator reads
    which pod, and how."""
    if isinstance(error, ConnectFailed) and not isinstance(error, PoolTimedOut):
        # A pool whose connections are all busy reached the pod; a refused or
        # timed-out connect did not (readiness with health checks off).
        upstream.counters.connected = False
    # The path without its query, which may hold a credential.
    logger.warning("upstream %s: %s %s failed: %s: %s", upstream.name, method.decode("latin-1"),
                   target.partition(b"?")[0].decode("latin-1"), type(error).__name__, error)
    feed(UpstreamFailed(failure_kind(error), caller_message(error)))


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
            if (last_try or not isinstance(error, STALE_CONNECTION_ERRORS)
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
            raise CutShort(f"the upstream closed {remaining} bytes before the end of its {length}-byte body")
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
