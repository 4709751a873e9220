"""The ASGI driver: the wire core for any app that streams Server-Sent Events.

Theory of operation
-------------------
:class:`TokenWireMiddleware` is pure ASGI. Non-HTTP scopes go straight to the
app. For each HTTP request it builds one
:class:`~tokenwire.middleware.asgi.exchange.Exchange` (the per-request driver
object; the sidecar's has the same name), which runs the app in a child task
and, beside it, a *listener* task that owns the server's ``receive``
(``inbox.py``):

* request body messages are handed to the app's ``receive`` in order (read
  ahead up to ``REQUEST_READ_AHEAD_BYTES``, so a client that leaves is seen
  even while the app has not read its body yet);
* ``http.disconnect`` is seen whenever it happens, also while the app is
  silent (a long prefill): the app task is cancelled and ``on_abort`` is called
  at once. Servers differ in how they tell an app (uvicorn's ``send`` returns
  silently after a disconnect, ASGI 2.4 servers raise ``OSError``, hypercorn
  only queues ``http.disconnect``); listening to ``receive`` works on all.

The app's ``http.response.start`` decides the mode. A response that is not
``text/event-stream`` is *passed through*: every message goes to the server
unchanged, and the app's ``send`` is the server's (byte-identical output).
An event-stream response is *driven*: a :class:`WireStream` is created and

* the app's messages become core inputs (``UpstreamHeaders``,
  ``UpstreamData``, ``UpstreamEnded``; an exception or a return without ending
  the body is ``UpstreamFailed``). The app's ``send`` never waits for the
  client: it feeds the core and returns;
* a *writer* task is the only caller of the server's ``send`` (``writer.py``): it sends the
  headers when the core says ``CommitHeaders``, then whatever
  ``data_to_send()`` returns, and reports ``WriteCompleted`` when the server's
  ``send`` returns. ASGI has no pause signal, so a slow ``send`` *is* the
  "write outstanding" state; meanwhile events queue and coalesce in the core;
* one timer, armed at ``next_deadline()``, feeds ``Tick`` (``driver.py``'s
  ``DeadlineTimer``, as in every driver);
* the core's actions are executed as they come: ``AbortUpstream`` cancels
  the app, ``CloseClient`` ends the response (``abrupt``: the ASGI call returns
  without the final empty body, so the server closes the connection without
  the chunked terminator and the client sees a truncated body),
  ``Finished`` calls ``on_finished`` and logs the record as one line.

Every wire rule (headers, heartbeats, deadlines, coalescing, error events) is
the core's; this module only moves messages. The app can watch its stream
through the ASGI extension ``scope["extensions"]["tokenwire"]``, a
:class:`StreamControl`.

Slow clients: the core sees a client that stops reading only once the
server's ``send`` stops completing at once, when the kernel's send buffer is
full; :class:`~tokenwire.middleware.asgi.send_buffer.SendBufferCap` caps that
buffer on the server's own sockets (see its module).

A client that leaves before the response has started has nobody to answer:
the app is cancelled then too (a prefill is exactly that case), and the core
still produces an accounting record with end reason ``client_gone``.

Resume (``config.resume``): the core numbers and records the events; this
driver passes ``ReplayAppend`` to the replay store. Before the app is called,
a reconnect (``GET /v1/streams/{stream}``, or a POST with ``Last-Event-ID``)
or a repeated ``Idempotency-Key`` is served from the store instead of the app,
through a core fed ``ReplaySource`` (``driver.py``'s ``enter_resume`` and
``replay``, as in every driver); the app never sees those requests. While
the core holds a departed client's stream for ``resume_grace_s``, the app is
not told of the disconnect (it keeps generating into the store).

Telemetry: each stream's record is one ``stream ended`` line of the
``tokenwire.middleware`` logger, its fields beside the message
(``middleware/process/logs.py``). Servers configure their own loggers, not the root
one, so at the first request, where the program configured no logging, the
middleware gives that logger a handler of its own on stderr, in
``log_format`` (``json`` or ``text``; ``off``: no stream lines); where it
did, the line goes to its handlers, at its level. ``metrics`` counts the
sidecar's stream metrics on a ``prometheus_client`` registry
(``middleware/process/prometheus.py``), served at ``metrics_path`` if one is given.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any

from ..core.config import ConfigError, WireConfig
from ..core.dialects import DialectTable
from ..core.resume import CallerKey
from ..process.logs import FieldsInMessage, LogFormat, install_default_handler
from ..shared.replay_store import MemoryReplayStore, ReplayStore
from .exchange import EXTENSION, Exchange, StreamControl
from .inbox import REQUEST_READ_AHEAD_BYTES
from .send_buffer import SendBufferCap
from .types import ASGIApp, OnAbort, OnFinished, Receive, Scope, Send

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..process.prometheus import MiddlewareMetrics

DEFAULT_CONFIG = WireConfig()
"""``WireConfig()``'s defaults are the middleware's: no retries (it cannot re-run
the app's request), and each path's dialect (``dialect_routes``) says how its
stream ends: an app's Chat Completions route with ``data: [DONE]``, its
Responses and Messages routes with their own terminal events, and any other
stream (a generic SSE app) by ending the response, which in-process is a
reliable signal. ``terminal_marker=None`` makes a clean end complete on the
Chat Completions routes too."""

__all__ = ["DEFAULT_CONFIG", "EXTENSION", "REQUEST_READ_AHEAD_BYTES", "StreamControl",
           "TokenWireMiddleware", "listening_socket"]

logger = logging.getLogger("tokenwire.middleware")
LOG_FORMATS = (LogFormat.JSON.value, LogFormat.TEXT.value, "off")


class TokenWireMiddleware:
    """Drive event-stream responses of ``app`` through the tokenwire wire core.

    ``config``: the wire rules (see :class:`WireConfig`); ``retry_attempts``
    must be 0. ``on_abort(request_id, reason)`` is called when the middleware
    cancels the app (client gone, slow client, ``abort()``); it may be a
    coroutine function. ``on_finished(record)`` receives each stream's
    accounting record. ``request_id_header`` names the request header whose
    value becomes the request id. ``replay_store``: where resumable streams
    are kept with ``config.resume`` (default: an in-memory store; pass a
    :class:`~tokenwire.middleware.shared.replay_redis.RedisReplayStore` so replicas share them).

    ``log_format``: each stream's record is one ``stream ended`` line of the
    ``tokenwire.middleware`` logger; where the program configured no logging
    (uvicorn, hypercorn and granian configure only their own loggers), the
    middleware writes it on stderr in this format: ``json`` (one object a
    line) or ``text``; ``off`` sets that logger to WARNING, for the process
    (no stream lines). Where logging is configured, the line goes to its
    handlers at its level, the fields also in the message (for
    ``logging.basicConfig``'s format).

    ``metrics``: ``True`` counts the sidecar's stream metrics on
    ``prometheus_client.REGISTRY`` (the app's, which
    ``prometheus_client.make_asgi_app()`` serves); a ``CollectorRegistry``:
    on that one (``middleware/process/prometheus.py``). ``metrics_path`` (e.g.
    ``/metrics``) has the middleware answer that path with the registry's
    exposition, before the app.

    ``cap_server_sockets``: at the first request on each server port, cap the
    send buffer of that port's sockets at ``config.socket_send_buffer_bytes``
    (:class:`SendBufferCap`), so a slow client is seen after kilobytes, not
    megabytes. It applies to every connection of the port, the app's other
    routes too (a large download then has at most twice that in flight per
    round trip); ``False`` leaves the server's sockets as they are (serve from
    a :func:`listening_socket` to cap them your way), and says nothing.
    """

    def __init__(
        self,
        app: ASGIApp,
        config: WireConfig = DEFAULT_CONFIG,
        *,
        on_abort: OnAbort | None = None,
        on_finished: OnFinished | None = None,
        request_id_header: str = "x-request-id",
        replay_store: ReplayStore | None = None,
        log_format: LogFormat | str = LogFormat.JSON,
        metrics: bool | CollectorRegistry = False,
        metrics_path: str | None = None,
        cap_server_sockets: bool = True,
    ) -> None:
        if config.retry_attempts != 0:
            raise ConfigError("retry_attempts", "must be 0 for the ASGI middleware: it cannot "
                                                "re-run the app's request (retries are the sidecar's)")
        self.app = app
        self.config = config
        self.on_abort = on_abort
        self.on_finished = on_finished
        self.request_id_header = request_id_header.lower().encode("latin-1")
        self.replay_store: ReplayStore | None = None
        self.caller_key = CallerKey.from_config(config)
        self.dialects = DialectTable(config.dialect_routes, config.terminal_marker)
        """Which dialect each of the app's paths speaks (``config.dialect_routes``)."""
        if config.resume:
            self.replay_store = replay_store or MemoryReplayStore.from_config(config)
            if replay_store is not None and not config.resume_owner_secret:
                logger.warning("resume_owner_secret is empty: a reconnect served by another process "
                               "sharing this replay store will not find its stream")
        if str(log_format) not in LOG_FORMATS:
            raise ConfigError("log_format", f"must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
        self.log_format = str(log_format)
        self._log_ready = False
        self.writers: dict[str, Any] = {}
        """The exchanges writing a resumable stream, by stream id (a cancel finds them here)."""
        self.send_buffers = SendBufferCap(config.socket_send_buffer_bytes) if cap_server_sockets else None
        """Caps the send buffer of the connections on each server port at its first request."""
        if not any(isinstance(f, FieldsInMessage) for f in logger.filters):
            logger.addFilter(FieldsInMessage())
        if self.log_format == "off":
            logger.setLevel(logging.WARNING)
        self.metrics: MiddlewareMetrics | None = None
        """The Prometheus metrics this middleware counts on (None: ``metrics`` off)."""
        self.metrics_path = metrics_path
        self._metrics_app: ASGIApp | None = None
        if metrics is not False and metrics is not None:
            from ..process.prometheus import MiddlewareMetrics

            self.metrics = MiddlewareMetrics.on(None if metrics is True else metrics)
            self.on_finished = self.metrics.counting(on_finished)
            if metrics_path is not None:
                self._metrics_app = self.metrics.asgi_app()
        elif metrics_path is not None:
            raise ConfigError("metrics_path", "needs metrics (True or a prometheus_client registry)")

    def stop_writer(self, stream_id: str) -> bool:
        """A cancel by stream id: stop the app writing ``stream_id`` as ``abort()``
        does (the app is cancelled, the stream ends with ``cancelled``); whether
        one is running in this process."""
        writer: Exchange | None = self.writers.get(stream_id)
        if writer is None or writer.response_complete or (writer.stream is not None
                                                          and writer.stream.finished):
            return False  # ended, its record not yet written: the store's end answers
        writer.request_abort()
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._log_ready:
            # Decided now: by the first request the server and the app have
            # configured logging, if they do.
            self._log_ready = True
            if self.log_format != "off":
                install_default_handler(logger, self.log_format)
            if self.replay_store is not None:
                # In the server's loop: a shared store passes other processes' cancels on.
                self.replay_store.serve_cancels(self.stop_writer)
        # After the handler: a port that cannot be capped is said on stderr.
        if self.send_buffers is not None:
            self.send_buffers.see(scope)
        metrics = self.metrics
        if metrics is None:
            await Exchange(self, scope, receive, send).run()
            return
        if self._metrics_app is not None and scope.get("path") == self.metrics_path:
            await self._metrics_app(scope, receive, send)
            return
        exchange = Exchange(self, scope, receive, send)
        metrics.opened(exchange, str(scope.get("http_version", "1.1")))
        try:
            await exchange.run()
        finally:
            metrics.closed(exchange)


def listening_socket(host: str, port: int, config: WireConfig = DEFAULT_CONFIG,
                     *, backlog: int = 2048) -> socket.socket:
    """A TCP listening socket whose accepted connections get a send buffer of
    ``config.socket_send_buffer_bytes`` (Linux copies it from the listener).

    ASGI gives an app no access to its socket. The middleware caps the sockets
    of a port at its first request where it finds them in this process
    (:class:`SendBufferCap`); a listener of this function's is capped from the
    start, on any system: pass it to ``uvicorn.Server(config).run(sockets=[...])``
    (docs/architecture.md#slow-readers).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_send_buffer_bytes)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
