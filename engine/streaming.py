"""An SSE response that notices a client leaving even while it has nothing to send.

Starlette's ``StreamingResponse`` only listens for ``http.disconnect`` on ASGI
servers older than spec 2.4; on newer ones it learns of a disconnect when a
``send`` fails, which during a long prefill may be many seconds later. Here a
listener task and the pump task run side by side and whichever ends first
cancels the other. Cancelling the pump closes the event generator, whose
``finally`` aborts the sequence in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        pump = asyncio.ensure_future(self._pump(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, listener):
                task.cancel()
            for task in (pump, listener):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task

    async def _pump(self, send: Send) -> None:
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


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
