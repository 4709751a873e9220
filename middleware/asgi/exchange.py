"""The per-request driver object of the ASGI driver: one :class:`Exchange` per HTTP request.

Theory of operation
-------------------
``asgi.py`` says what the ASGI driver does; this module is how one request
goes. An :class:`Exchange` runs the app in a child task and, beside it, the
*listener* (``asgi_inbox.py``) that owns the server's ``receive``. The app's
``http.response.start`` decides the mode (:class:`_Mode`): a response that is
not an event stream is passed through; an event stream is *driven* by a
:class:`WireStream`, whose bytes a *writer* task sends (or the app's own
``send`` call, inline, when the writer is idle: ``write_inline``,
``forward_inline``). The usual event (a body chunk the core's keeps-up path
takes, written at once) is done in ``app_send`` itself, a plain function
that answers with an already-done future, so an event costs no coroutine of
ours; the rest is ``send_message``. The sidecar's per-request object has the
same name and role (``sidecar/exchange/loop.py``); what they do alike is ``driver.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from ..core import client_settings, frames
from ..core.errors import WireError
from ..core.events import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    FailureKind,
    Finished,
    Input,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ResumeUpstream,
    RetryUpstream,
    StopRequested,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
)
from ..core.headers import is_event_stream
from ..core.record import EndReason, StreamRecord
from ..core.resume import new_stream_id
from ..core.stream import WireStream
from ..process.logs import wall_clock
from ..shared.driver import DeadlineTimer, answer_cancel, enter_resume, needs_body, replay, wait_for_reader
from ..shared.replay_store import StoreUnavailable
from ..shared.store_outages import STORE_OUTAGES
from .inbox import RequestInbox
from .types import Message, MiddlewareSettings, Receive, Scope, Send
from .writer import ResponseWriter

EXTENSION = "tokenwire"
"""The key of :class:`StreamControl` in ``scope["extensions"]``."""

logger = logging.getLogger("tokenwire.middleware")


class _Mode(Enum):
    UNDECIDED = "undecided"  # the app has not started its response
    PASSTHROUGH = "passthrough"  # not an event stream: forwarded unchanged
    DRIVEN = "driven"  # an event stream, driven by the wire core


class StreamControl:
    """``scope["extensions"]["tokenwire"]``: the app's view of its stream.

    Engines may read ``backpressured`` / ``pending_bytes`` to react to a slow
    client, and call ``abort()`` to end the stream themselves.
    """

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    @property
    def request_id(self) -> str:
        """The request's ``x-request-id`` header (configurable), or a generated id."""
        return self._exchange.request_id

    @property
    def stream_id(self) -> str | None:
        """With ``config.resume``: the id a client resumes this stream by (also
        sent as ``x-tokenwire-stream-id``); None without resume."""
        return self._exchange.stream_id

    @property
    def backpressured(self) -> bool:
        """True while the client is not keeping up (events are queueing)."""
        stream = self._exchange.stream
        return stream is not None and stream.backpressured

    @property
    def pending_bytes(self) -> int:
        """Bytes waiting for the client (bounded by ``max_pending_bytes``)."""
        stream = self._exchange.stream
        return 0 if stream is None else stream.pending_bytes

    def abort(self) -> None:
        """End the stream now: the client gets an in-band ``cancelled`` error (or
        a 503 if nothing was sent yet) and the app is cancelled. Idempotent."""
        self._exchange.request_abort()


class Exchange(ResponseWriter):
    """One HTTP request: the app task, the listener, and (for an event stream)
    the core and its writer task. See the module docstring."""

    def __init__(self, middleware: MiddlewareSettings, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.middleware = middleware
        self.config = middleware.config
        super().__init__(send, asyncio.get_running_loop())
        self.request_id = _request_id(scope, middleware.request_id_header)
        self.scope = dict(scope)
        self.scope["extensions"] = {**(scope.get("extensions") or {}), EXTENSION: StreamControl(self)}
        # The request's own ``Tokenwire-…`` settings: a refusal is answered (400) with no app run; the
        # app is the upstream, so it gets the headers without them; the log line says what changed.
        headers = frames.with_query([(bytes(k).lower(), bytes(v)) for k, v in scope.get("headers", ())],
                                    bytes(scope.get("query_string", b"")))  # an EventSource's way to ask
        self.config, self.client_settings, kept, self.refusal = client_settings.for_request(
            self.config, headers, None, "")
        self.scope["headers"] = list(kept)
        self.mode = _Mode.UNDECIDED
        self.stream: WireStream | None = None
        self.app_task: asyncio.Task[None] | None = None
        # Request side.
        self.inbox = RequestInbox(receive, on_disconnect=self.on_disconnect,
                                  disconnected=lambda: self.client_gone and not self.held)
        # Response side.
        self.app_ended = False
        self.app_cancelled_by_us = False
        self.upstream_resumed: asyncio.Event | None = None
        self.timer = DeadlineTimer(self.loop, self.on_timer)
        self.hook_tasks: list[asyncio.Future[Any]] = []
        self.sent: asyncio.Future[None] = self.loop.create_future()  # app_send's usual answer
        self.sent.set_result(None)
        # Resume.
        self.stream_id = new_stream_id() if self.config.resume else None
        self.resume_opened = False  # the store has it (opened before its first append)
        self.owner = ""  # the caller's hash, the stream's owner in the store
        self.held = False  # the core holds the stream for a reconnect: the app keeps going
        self.reader_wait: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ the call

    async def run(self) -> None:
        app_task = self.loop.create_task(self.call_app())
        self.app_task = app_task
        app_task.add_done_callback(self.on_app_done)
        listener = self.loop.create_task(self.inbox.listen())
        try:
            await asyncio.wait((app_task,))
            if self.writer_task is not None:
                await asyncio.wait((self.writer_task,))
        finally:
            if self.stream_id is not None and self.middleware.writers.get(self.stream_id) is self:
                del self.middleware.writers[self.stream_id]
            listener.cancel()
            self.timer.cancel()
            if not app_task.done():
                self.app_cancelled_by_us = True
                app_task.cancel()
                await asyncio.wait((app_task,))
            if self.writer_task is not None and not self.writer_task.done():
                self.writer_task.cancel()
            if self.hook_tasks:
                await asyncio.wait(self.hook_tasks)
        if app_task.cancelled():
            if not self.app_cancelled_by_us:
                raise asyncio.CancelledError
            return
        error = app_task.exception() or self.writer_error
        if error is not None:
            # As without the middleware: the server logs it (and, if the
            # response is still open, closes the connection).
            raise error

    async def call_app(self) -> None:
        if self.refusal is not None:
            self.refuse(self.refusal)
            return
        if self.middleware.replay_store is not None:
            if await self.served_from_store():
                return
            assert self.stream_id is not None
            self.middleware.writers[self.stream_id] = self  # a cancel by id finds it here
        await self.middleware.app(self.scope, self.inbox.app_receive, self.app_send)

    # ------------------------------------------------------------ resume

    async def served_from_store(self) -> bool:
        """Answer a reconnect or a repeated idempotency key from the store
        (True), or open this request's stream there and let the app run."""
        store = self.middleware.replay_store
        assert store is not None and self.stream_id is not None
        method = str(self.scope.get("method", "GET"))
        headers = self.scope["headers"]  # lower-cased, without the settings (__init__)
        body = await self.inbox.read_body() if needs_body(method, headers) else b""
        query = bytes(self.scope.get("query_string", b"")).decode("latin-1")
        entry = await enter_resume(store, self.middleware.caller_key, method=method,
                                   path=str(self.scope.get("path", "")), query=query, headers=headers,
                                   body=body, stream_id=self.stream_id, open_now=False)
        self.owner = entry.owner
        if entry.refusal is not None:
            self.refuse(entry.refusal)
            return True
        if entry.cancel is not None:
            await answer_cancel(store, entry.cancel, stop_writer=self.middleware.stop_writer,
                                feed=self.answer_here())
            self.app_ended = True
            return True
        if entry.replay is not None:
            feed = self.answer_here()
            readable = asyncio.Event()
            readable.set()
            self.upstream_resumed = readable
            await replay(store, entry.replay, readable=readable, feed=feed)
            self.app_ended = True
            return True
        self.resume_opened = entry.opened  # an idempotent request's stream is open
        return False

    def answer_here(self) -> Callable[[Input], None]:
        """Start the core with no app behind it; the call that feeds it the answer's inputs."""
        stream = self.start_core()

        def feed(event: Input) -> None:
            self.apply(stream.handle(event, self.loop.time()))

        return feed

    def refuse(self, error: WireError) -> None:
        """Answer with ``error`` (its status and body); the app never runs."""
        feed = self.answer_here()
        self.app_ended = True
        feed(Rejected(error))

    async def await_reader(self, action: AwaitReader) -> None:
        store = self.middleware.replay_store
        assert store is not None
        if await wait_for_reader(store, action, self.loop.time()):
            stream = self.stream
            if stream is not None:
                self.apply(stream.handle(ReaderAttached(), self.loop.time()))

    # ------------------------------------------------------------ request side

    def on_disconnect(self) -> None:
        self.client_gone = True
        self.inbox.wake()
        if self.response_complete:
            return  # the server says so once the response is complete: not an abort
        if self.mode is _Mode.PASSTHROUGH:
            self.abort_app(EndReason.CLIENT_GONE)
            return
        stream = self.stream if self.stream is not None else self.start_core()
        self.apply(stream.handle(ClientGone(), self.loop.time()))

    def request_abort(self) -> None:
        if self.response_complete:
            return
        if self.mode is _Mode.PASSTHROUGH:
            self.abort_app(EndReason.CANCELLED)
            return
        stream = self.stream if self.stream is not None else self.start_core()
        self.apply(stream.handle(StopRequested(EndReason.CANCELLED), self.loop.time()))

    # ------------------------------------------------------------ the app's send

    def app_send(self, message: Message) -> Awaitable[None]:
        """The app's ``send``. The usual event of an event stream (a body
        chunk the core's keeps-up path takes, written by the server's ``send``
        without suspending) is done here and answered with a future that is
        already done, so no coroutine is made per event; anything else is
        :meth:`send_message`, awaited as the app awaits this."""
        stream = self.stream
        if (stream is not None and self.wake is not None and not self.writer_sending
                and self.start_message is None and self.close is None and self.pending_send is None
                and not self.app_ended and message.get("type") == "http.response.body"
                and message.get("more_body", False)):
            body = message.get("body", b"")
            if body and type(body) is bytes:
                out = stream.forward_read(body, self.loop.time())
                if out is not None:
                    if self.start_send(stream, out, paused=True):
                        # Nothing is pending, and forward_read held: the core
                        # has not paused the app (the `block` policy).
                        return self.sent
                    return self.after_body(stream)  # the send suspended, or failed
        return self.send_message(message)

    async def send_message(self, message: Message) -> None:
        """The app's ``send``, all but the usual event (:meth:`app_send`)."""
        stream = self.stream
        if stream is None:
            if self.mode is _Mode.PASSTHROUGH:
                await self.send_through(message)
                return
            if message["type"] != "http.response.start":
                await self.send(message)  # early hints, or a protocol error the server reports
                return
            headers = tuple((bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ()))
            if not is_event_stream(headers):
                self.mode = _Mode.PASSTHROUGH
                await self.send_through(message)
                return
            store = self.middleware.replay_store
            if store is not None and not self.resume_opened and self.stream_id is not None:
                # Before the core's first ReplayAppend can reach the store.
                try:
                    await store.open(self.stream_id, owner=self.owner)
                except StoreUnavailable as error:
                    STORE_OUTAGES.not_resumable(self.stream_id, error)  # once a while, not per request
                self.resume_opened = True
            stream = self.start_core()
            self.apply(stream.handle(UpstreamHeaders(int(message["status"]), headers),
                                     self.loop.time()))
            return
        kind = message["type"]
        if kind != "http.response.body":
            if stream.finished:
                return
            raise RuntimeError(f"unexpected ASGI message {kind!r} in an event-stream response")
        if self.app_ended:
            raise RuntimeError("ASGI message after the response body ended")
        now = self.loop.time()
        body = message.get("body", b"")
        if body:
            if type(body) is not bytes:
                body = bytes(body)
            if self.forward_inline(stream, body, now) is None:
                self.apply(stream.handle(UpstreamData(body), now), wake=False)
                if not self.write_inline(stream):
                    self.wake_writer()
        if not message.get("more_body", False):
            self.app_ended = True
            self.apply(stream.handle(UpstreamEnded(), now))
        await self.after_body(stream)

    async def after_body(self, stream: WireStream) -> None:
        """What the app's ``send`` waits for once the core has its body."""
        resumed = self.upstream_resumed
        if resumed is not None and not resumed.is_set():
            await resumed.wait()  # the `block` policy: TCP backpressure reaches the app
        elif stream.pending_bytes >= self.config.write_high_water_bytes:
            # An app that never yields would starve the writer; let it run once.
            await asyncio.sleep(0)

    async def send_through(self, message: Message) -> None:
        kind = message["type"]
        if (kind == "http.response.body" and not message.get("more_body", False)) or (
                kind == "http.response.trailers" and not message.get("more_trailers", False)) or (
                kind == "http.response.pathsend"):
            self.response_complete = True
        await self.send(message)

    def on_app_done(self, task: asyncio.Task[None]) -> None:
        stream = self.stream
        if stream is None or stream.finished or self.app_ended:
            return
        # The body did not end: an upstream failure (ignored by the core if the
        # stream already ended, e.g. because we cancelled the app).
        if task.cancelled():
            message = "the application was cancelled"
        elif task.exception() is not None:
            # The exception is the server's to log (raised on, see ``run``): the
            # client reads no class name or message of the application's.
            message = "the application failed before it ended the answer"
        else:
            message = "the application returned without ending the response"
        self.apply(stream.handle(UpstreamFailed(FailureKind.PROTOCOL, message), self.loop.time()))

    # ------------------------------------------------------------ the core

    def start_core(self) -> WireStream:
        self.mode = _Mode.DRIVEN
        stream = WireStream(self.config, now=self.loop.time(), request_id=self.request_id,
                            upstream="app", expect_stream=True, stream_id=self.stream_id,
                            dialect=self.middleware.dialects.for_path(str(self.scope.get("path", ""))),
                            frames=frames.asked(self.scope.get("headers", ())))
        self.stream = stream
        self.writer_task = self.loop.create_task(self.write_loop(stream))
        return stream

    def apply(self, actions: list[Action], *, wake: bool = True) -> None:
        """Execute the core's actions in order, then wake the writer (unless
        ``wake`` is False: the caller does) and arm the timer."""
        for action in actions:  # usually none
            if isinstance(action, CommitHeaders):
                self.start_message = {"type": "http.response.start", "status": action.status,
                                      "headers": list(action.headers)}
            elif isinstance(action, AbortUpstream):
                self.abort_app(action.reason, tell_app=action.final)
            elif isinstance(action, CloseClient):
                self.close = action
                if action.reset and self.writer_sending and self.writer_task is not None:
                    # A send stuck on a client that stopped reading will never return.
                    self.writer_task.cancel()
            elif isinstance(action, Finished):
                self.on_finished(action.record)
            elif isinstance(action, PauseUpstream):
                if self.upstream_resumed is None:
                    self.upstream_resumed = asyncio.Event()
                self.upstream_resumed.clear()
            elif isinstance(action, ResumeUpstream):
                if self.upstream_resumed is not None:
                    self.upstream_resumed.set()
            elif isinstance(action, ReplayAppend):
                store = self.middleware.replay_store
                if store is not None:
                    store.append(action)
            elif isinstance(action, AwaitReader):
                self.held = True
                self.reader_wait = self.loop.create_task(self.await_reader(action))
            elif isinstance(action, RetryUpstream):  # pragma: no cover - retry_attempts is 0
                raise AssertionError("the ASGI middleware cannot retry the app")
        stream = self.stream
        if stream is None:
            return
        if stream.finished:
            self.timer.cancel()
            self.held = False
            if self.reader_wait is not None:
                self.reader_wait.cancel()
            if self.upstream_resumed is not None:
                self.upstream_resumed.set()
            if self.client_gone and self.writer_sending and self.writer_task is not None:
                self.writer_task.cancel()
        else:
            self.timer.arm(stream.next_deadline())
        if wake:
            self.wake_writer()

    def abort_app(self, reason: EndReason, *, tell_app: bool = True) -> None:
        self.held = False
        task = self.app_task
        if task is not None and not task.done():
            self.app_cancelled_by_us = True
            task.cancel()
        on_abort = self.middleware.on_abort
        if on_abort is None or not tell_app:
            return
        try:
            result = on_abort(self.request_id, reason.value)
        except Exception:
            logger.exception("on_abort hook failed for request %s", self.request_id)
            return
        if inspect.isawaitable(result):
            self.hook_tasks.append(asyncio.ensure_future(result))

    def on_finished(self, record: StreamRecord) -> None:
        hook = self.middleware.on_finished
        if hook is not None:
            try:
                hook(record)
            except Exception:
                logger.exception("on_finished hook failed for request %s", self.request_id)
        if logger.isEnabledFor(logging.INFO):
            # Structured fields (tokenwire.middleware.process.logs formats them as JSON or text),
            # with the request's, and the start as a wall-clock time, as the sidecar's.
            scope = self.scope
            client = scope.get("client")
            fields = {**record.to_json(), "method": str(scope.get("method", "")),
                      "path": str(scope.get("path", "")),
                      "client": str(client[0]) if client else "",
                      "http_version": str(scope.get("http_version", "")),
                      "started_at": wall_clock(record.started_at, self.loop.time())}
            if self.client_settings:
                fields["client_settings"] = self.client_settings
            logger.info("stream ended", extra={"fields": fields})

    # ------------------------------------------------------------ timer

    def on_timer(self, now: float) -> None:
        stream = self.stream
        if stream is not None and not stream.finished:
            self.apply(stream.handle(Tick(), now))


def _request_id(scope: Scope, header: bytes) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == header and value:
            return bytes(value).decode("latin-1")
    return uuid.uuid4().hex
