"""An SSE response for the engine's streams, written by the event loop's hand-off.

A pulled response (a task per stream awaiting a queue, an async generator,
``await send`` per event) costs every token a future, a task wake-up and a
resumption of the whole ASGI stack's coroutines, 64 times per engine step at
64 streams. Here the step's one hand-off pushes each output into its stream
(:meth:`PushedEventStream.push`), which renders it and runs the server's
``send`` right there: the send nearly always completes without suspending (the
bytes go to the transport), so a token costs one call down the ASGI stack and
no wake-up at all. Only when a send suspends (the socket or the middleware
pushes back) does the response's own task finish it; outputs arriving
meanwhile wait, unrendered, and go out together in one chunk once it is done,
as they did when a slow send let a queue fill up.

Noticing a client that leaves — also during a long, silent prefill — is the
wire core's job, done once in tokenwire's ASGI middleware, which wraps the
engine's app: it cancels this response's task, whose ``finally`` (``on_close``)
aborts the sequence in the engine at its next step.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from starlette.types import Message, Receive, Scope, Send

SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

SERVER_SEND_KEY = "tokenwire.engine.server_send"
"""Scope key: the ``send`` the app was called with, before its framework's routing
wrapped it (Starlette wraps it twice, in coroutines that only watch for the
response's start). The body's events go to it directly: two coroutines fewer per
token. The start goes through the wrappers, so they know the response started."""

Item = TypeVar("Item")

Render = Callable[[list[Item]], tuple[list[str], bool]]
"""Outputs (one, or several that waited) to the SSE events that carry them,
and whether the stream ends with them."""


class PushedEventStream(Generic[Item]):
    """ASGI response whose events are pushed by the event loop (``push``), not pulled."""

    def __init__(self, render: Render[Item], headers: dict[str, str], *,
                 first_event: str | None = None, on_close: Callable[[], None] | None = None) -> None:
        self._render = render
        self._headers = [*SSE_HEADERS,
                         *((k.lower().encode("latin-1"), v.encode("latin-1"))
                           for k, v in headers.items())]
        self._first_event = first_event
        self._on_close = on_close
        self._send: Send | None = None
        """The server's ``send``, once the head (and ``first_event``) went out: until then
        outputs wait in ``_pending``."""
        self._pending: list[Item] = []
        """Outputs not rendered yet: they arrived while a send was under way."""
        self._outbox: list[str] = []
        """Events rendered and not sent yet (the task sends them)."""
        self._suspended: Any = None
        """An inline send that suspended: the task finishes it (``_finish``)."""
        self._suspended_coroutine: Any = None
        self._task_sending = False
        self._error: BaseException | None = None
        """What an inline send raised: the task raises it, as if its own send had."""
        self._ended = False
        self._closed = False
        self._wake: asyncio.Future[None] | None = None

    def push(self, item: Item) -> None:
        """Event loop, outside the response's task: one output for this stream.

        Sent at once when nothing is under way; otherwise kept for the task."""
        if self._closed:
            return
        if (self._send is None or self._task_sending or self._suspended is not None
                or self._outbox or self._pending or self._error is not None):
            self._pending.append(item)
            self._wake_task()
            return
        try:
            events, ended = self._render([item])
        except BaseException as error:
            self._fail(error)
            return
        if ended:
            self._ended = True
        if len(events) == 1 and not ended:
            self._send_inline(events[0])
        elif events or ended:
            self._outbox.extend(events)
            self._wake_task()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._headers})
            send = scope.get(SERVER_SEND_KEY, send)
            if self._first_event is not None:
                await send(_body(self._first_event))
            self._send = send
            await self._drain(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._closed = True
            self._pending.clear()
            self._outbox.clear()
            coroutine, self._suspended_coroutine = self._suspended_coroutine, None
            if coroutine is not None and self._suspended is not None:
                coroutine.close()
            self._suspended = None
            if self._on_close is not None:
                self._on_close()

    async def _drain(self, send: Send) -> None:
        """The task's part: finish suspended sends, send what waited, until the end."""
        loop = asyncio.get_running_loop()
        while True:
            error = self._error
            if error is not None:
                self._error = None
                raise error
            suspended = self._suspended
            if suspended is not None:
                self._task_sending = True
                try:
                    await suspended
                finally:
                    self._suspended = self._suspended_coroutine = None
                    self._task_sending = False
                continue
            if self._outbox:
                event = self._outbox.pop(0)
                self._task_sending = True
                try:
                    await send(_body(event))
                finally:
                    self._task_sending = False
                continue
            if self._pending:
                waited, self._pending = self._pending, []
                events, ended = self._render(waited)
                self._outbox.extend(events)
                if ended:
                    self._ended = True
                continue
            if self._ended:
                return
            self._wake = loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    def _send_inline(self, event: str) -> None:
        assert self._send is not None
        sending = self._send(_body(event))
        if not isinstance(sending, types.CoroutineType):
            if isinstance(sending, asyncio.Future) and sending.done() and not sending.cancelled():
                # tokenwire's middleware answers a send it completed at once with a
                # future already done (no coroutine per event).
                error = sending.exception()
                if error is not None:
                    self._fail(error)
                return
            self._suspended = sending  # some other awaitable: the task awaits it
            self._wake_task()
            return
        try:
            yielded = sending.send(None)
        except StopIteration:
            return
        except BaseException as error:
            self._fail(error)
            return
        self._suspended_coroutine = sending
        self._suspended = _finish(sending, yielded)
        self._wake_task()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake_task()

    def _wake_task(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


def _body(event: str) -> Message:
    return {"type": "http.response.body", "body": event.encode(), "more_body": True}


@types.coroutine
def _finish(coroutine: Any, yielded: Any) -> Generator[Any, Any, None]:
    """The rest of a coroutine started by hand that suspended on ``yielded``: awaited
    by a task, it runs on as if that task had started it (what the task sends or
    throws in goes to the coroutine)."""
    while True:
        try:
            value = yield yielded
        except BaseException as error:
            try:
                yielded = coroutine.throw(error)
            except StopIteration:
                return
            continue
        try:
            yielded = coroutine.send(value)
        except StopIteration:
            return
