"""The ASGI driver: the wire core for any app that streams Server-Sent Events.

Theory of operation
-------------------
:class:`TokenWireMiddleware` is pure ASGI. Non-HTTP scopes go straight to the
app. For each HTTP request it builds one :class:`_Responder`, which runs the
app in a child task and, beside it, a *listener* task that owns the server's
``receive``:

* request body messages are handed to the app's ``receive`` in order (read
  ahead up to ``REQUEST_READ_AHEAD_BYTES``, so a client that leaves is seen
  even while the app has not read its body yet);
* ``http.disconnect`` is seen whenever it happens, also while the app is
  silent (a long prefill): the app task is cancelled and ``on_abort`` is called
  at once. Servers differ in how they tell an app (uvicorn's ``send`` returns
  silently after a disconnect, ASGI 2.4 servers raise ``OSError``, hypercorn
  only queues ``http.disconnect``); listening to ``receive`` works on all.

The app's ``http.response.start`` decides the mode. A response that is not
``text/event-stream`` is *passed through*: every message goes to the server
unchanged, and the app's ``send`` is the server's (byte-identical output).
An event-stream response is *driven*: a :class:`WireStream` is created and

* the app's messages become core inputs (``UpstreamHeaders``,
  ``UpstreamData``, ``UpstreamEnded``; an exception or a return without ending
  the body is ``UpstreamFailed``). The app's ``send`` never waits for the
  client: it feeds the core and returns;
* a *writer* task is the only caller of the server's ``send``: it sends the
  headers when the core says ``CommitHeaders``, then whatever
  ``data_to_send()`` returns, and reports ``WriteCompleted`` when the server's
  ``send`` returns. ASGI has no pause signal, so a slow ``send`` *is* the
  "write outstanding" state; meanwhile events queue and coalesce in the core;
* one timer, armed at ``next_deadline()``, feeds ``Tick``;
* the core's actions are executed as they come: ``AbortUpstream`` cancels
  the app, ``CloseClient`` ends the response (``abrupt``: the ASGI call returns
  without the final empty body, so the server closes the connection without
  the chunked terminator and the client sees a truncated body),
  ``Finished`` calls ``on_finished`` and logs the record as one JSON line.

Every wire rule (headers, heartbeats, deadlines, coalescing, error events) is
the core's; this module only moves messages. The app can watch its stream
through the ASGI extension ``scope["extensions"]["tokenwire"]``, a
:class:`StreamControl`.

A client that leaves before the response has started has nobody to answer:
the app is cancelled then too (a prefill is exactly that case), and the core
still produces an accounting record with end reason ``client_gone``.

Resume (``config.resume``): the core numbers and records the events; this
driver passes ``ReplayAppend`` to the replay store. Before the app is called,
a reconnect (``GET /v1/streams/{stream}``, or a POST with ``Last-Event-ID``)
or a repeated ``Idempotency-Key`` is served from the store instead of the app,
through a core fed ``ReplaySource``; the app never sees those requests. While
the core holds a departed client's stream for ``resume_grace_s``, the app is
not told of the disconnect (it keeps generating into the store).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import types
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Generator, MutableMapping
from enum import Enum
from typing import Any

from .config import ConfigError, WireConfig
from .errors import WireError
from .events import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    FailureKind,
    Finished,
    Input,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ReplaySource,
    ResumeUpstream,
    RetryUpstream,
    SocketPaused,
    SocketResumed,
    StopRequested,
    StreamRecord,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamFailed,
    UpstreamHeaders,
    WriteCompleted,
)
from .headers import is_event_stream
from .replay_store import MemoryReplayStore, ReplayStore, StoreUnavailable, admit, feed_replay
from .resume import CallerKey, classify, new_stream_id
from .stream import WireStream

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
OnAbort = Callable[[str, str], object]
"""``on_abort(request_id, reason)``; may be a coroutine function."""
OnFinished = Callable[[StreamRecord], object]

DEFAULT_CONFIG = WireConfig()
"""``WireConfig()``'s defaults are the middleware's: no retries (it cannot re-run
the app's request) and no terminal marker, because a generic SSE app ends its
stream by ending the response, which in-process is a reliable signal. An
OpenAI-style app that always ends with ``data: [DONE]`` may pass
``terminal_marker="[DONE]"`` to have a stream that lacks it reported as an error."""

REQUEST_READ_AHEAD_BYTES = 1 << 20
"""Request body the listener reads ahead of the app before it waits for the
app to catch up (bounded memory for uploads; beyond it, a disconnect is seen
once the app reads on)."""

EXTENSION = "tokenwire"

logger = logging.getLogger("tokenwire.middleware")


class _Mode(Enum):
    UNDECIDED = "undecided"  # the app has not started its response
    PASSTHROUGH = "passthrough"  # not an event stream: forwarded unchanged
    STREAM = "stream"  # driven by the wire core


class StreamControl:
    """``scope["extensions"]["tokenwire"]``: the app's view of its stream.

    Engines may read ``backpressured`` / ``pending_bytes`` to react to a slow
    client, and call ``abort()`` to end the stream themselves.
    """

    __slots__ = ("_responder",)

    def __init__(self, responder: _Responder) -> None:
        self._responder = responder

    @property
    def request_id(self) -> str:
        """The request's ``x-request-id`` header (configurable), or a generated id."""
        return self._responder.request_id

    @property
    def stream_id(self) -> str | None:
        """With ``config.resume``: the id a client resumes this stream by (also
        sent as ``x-tokenwire-stream-id``); None without resume."""
        return self._responder.stream_id

    @property
    def backpressured(self) -> bool:
        """True while the client is not keeping up (events are queueing)."""
        stream = self._responder.stream
        return stream is not None and stream.backpressured

    @property
    def pending_bytes(self) -> int:
        """Bytes waiting for the client (bounded by ``max_pending_bytes``)."""
        stream = self._responder.stream
        return 0 if stream is None else stream.pending_bytes

    def abort(self) -> None:
        """End the stream now: the client gets an in-band ``cancelled`` error (or
        a 503 if nothing was sent yet) and the app is cancelled. Idempotent."""
        self._responder.request_abort()


class TokenWireMiddleware:
    """Drive event-stream responses of ``app`` through the tokenwire wire core.

    ``config``: the wire rules (see :class:`WireConfig`); ``retry_attempts``
    must be 0. ``on_abort(request_id, reason)`` is called when the middleware
    cancels the app (client gone, slow client, ``abort()``); it may be a
    coroutine function. ``on_finished(record)`` receives each stream's
    accounting record. ``request_id_header`` names the request header whose
    value becomes the request id. ``replay_store``: where resumable streams
    are kept with ``config.resume`` (default: an in-memory store; pass a
    :class:`~tokenwire.middleware.replay_redis.RedisReplayStore` so replicas share them).
    """

    def __init__(
        self,
        app: ASGIApp,
        config: WireConfig = DEFAULT_CONFIG,
        *,
        on_abort: OnAbort | None = None,
        on_finished: OnFinished | None = None,
        request_id_header: str = "x-request-id",
        replay_store: ReplayStore | None = None,
    ) -> None:
        if config.retry_attempts != 0:
            raise ConfigError("retry_attempts", "must be 0 for the ASGI middleware: it cannot "
                                                "re-run the app's request (retries are the sidecar's)")
        self.app = app
        self.config = config
        self.on_abort = on_abort
        self.on_finished = on_finished
        self.request_id_header = request_id_header.lower().encode("latin-1")
        self.replay_store: ReplayStore | None = None
        self.caller_key = CallerKey.from_config(config)
        if config.resume:
            self.replay_store = replay_store or MemoryReplayStore.from_config(config)
            if replay_store is not None and not config.resume_owner_secret:
                logger.warning("resume_owner_secret is empty: a reconnect served by another process "
                               "sharing this replay store will not find its stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Responder(self, scope, receive, send).run()


class _Responder:
    """One HTTP request: the app task, the listener, and (for an event stream)
    the core and its writer task. See the module docstring."""

    def __init__(self, middleware: TokenWireMiddleware, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.middleware = middleware
        self.config = middleware.config
        self.receive = receive
        self.send = send
        self.loop = asyncio.get_running_loop()
        self.request_id = _request_id(scope, middleware.request_id_header)
        self.scope = dict(scope)
        self.scope["extensions"] = {**(scope.get("extensions") or {}), EXTENSION: StreamControl(self)}
        self.mode = _Mode.UNDECIDED
        self.stream: WireStream | None = None
        self.app_task: asyncio.Task[None] | None = None
        self.writer_task: asyncio.Task[None] | None = None
        # Request side.
        self.inbox: deque[Message] = deque()
        self.inbox_ready = asyncio.Event()
        self.body_consumed = asyncio.Event()
        self.read_ahead_bytes = 0
        self.client_gone = False
        # Response side.
        self.response_complete = False
        self.app_ended = False
        self.app_cancelled_by_us = False
        self.start_message: Message | None = None
        self.close: CloseClient | None = None
        self.wake: asyncio.Future[None] | None = None  # set while the writer waits
        self.writer_sending = False
        self.pending_send: Awaitable[None] | None = None  # an inline send that suspended
        self.pending_paused = False  # ... after forward_read: the core was told SocketPaused
        self.upstream_resumed: asyncio.Event | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.hook_tasks: list[asyncio.Future[Any]] = []
        self.writer_error: Exception | None = None
        # Resume.
        self.stream_id = new_stream_id() if self.config.resume else None
        self.stream_opened = False  # the store has it (opened before its first append)
        self.owner = ""  # the caller's hash, the stream's owner in the store
        self.replaying = False
        self.held = False  # the core holds the stream for a reconnect: the app keeps going
        self.reader_wait: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ the call

    async def run(self) -> None:
        app_task = self.loop.create_task(self.call_app())
        self.app_task = app_task
        app_task.add_done_callback(self.on_app_done)
        listener = self.loop.create_task(self.listen())
        try:
            await asyncio.wait((app_task,))
            if self.writer_task is not None:
                await asyncio.wait((self.writer_task,))
        finally:
            listener.cancel()
            self.cancel_timer()
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
        if self.middleware.replay_store is not None and await self.served_from_store():
            return
        await self.middleware.app(self.scope, self.app_receive, self.app_send)

    # ------------------------------------------------------------ resume

    async def served_from_store(self) -> bool:
        """Answer a reconnect or a repeated idempotency key from the store
        (True), or open this request's stream there and let the app run."""
        store = self.middleware.replay_store
        assert store is not None and self.stream_id is not None
        method = str(self.scope.get("method", "GET"))
        headers = [(bytes(k).lower(), bytes(v)) for k, v in self.scope.get("headers", ())]
        body = await self.read_body() if method == "POST" and any(
            k == b"idempotency-key" for k, _ in headers) else b""
        self.owner = self.middleware.caller_key.owner(headers)
        try:
            route = classify(method, str(self.scope.get("path", "")), headers, body)
            source = await admit(store, route, stream_id=self.stream_id, owner=self.owner,
                                 open_now=False)
        except WireError as error:
            self.refuse(error)
            return True
        except StoreUnavailable as error:
            logger.warning("request %s: not resumable: %s", self.request_id, error)
            return False
        if source is not None:
            await self.replay(store, source.stream_id, source.after_seq)
            return True
        self.stream_opened = route is not None  # an idempotent request's stream is open
        return False

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
            self.inbox.appendleft(message)
            self.read_ahead_bytes += len(message.get("body", b""))
        self.inbox_ready.set()
        return b"".join(bytes(m.get("body", b"")) for m in messages)

    def refuse(self, error: WireError) -> None:
        stream = self.start_stream()
        self.app_ended = True
        self.apply(stream.handle(Rejected(error), self.loop.time()))

    async def replay(self, store: ReplayStore, stream_id: str, after_seq: int) -> None:
        self.replaying = True
        stream = self.start_stream()
        self.apply(stream.handle(ReplaySource(stream_id, after_seq), self.loop.time()))
        readable = asyncio.Event()
        readable.set()
        self.upstream_resumed = readable

        def feed(event: Input) -> None:
            self.apply(stream.handle(event, self.loop.time()))

        await feed_replay(store, stream_id, after_seq, readable=readable, feed=feed)
        self.app_ended = True

    async def await_reader(self, action: AwaitReader) -> None:
        store = self.middleware.replay_store
        assert store is not None
        if await store.wait_reader(action.stream_id, max(action.until - self.loop.time(), 0.0)):
            stream = self.stream
            if stream is not None:
                self.apply(stream.handle(ReaderAttached(), self.loop.time()))

    # ------------------------------------------------------------ request side

    async def listen(self) -> None:
        """Own the server's ``receive``: queue request messages for the app and
        notice the client leaving whenever it happens."""
        receive = self.receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.on_disconnect()
                return
            self.inbox.append(message)
            self.inbox_ready.set()
            self.read_ahead_bytes += len(message.get("body", b""))
            while self.read_ahead_bytes > REQUEST_READ_AHEAD_BYTES:
                self.body_consumed.clear()
                await self.body_consumed.wait()

    async def app_receive(self) -> Message:
        while not self.inbox:
            if self.client_gone and not self.held:
                return {"type": "http.disconnect"}
            self.inbox_ready.clear()
            await self.inbox_ready.wait()
        message = self.inbox.popleft()
        body = message.get("body")
        if body:
            self.read_ahead_bytes -= len(body)
            self.body_consumed.set()
        return message

    def on_disconnect(self) -> None:
        self.client_gone = True
        self.inbox_ready.set()
        if self.response_complete:
            return  # the server says so once the response is complete: not an abort
        if self.mode is _Mode.PASSTHROUGH:
            self.abort_app(EndReason.CLIENT_GONE)
            return
        stream = self.stream if self.stream is not None else self.start_stream()
        self.apply(stream.handle(ClientGone(), self.loop.time()))

    def request_abort(self) -> None:
        if self.response_complete:
            return
        if self.mode is _Mode.PASSTHROUGH:
            self.abort_app(EndReason.CANCELLED)
            return
        stream = self.stream if self.stream is not None else self.start_stream()
        self.apply(stream.handle(StopRequested(EndReason.CANCELLED), self.loop.time()))

    # ------------------------------------------------------------ the app's send

    async def app_send(self, message: Message) -> None:
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
            if store is not None and not self.stream_opened and self.stream_id is not None:
                # Before the core's first ReplayAppend can reach the store.
                try:
                    await store.open(self.stream_id, owner=self.owner)
                except StoreUnavailable as error:
                    logger.warning("request %s: not resumable: %s", self.request_id, error)
                self.stream_opened = True
            stream = self.start_stream()
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
        if body and not self.forward_inline(stream, bytes(body), now):
            self.apply(stream.handle(UpstreamData(bytes(body)), now), wake=False)
            if not self.write_inline(stream):
                self.wake_writer()
        if not message.get("more_body", False):
            self.app_ended = True
            self.apply(stream.handle(UpstreamEnded(), now))
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
        elif (error := task.exception()) is not None:
            # The client sees the exception's type only; the server logs the rest.
            message = f"the application raised {type(error).__name__}"
        else:
            message = "the application returned without ending the response"
        self.apply(stream.handle(UpstreamFailed(FailureKind.PROTOCOL, message), self.loop.time()))

    # ------------------------------------------------------------ the core

    def start_stream(self) -> WireStream:
        self.mode = _Mode.STREAM
        stream = WireStream(self.config, now=self.loop.time(), request_id=self.request_id,
                            upstreams=("app",), expect_stream=True, stream_id=self.stream_id)
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
            self.cancel_timer()
            self.held = False
            if self.reader_wait is not None:
                self.reader_wait.cancel()
            if self.upstream_resumed is not None:
                self.upstream_resumed.set()
            if self.client_gone and self.writer_sending and self.writer_task is not None:
                self.writer_task.cancel()
        else:
            self.arm_timer(stream)
        if wake:
            self.wake_writer()

    def wake_writer(self) -> None:
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set_result(None)

    def writer_idle(self) -> bool:
        """The writer waits with nothing of its own to do: this send may write."""
        return (self.wake is not None and not self.writer_sending and self.start_message is None
                and self.close is None and self.pending_send is None)

    def forward_inline(self, stream: WireStream, body: bytes, now: float) -> bool:
        """The keeps-up path: the core's one call (``forward_read``) gives the
        bytes to write and the server's ``send`` takes them at once. A send
        that suspends instead means the socket is full: the core is told it
        is paused until the writer has finished that send. False (and
        nothing done) when the core says this body needs its usual way."""
        if not self.writer_idle():
            return False
        out = stream.forward_read(body, now)
        if out is None:
            return False
        self.start_send(stream, out, paused=True)
        return True

    def start_send(self, stream: WireStream, data: bytes, *, paused: bool) -> None:
        """Run the server's ``send`` of ``data`` here until it completes or
        suspends; a suspended one is handed to the writer (``pending_send``),
        which finishes it. ``paused``: the core counted the write as done, so
        a suspension is reported as ``SocketPaused`` (resumed when it ends);
        otherwise the write is in flight and ends with ``WriteCompleted``."""
        sending = self.send({"type": "http.response.body", "body": data, "more_body": True})
        if inspect.iscoroutine(sending):
            try:
                yielded = sending.send(None)
            except StopIteration:
                if not paused:
                    self.apply(stream.handle(WriteCompleted(), self.loop.time()), wake=False)
                    if (self.start_message is not None or self.close is not None or stream.finished
                            or stream.pending_bytes):
                        self.wake_writer()
                return
            except Exception as error:
                # As the writer does when the server's send fails.
                if not isinstance(error, OSError):
                    self.writer_error = error
                self.client_gone = True
                self.apply(stream.handle(ClientGone(), self.loop.time()))
                return
            self.pending_send = _finish(sending, yielded)
        else:
            self.pending_send = sending  # some other awaitable: the writer awaits it
        # Outstanding: the writer owns it now.
        self.pending_paused = paused
        self.writer_sending = True
        if paused:
            self.apply(stream.handle(SocketPaused(), self.loop.time()), wake=False)
        self.wake_writer()

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
            # Structured fields (tokenwire.middleware.logs formats them as JSON or text).
            logger.info("stream ended", extra={"fields": record.to_json()})

    # ------------------------------------------------------------ timer

    def arm_timer(self, stream: WireStream) -> None:
        deadline = stream.next_deadline()
        if deadline is None:
            return
        if self.timer is not None:
            if self.timer_at <= deadline:
                return  # it fires early, ticks harmlessly and re-arms
            self.timer.cancel()
        self.timer_at = deadline
        self.timer = self.loop.call_at(deadline, self.on_timer)

    def on_timer(self) -> None:
        self.timer = None
        stream = self.stream
        if stream is not None and not stream.finished:
            # call_at may run a hair before its time; the core must see the deadline reached.
            self.apply(stream.handle(Tick(), max(self.loop.time(), self.timer_at)))

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # ------------------------------------------------------------ writer

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


@types.coroutine
def _finish(coroutine: Any, yielded: Any) -> Generator[Any, Any, None]:
    """The rest of a coroutine that was started by hand and suspended on
    ``yielded``: awaited by a task, it runs on exactly as if the task had
    started it (what the task sends or throws in goes to the coroutine)."""
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


def _request_id(scope: Scope, header: bytes) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == header and value:
            return bytes(value).decode("latin-1")
    return uuid.uuid4().hex


def listening_socket(host: str, port: int, config: WireConfig = DEFAULT_CONFIG,
                     *, backlog: int = 2048) -> socket.socket:
    """A TCP listening socket whose accepted connections get a send buffer of
    ``config.socket_send_buffer_bytes`` (Linux copies it from the listener).

    ASGI gives an app no access to its socket, so this is how a deployment caps
    the kernel buffer that would otherwise hide a slow client from the core
    (docs/architecture.md#slow-readers): pass it to ``uvicorn.Server.serve(sockets=[...])``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_send_buffer_bytes)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock

