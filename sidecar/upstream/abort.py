"""The explicit abort call (``--abort-url``): telling an engine to stop a request.

Closing the upstream connection is how the sidecar stops a generation; an
engine that keeps generating after its client left (or sits behind a proxy that
does not pass the close on) can be told once more, by a ``POST`` to
``abort_url`` with the request's upstream id. Best effort, in the background:
a failed call is logged, never retried, and never holds a stream's end.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse

import httpcore

from ..tasks import spawn

logger = logging.getLogger("tokenwire.sidecar")

_CALL_TIMEOUT_S = 10.0


class AbortClient:
    """Sends the abort calls of one sidecar over one small httpcore pool."""

    def __init__(self, abort_url: str, connect_timeout_s: float) -> None:
        self._abort_url = abort_url
        self._connect_timeout_s = connect_timeout_s
        self._pool: httpcore.AsyncConnectionPool | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, request_id: str, upstream: str = "") -> None:
        """Fire the call for ``request_id`` (the upstream's id for the request,
        the one it was sent: the sidecar's own, never a client's). An
        ``abort_url`` that is a path (``/v1/abort/{request_id}``) goes to
        ``upstream``, the pod that ran it."""
        if not self._abort_url or (self._abort_url.startswith("/") and not upstream.startswith("http")):
            return
        spawn(self._tasks, self._call(request_id, upstream))

    async def _call(self, request_id: str, upstream: str) -> None:
        if self._pool is None:
            self._pool = httpcore.AsyncConnectionPool(max_connections=64, retries=0)
        # Percent-encoded whatever it holds: a value must never add a path, query or fragment.
        url = self._abort_url.replace("{request_id}", urllib.parse.quote(request_id, safe=""))
        if url.startswith("/"):
            url = upstream.rstrip("/") + url
        try:
            response = await self._pool.request(
                "POST", url, headers=[(b"content-length", b"0")],
                extensions={"timeout": {"connect": self._connect_timeout_s, "read": _CALL_TIMEOUT_S,
                                        "write": _CALL_TIMEOUT_S, "pool": self._connect_timeout_s}})
            if response.status >= 400 and response.status != 404:
                logger.warning("abort call for %s answered %d", request_id, response.status)
        except httpcore.TimeoutException:
            logger.warning("abort call for %s timed out", request_id)
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as error:
            logger.warning("abort call for %s failed: %s", request_id, error)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._pool is not None:
            await self._pool.aclose()
