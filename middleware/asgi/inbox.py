"""The request side of one ASGI exchange: the server's ``receive``, owned.

Theory of operation
-------------------
:class:`RequestInbox` is the *listener* of ``exchange.py``: a task that
owns the server's ``receive`` for the whole request, so ``http.disconnect``
is seen whenever it comes, also while the app is silent (a long prefill).
Servers differ in how else they would tell an app (uvicorn's ``send`` returns
silently after a disconnect, ASGI 2.4 servers raise ``OSError``, hypercorn
only queues ``http.disconnect``); listening to ``receive`` works on all.

Request body messages are queued for the app's ``receive`` in order, read
ahead up to ``REQUEST_READ_AHEAD_BYTES`` (bounded memory for uploads; beyond
it, a disconnect is seen once the app reads on). The app is told of a
disconnect only when the exchange says the client is gone *and* the core is
not holding the stream for a reconnect (then the app keeps generating into
the replay store).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]

REQUEST_READ_AHEAD_BYTES = 1 << 20
"""Request body the listener reads ahead of the app before it waits for the
app to catch up (bounded memory for uploads; beyond it, a disconnect is seen
once the app reads on)."""


class RequestInbox:
    """Request messages between the server's ``receive`` and the app's. See the module docstring."""

    __slots__ = ("_consumed", "_disconnected", "_messages", "_on_disconnect", "_read_ahead_bytes",
                 "_ready", "_receive")

    def __init__(self, receive: Callable[[], Awaitable[Message]], *,
                 on_disconnect: Callable[[], None], disconnected: Callable[[], bool]) -> None:
        """``on_disconnect()``: the server said ``http.disconnect``.
        ``disconnected()``: whether the app's ``receive`` should now say so."""
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._disconnected = disconnected
        self._messages: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._consumed = asyncio.Event()
        self._read_ahead_bytes = 0

    async def listen(self) -> None:
        """Own the server's ``receive``: queue request messages for the app and
        notice the client leaving whenever it happens."""
        receive = self._receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._on_disconnect()
                return
            self._messages.append(message)
            self._ready.set()
            self._read_ahead_bytes += len(message.get("body", b""))
            while self._read_ahead_bytes > REQUEST_READ_AHEAD_BYTES:
                self._consumed.clear()
                await self._consumed.wait()

    def wake(self) -> None:
        """Let a waiting app ``receive`` look again (the client may be gone)."""
        self._ready.set()

    async def app_receive(self) -> Message:
        """The app's ``receive``."""
        while not self._messages:
            if self._disconnected():
                return {"type": "http.disconnect"}
            self._ready.clear()
            await self._ready.wait()
        message = self._messages.popleft()
        body = message.get("body")
        if body:
            self._read_ahead_bytes -= len(body)
            self._consumed.set()
        return message

    async def read_body(self) -> bytes:
        """The whole request body (an idempotency key is bound to it), left
        queued for the app to read as if nothing had."""
        messages: list[Message] = []
        while True:
            message = await self.app_receive()
            if message["type"] != "http.request":
                break
            messages.append(message)
            if not message.get("more_body", False):
                break
        for message in reversed(messages):
            self._messages.appendleft(message)
            self._read_ahead_bytes += len(message.get("body", b""))
        self._ready.set()
        return b"".join(bytes(m.get("body", b"")) for m in messages)
