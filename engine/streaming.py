"""An SSE response for the engine's streams.

It only pumps events. Noticing a client that leaves — also during a long,
silent prefill — is the wire core's job, done once in tokenwire's ASGI
middleware, which wraps the engine's app: it cancels this response's task, and
cancelling closes the event generator, whose ``finally`` aborts the sequence
in the engine at its next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class EventStreamResponse:
    """ASGI response streaming ``events`` (already framed SSE text)."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]) -> None:
        self._events = events
        self._headers = [*SSE_HEADERS,
                         *((k.lower().encode("latin-1"), v.encode("latin-1"))
                           for k, v in headers.items())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        try:
            async for event in self._events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # If cancelled while awaiting send, the generator is parked at a
            # yield: close it now so its cleanup (the engine abort) runs now.
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
