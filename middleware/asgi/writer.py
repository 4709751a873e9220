"""The response side of one ASGI exchange: the only caller of the server's ``send``.

Theory of operation
-------------------
For a driven (event-stream) response, :class:`ResponseWriter` is where the
core's bytes meet the server. A *writer* task (``write_loop``) sends the
headers once the core says ``CommitHeaders``, then whatever ``data_to_send()``
returns, and reports ``WriteCompleted`` when the server's ``send`` returns.
ASGI has no pause signal, so a ``send`` that has not returned *is* the
outstanding write; meanwhile events queue and coalesce in the core.

Most sends complete without suspending (the bytes go to the transport), so
when the writer is idle the app's own ``send`` call writes inline
(``write_inline``; ``forward_inline`` with the core's one-call keeps-up path)
and no writer wake-up or loop iteration is paid per event. The server's
``send`` is stepped by hand through a *pump* generator (``_pump``), which
reports a completed send by what it yields rather than by the
``StopIteration`` a coroutine's own ``send(None)`` raises. A send that does
suspend is handed to the writer (``pending_send``), which finishes it as if
it had started it. ``CloseClient`` ends the response: cleanly with the final
empty body, or abruptly by returning without it, so the server closes the
connection without the chunked terminator and the client sees a truncated body.

The core's actions are executed by the subclass (``exchange.Exchange.apply``).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Generator
from typing import Any, Final

from ..core.events import (
    Action,
    ClientGone,
    CloseClient,
    SocketPaused,
    SocketResumed,
    WriteCompleted,
)
from ..core.stream import WireStream
from .types import Message, Send


class ResponseWriter:
    """The server's ``send``, for one response. See the module docstring."""

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self.send = send
        self.loop = loop
        self.writer_task: asyncio.Task[None] | None = None
        self.client_gone = False
        self.response_complete = False
        self.start_message: Message | None = None
        self.close: CloseClient | None = None
        self.wake: asyncio.Future[None] | None = None  # set while the writer waits
        self.writer_sending = False
        self.pending_send: Awaitable[None] | None = None  # an inline send that suspended
        self.pending_paused = False  # ... after forward_read: the core was told SocketPaused
        self.pump: Generator[Any, Any, None] | None = None  # steps inline sends (_pump)
        self.writer_error: Exception | None = None

    def apply(self, actions: list[Action], *, wake: bool = True) -> None:
        """Execute the core's actions (the exchange's part)."""
        raise NotImplementedError

    def wake_writer(self) -> None:
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set_result(None)

    def writer_idle(self) -> bool:
        """The writer waits with nothing of its own to do: this send may write."""
        return (self.wake is not None and not self.writer_sending and self.start_message is None
                and self.close is None and self.pending_send is None)

    def forward_inline(self, stream: WireStream, body: bytes, now: float) -> bool | None:
        """The keeps-up path: the core's one call (``forward_read``) gives the
        bytes to write and the server's ``send`` takes them at once. A send
        that suspends instead means the socket is full: the core is told it
        is paused until the writer has finished that send. None (and nothing
        done) when the writer is busy or the core says this body needs its
        usual way; else what :meth:`start_send` says."""
        # writer_idle(), written out: this runs once per event.
        if (self.wake is None or self.writer_sending or self.start_message is not None
                or self.close is not None or self.pending_send is not None):
            return None
        out = stream.forward_read(body, now)
        if out is None:
            return None
        return self.start_send(stream, out, paused=True)

    def start_send(self, stream: WireStream, data: bytes, *, paused: bool) -> bool:
        """Run the server's ``send`` of ``data`` here until it completes or
        suspends; a suspended one is handed to the writer (``pending_send``),
        which finishes it. ``paused``: the core counted the write as done, so
        a suspension is reported as ``SocketPaused`` (resumed when it ends);
        otherwise the write is in flight and ends with ``WriteCompleted``.
        True when the send completed at once (with ``paused``, the core was
        then told nothing: its state is what ``forward_read`` left)."""
        sending = self.send({"type": "http.response.body", "body": data, "more_body": True})
        if type(sending) is types.CoroutineType:  # inspect.iscoroutine, without the call
            pump = self.pump
            if pump is None:
                pump = self.pump = _pump()
                pump.send(None)
            try:
                yielded = pump.send(sending)
            except BaseException as error:
                self.pump = None  # the send's error ended the pump too
                if not isinstance(error, Exception):
                    raise
                # As the writer does when the server's send fails.
                if not isinstance(error, OSError):
                    self.writer_error = error
                self.client_gone = True
                self.apply(stream.handle(ClientGone(), self.loop.time()))
                return False
            if yielded is _DONE:
                if not paused:
                    self.apply(stream.handle(WriteCompleted(), self.loop.time()), wake=False)
                    if (self.start_message is not None or self.close is not None or stream.finished
                            or stream.pending_bytes):
                        self.wake_writer()
                return True
            # The pump goes with the send it is in the middle of; the next
            # inline send starts a fresh one.
            self.pump = None
            self.pending_send = _finish(pump, yielded)
        else:
            self.pending_send = sending  # some other awaitable: the writer awaits it
        # Outstanding: the writer owns it now.
        self.pending_paused = paused
        self.writer_sending = True
        if paused:
            self.apply(stream.handle(SocketPaused(), self.loop.time()), wake=False)
        self.wake_writer()
        return False

    def write_inline(self, stream: WireStream) -> bool:
        """Write from the app's ``send`` itself when the writer is idle: the
        server's ``send`` usually completes without suspending (the bytes go
        to the transport), and then neither a writer wake-up nor an extra
        loop iteration is paid per event. If it does suspend (the socket is
        full), the rest of that ``send`` is handed to the writer, which
        finishes it as if it had started it. False if there was nothing to
        write this way (the writer must look)."""
        if not self.writer_idle():
            return False
        data = stream.data_to_send(self.loop.time())
        if not data:
            return False
        self.start_send(stream, data, paused=False)
        return True

    async def write_loop(self, stream: WireStream) -> None:
        """The only caller of the server's ``send`` for an event stream."""
        send = self.send
        loop = self.loop
        try:
            while True:
                pending_send = self.pending_send
                if pending_send is not None:
                    # A send write_inline started and the socket suspended.
                    try:
                        await pending_send
                    finally:
                        self.pending_send = None
                        self.writer_sending = False
                    ended = SocketResumed() if self.pending_paused else WriteCompleted()
                    self.apply(stream.handle(ended, loop.time()))
                    continue
                start = self.start_message
                if start is not None:
                    self.start_message = None
                    await self.guarded_send(start)
                    continue
                data = stream.data_to_send(loop.time())
                if data:
                    await self.guarded_send({"type": "http.response.body", "body": data,
                                             "more_body": True})
                    self.apply(stream.handle(WriteCompleted(), loop.time()))
                    continue
                close = self.close
                if close is not None:
                    if not close.abrupt and not self.client_gone:
                        self.response_complete = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if stream.finished:
                    return  # the client is gone: nothing more to send
                self.wake = loop.create_future()
                try:
                    await self.wake
                finally:
                    self.wake = None
        except OSError:
            # An ASGI 2.4 server reports a vanished client from `send`.
            self.client_gone = True
            self.apply(stream.handle(ClientGone(), loop.time()))
        except Exception as error:
            # A server bug or a broken connection it reports its own way: the
            # stream cannot continue, so end it as if the client left.
            self.writer_error = error
            self.client_gone = True
            self.apply(stream.handle(ClientGone(), loop.time()))

    async def guarded_send(self, message: Message) -> None:
        self.writer_sending = True
        try:
            await self.send(message)
        finally:
            self.writer_sending = False


_DONE: Final = object()
"""What :func:`_pump` answers when the send it was given has completed."""


@types.coroutine
def _pump() -> Generator[Any, Any, None]:
    """Runs each coroutine sent to it (after a first ``send(None)``) until it
    completes, then answers :data:`_DONE`; a coroutine that suspends makes it
    answer what that one yielded instead. Stepping the server's ``send`` this
    way instead of by its own ``send(None)`` spares the ``StopIteration`` that
    a completing coroutine raises there, once per event."""
    coroutine = yield _DONE
    while True:
        yield from coroutine
        coroutine = yield _DONE


@types.coroutine
def _finish(pump: Generator[Any, Any, None], yielded: Any) -> Generator[Any, Any, None]:
    """The rest of a send that :func:`_pump` started and that suspended on
    ``yielded``: awaited by a task, it runs on exactly as if the task had
    started it (what the task sends or throws in goes to the send), and ends
    when the pump says the send completed (or raises what the send raised)."""
    while True:
        try:
            value = yield yielded
        except BaseException as error:
            yielded = pump.throw(error)
        else:
            yielded = pump.send(value)
        if yielded is _DONE:
            return
