"""The admin server (``--admin-listen``): metrics, the stream registry, health.

Routes::

    GET    /                       the playground page (streams through the proxy port, CORS)
    GET    /metrics                Prometheus text format (the sidecar's own registry)
    GET    /streams                open streams as a JSON list (no stream ids: see below)
    DELETE /streams/{request_id}   cancel: upstream aborted, client gets an in-band ``cancelled``
    GET    /upstreams              the upstream set: state, open streams, load, picks, queue
    POST   /upstreams/{addr}/drain    no new streams to it, its open ones finish (``/undrain``: back)
    POST   /drain                  the whole sidecar drains as on SIGTERM but stays up (202);
                                   a Kubernetes preStop hook's ``tokenwire drain``
    GET    /drain                  ``{"draining": bool, "open_streams": N}``
    GET    /healthz                200 while the process runs
    GET    /readyz                 200 while it can take a stream; 503 naming why not
                                   (draining, no healthy upstream, the store: ``readiness.py``)

Access: with an admin token (``admin_token``/``admin_token_file``, required
when the admin listens beyond loopback) every route asks for
``Authorization: Bearer <token>`` except the probes (``/healthz``,
``/readyz``), the playground page (a static page; what it does goes through
the proxy port under the proxy's own rules) and, with ``metrics_public``,
``/metrics``. ``/streams`` shows the request ids (the client's and the one the
upstream knows), never a resume stream id.

One request per connection (``Connection: close``): this is for operators and
scrapers, not for traffic, so it stays small.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h11
from prometheus_client import CONTENT_TYPE_LATEST
from tokenwire.middleware import EndReason, ErrorCode
from tokenwire.middleware.core.errors import error_object
from tokenwire.middleware.core.headers import header_value

from ..context import SidecarContext
from .playground import Playground
from .readiness import readiness

_MAX_ADMIN_HEAD_BYTES = 16 * 1024
_ADMIN_READ_TIMEOUT_S = 10.0

Response = tuple[int, bytes, bytes]
"""(status, content type, body)."""


def _json(status: int, payload: object) -> Response:
    return status, b"application/json", json.dumps(payload, separators=(",", ":")).encode()


# Answered to anyone: probes carry no credentials, and the page is static.
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/"})


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """Who may use which admin route (see the module docstring)."""

    token: str = ""
    """The bearer token asked for; empty = none (only allowed on loopback)."""
    metrics_public: bool = False

    def allows(self, path: str, authorization: bytes | None) -> bool:
        if not self.token or path in _OPEN_PATHS or (self.metrics_public and path == "/metrics"):
            return True
        if authorization is None:
            return False
        scheme, _, presented = authorization.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(),
                                                                    self.token.encode())


UNAUTHORIZED_HEADERS = ((b"www-authenticate", b'Bearer realm="tokenwire admin"'),)


def route(context: SidecarContext, method: bytes, target: bytes, *,
          playground: Playground | None = None, host_header: bytes | None = None,
          access: AdminAccess | None = None, authorization: bytes | None = None) -> Response:
    """The admin API's answer to one request (no I/O; easy to test)."""
    path = urllib.parse.unquote(target.split(b"?", 1)[0].decode("ascii", "replace"))
    if access is not None and not access.allows(path, authorization):
        return _json(401, error_object("the admin API needs Authorization: Bearer <admin token>",
                                       "invalid_request_error", ErrorCode.UNAUTHORIZED))
    if method in (b"GET", b"HEAD"):
        if path == "/" and playground is not None:
            return 200, b"text/html; charset=utf-8", playground.render(host_header)
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST.encode(), context.metrics.render()
        if path == "/streams":
            now = asyncio.get_running_loop().time()
            return _json(200, context.registry.describe(now))
        if path == "/upstreams":
            return _json(200, context.pools.describe())
        if path == "/healthz":
            return _json(200, {"status": "ok"})
        if path == "/drain":
            return _json(200, _drain_state(context))
        if path == "/readyz":
            verdict = readiness(context, asyncio.get_running_loop().time())
            return _json(verdict.status, verdict.body())
    elif method == b"DELETE" and path.startswith("/streams/"):
        request_id = path[len("/streams/"):]
        if context.registry.stop(request_id, EndReason.CANCELLED):
            return _json(200, {"cancelled": request_id})
        return _json(404, error_object(f"no open stream {request_id!r}", "invalid_request_error",
                                       ErrorCode.STREAM_NOT_FOUND))
    elif method == b"POST" and path == "/drain":
        assert context.begin_drain is not None, "set by the Sidecar"
        context.begin_drain()
        return _json(202, _drain_state(context))
    elif method == b"POST" and path.startswith("/upstreams/") and path.endswith(("/drain", "/undrain")):
        given, _, verb = path[len("/upstreams/"):].rpartition("/")
        address = context.pools.find(given)
        if address is None:
            return _json(404, error_object(f"no upstream {given!r}", "invalid_request_error",
                                           ErrorCode.BAD_REQUEST))
        context.pools.drain(address, verb == "drain")
        return _json(200, {"upstream": address, "draining": verb == "drain"})
    else:
        return _json(405, error_object("method not allowed", "invalid_request_error", ErrorCode.BAD_REQUEST))
    return _json(404, error_object(f"no route {path}", "invalid_request_error", ErrorCode.BAD_REQUEST))


def _drain_state(context: SidecarContext) -> dict[str, object]:
    return {"draining": context.draining, "open_streams": len(context.registry)}


async def _read_request(reader: asyncio.StreamReader, conn: h11.Connection) -> h11.Request | None:
    request: h11.Request | None = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif isinstance(event, h11.ConnectionClosed):
            return None


AdminHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
AdminAnswer = Callable[[h11.Request], Awaitable[tuple[int, bytes, bytes]]]
"""An admin route: the request in, (status, content type, body) out."""


async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: AdminAnswer) -> None:
    """One admin request on its own connection: read it (bounded in size and
    time), ``answer`` it, write the answer (a 401 names the auth scheme), close.
    The one admin responder of a sidecar and of the ``--workers`` supervisor."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_ADMIN_HEAD_BYTES)
    try:
        request = await asyncio.wait_for(_read_request(reader, conn), _ADMIN_READ_TIMEOUT_S)
        if request is None:
            return
        status, content_type, body = await answer(request)
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if status == 401:
            headers.extend(UNAUTHORIZED_HEADERS)
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
        if request.method != b"HEAD":
            writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
    except (h11.ProtocolError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


def handler(context: SidecarContext, *, proxy_address: tuple[str, int] | None = None,
            access: AdminAccess | None = None) -> AdminHandler:
    """The ``asyncio.start_server`` callback serving the admin API.

    ``proxy_address`` is the proxy listener's bound (host, port), which the
    playground page calls; the configured ``listen`` may say port 0.
    ``access``: the token rule (None = open, as on loopback without a token).
    """
    playground = Playground.load(context.config, proxy_address)

    async def answer(request: h11.Request) -> tuple[int, bytes, bytes]:
        return route(context, request.method, request.target, playground=playground,
                     host_header=header_value(request.headers, b"host"), access=access,
                     authorization=header_value(request.headers, b"authorization"))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_one(reader, writer, answer)

    return serve
