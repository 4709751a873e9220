"""The engine's access log: one line per HTTP request, with its request id.

uvicorn's own access line has no request id, so it is off, and this ASGI
wrapper (outermost, around tokenwire's middleware) writes one line per
response on the ``tokenwire.engine.access`` logger: method, path (never the
query), status, client address, request id (the response's ``x-request-id``,
which the engine always sets on its answers, else the request's), duration.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("tokenwire.engine.access")
RECEIVED_KEY = "tokenwire.received_s"
"""Scope key: ``time.monotonic()`` when the request reached the outermost wrapper
(the engine's TTFT and queue wait run from it)."""
_REQUEST_ID = b"x-request-id"


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class AccessLog:
    """ASGI wrapper: one INFO line per HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.monotonic()
        scope[RECEIVED_KEY] = started_s
        if not access_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        status = 0
        request_id = _header(scope.get("headers"), _REQUEST_ID)

        async def send_logged(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = int(message["status"])
                request_id = _header(message.get("headers"), _REQUEST_ID) or request_id
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            client = scope.get("client")
            access_log.info("request", extra={"fields": {
                "request_id": request_id, "method": scope.get("method"), "path": scope.get("path"),
                "status": status, "client": client[0] if client else None,
                "http_version": scope.get("http_version"),
                "duration_s": round(time.monotonic() - started_s, 6)}})
