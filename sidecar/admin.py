"""The admin server (``--admin-listen``): metrics, the stream registry, health.

Routes::

    GET    /metrics                Prometheus text format (the sidecar's own registry)
    GET    /streams                open streams as a JSON list
    DELETE /streams/{request_id}   cancel: upstream aborted, client gets an in-band ``cancelled``
    GET    /healthz                200 while the process runs
    GET    /readyz                 200 while taking requests, 503 once draining

One request per connection (``Connection: close``): this is for operators and
scrapers, not for traffic, so it stays small.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Awaitable, Callable

import h11
from prometheus_client import CONTENT_TYPE_LATEST
from tokenwire.middleware import EndReason, ErrorCode

from .context import SidecarContext

_MAX_ADMIN_HEAD_BYTES = 16 * 1024
_ADMIN_READ_TIMEOUT_S = 10.0

Response = tuple[int, bytes, bytes]
"""(status, content type, body)."""


def _json(status: int, payload: object) -> Response:
    return status, b"application/json", json.dumps(payload, separators=(",", ":")).encode()


def route(context: SidecarContext, method: bytes, target: bytes) -> Response:
    """The admin API's answer to one request (no I/O; easy to test)."""
    path = urllib.parse.unquote(target.split(b"?", 1)[0].decode("ascii", "replace"))
    if method in (b"GET", b"HEAD"):
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST.encode(), context.metrics.render()
        if path == "/streams":
            now = asyncio.get_running_loop().time()
            return _json(200, context.registry.describe(now))
        if path == "/healthz":
            return _json(200, {"status": "ok"})
        if path == "/readyz":
            if context.draining:
                return _json(503, {"status": "draining"})
            return _json(200, {"status": "ready"})
    elif method == b"DELETE" and path.startswith("/streams/"):
        request_id = path[len("/streams/"):]
        if context.registry.stop(request_id, EndReason.CANCELLED):
            return _json(200, {"cancelled": request_id})
        return _json(404, {"error": {"message": f"no open stream {request_id!r}",
                                     "type": "invalid_request_error",
                                     "code": ErrorCode.STREAM_NOT_FOUND.value}})
    else:
        return _json(405, {"error": {"message": "method not allowed", "type": "invalid_request_error",
                                     "code": ErrorCode.BAD_REQUEST.value}})
    return _json(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error",
                                 "code": ErrorCode.BAD_REQUEST.value}})


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


def handler(context: SidecarContext) -> AdminHandler:
    """The ``asyncio.start_server`` callback serving the admin API."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_ADMIN_HEAD_BYTES)
        try:
            request = await asyncio.wait_for(_read_request(reader, conn), _ADMIN_READ_TIMEOUT_S)
            if request is None:
                return
            status, content_type, body = route(context, request.method, request.target)
            headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
            if request.method != b"HEAD":
                writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
        except (h11.ProtocolError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return serve
