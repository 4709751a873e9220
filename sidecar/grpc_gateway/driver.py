"""The glue between gRPC calls and HTTP/2 streams: the only module here doing I/O.

:class:`GrpcRouter` is the HTTP/2 connection's stream route: a request with
``content-type: application/grpc`` gets a handler here instead of the proxy's
own exchange, and a request on a gRPC path with any other content type gets
415, as the gRPC spec says, nothing forwarded.

A ``tokenwire.v1`` call (:class:`StreamCall`) reads its one request message,
transcodes it to the engine's OpenAI request and hands it to an ordinary
:class:`~tokenwire.sidecar.exchange.loop.Exchange` with itself as the
``Downstream``: the same wire core decides everything (retries before the
first message, the commit deadline, coalescing while the stream's send window
is shut, the write deadline, the record, the abort on cancel); the
:class:`~tokenwire.sidecar.grpc_gateway.call.ResponseTranscoder` turns what it
writes into messages and trailers. The client's ``grpc-timeout`` arms a timer
that stops the stream through the core. A client that stopped reading is cut
with trailers at once (``RESOURCE_EXHAUSTED``, ``backpressure_exceeded`` or
``send_timeout``), what its window held back dropped.

``Streams.CancelStream`` (:class:`CancelCall`) is the HTTP cancel by id made
over gRPC: the call's metadata and ``DELETE /v1/streams/{id}`` go to an
exchange like any request's (``cancel.py`` says what it answers).

Health (``Check``, ``Watch``) and reflection are answered here; watches hear
of a drain (SIGTERM) through ``SidecarContext.on_drain``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenwire.middleware import EndReason, StopRequested
from tokenwire.middleware.core.errors import GrpcStatus

from ..context import SidecarContext
from ..downstream.connection import Peer, new_exchange
from ..exchange.loop import Exchange
from ..process.readiness import readiness
from . import health, reflection
from .call import CoreEnding, Deadline, ResponseTranscoder
from .cancel import CancelAnswer, cancel_target
from .framing import GrpcCallError, encode_message, is_grpc_content_type
from .metadata import GRPC_CONTENT_TYPE, OK, CallStatus, Header
from .replies import Messages, end_call, request_headers
from .routing import (
    CANCEL_STREAM,
    HEALTH_CHECK,
    HEALTH_WATCH,
    REFLECTION_PATHS,
    STREAM_METHODS,
    StreamMethod,
    is_grpc_path,
)
from .transcode import decode_request

if TYPE_CHECKING:
    from ..downstream.http2_request import RequestHead
    from ..downstream.http2_stream import Http2Stream, StreamHandler


class GrpcRouter:
    """The HTTP/2 stream route for gRPC (see the module docstring); one per sidecar."""

    def __init__(self, context: SidecarContext) -> None:
        self.context = context
        self.watches: set[HealthWatch] = set()
        context.on_drain.append(self.drain_started)

    def __call__(self, head: RequestHead, stream: Http2Stream) -> StreamHandler | None:
        content_type = head.header(b"content-type")
        if not is_grpc_content_type(content_type):
            if not is_grpc_path(head.path):
                return None
            return Refusal(stream, http_status=415)
        path = head.path
        try:
            method = STREAM_METHODS.get(path)
            if method is not None:
                return StreamCall(self, head, stream, method)
            if path == CANCEL_STREAM:
                return CancelCall(self, head, stream)
            if path == HEALTH_CHECK:
                return UnaryCall(self, stream, lambda request: health.check(request, serving=self.serving()))
            if path == HEALTH_WATCH:
                return HealthWatch(self, stream)
            if path in REFLECTION_PATHS:
                return ReflectionCall(self, stream)
            raise GrpcCallError(GrpcStatus.UNIMPLEMENTED, f"unknown method {path[:200].decode('latin-1')}")
        except GrpcCallError as error:
            return Refusal(stream, status=CallStatus(error.status, error.message))

    def serving(self) -> bool:
        """gRPC health's answer: what ``/readyz`` says now."""
        return readiness(self.context, asyncio.get_running_loop().time()).ready

    def drain_started(self) -> None:
        """SIGTERM: every watch hears NOT_SERVING, then its call ends."""
        for watch in list(self.watches):
            watch.drain_started()

    @property
    def max_message_bytes(self) -> int:
        return self.context.config.grpc_max_message_bytes


class Refusal:
    """A call answered at once (415, or a status), its request body ignored."""

    def __init__(self, stream: Http2Stream, *, http_status: int = 200,
                 status: CallStatus | None = None) -> None:
        self._stream = stream
        if status is None:
            stream.respond_head(http_status, [(b"content-type", b"text/plain")])
            stream.send_body(b"gRPC methods need content-type application/grpc\n")
            stream.end_response(abrupt=False, reset=False)
        else:
            end_call(stream, status, started=False)
        stream.exchange_finished(None)

    def data_received(self, data: bytes) -> None:
        pass

    def request_ended(self) -> None:
        pass

    def stream_reset(self) -> None:
        pass


class UnaryCall:
    """One request message, one response message (health ``Check``)."""

    def __init__(self, router: GrpcRouter, stream: Http2Stream, answer: Callable[[bytes], bytes]) -> None:
        """``answer``: the serialized response for the serialized request, or ``GrpcCallError``."""
        self._stream = stream
        self._messages = Messages(router.max_message_bytes, stream)
        self._answer = answer
        self._requests: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self._requests += self._messages.read(data)

    def request_ended(self) -> None:
        if not self._messages.close():
            return
        if len(self._requests) != 1:
            self._messages.refuse(GrpcCallError(
                GrpcStatus.UNIMPLEMENTED if self._requests else GrpcStatus.INTERNAL,
                f"expected one request message, got {len(self._requests)}"), started=False)
            return
        try:
            response = self._answer(self._requests[0])
        except GrpcCallError as error:
            self._messages.refuse(error, started=False)
            return
        self._stream.respond_head(200, [(b"content-type", GRPC_CONTENT_TYPE)])
        self._stream.send_body(encode_message(response))
        self._messages.finish(OK, started=True)

    def stream_reset(self) -> None:
        self._messages.done = True
        self._stream.exchange_finished(None)


class ReflectionCall:
    """Server reflection: a bidirectional stream, each request answered as it comes."""

    def __init__(self, router: GrpcRouter, stream: Http2Stream) -> None:
        self._stream = stream
        self._messages = Messages(router.max_message_bytes, stream)
        self._started = False

    def data_received(self, data: bytes) -> None:
        for request in self._messages.read(data):
            try:
                response = reflection.answer(request)
            except GrpcCallError as error:
                self._messages.refuse(error, started=self._started)
                return
            if not self._started:
                self._started = True
                self._stream.respond_head(200, [(b"content-type", GRPC_CONTENT_TYPE)])
            self._stream.send_body(encode_message(response))

    def request_ended(self) -> None:
        if self._messages.close():
            self._messages.finish(OK, started=self._started)

    def stream_reset(self) -> None:
        self._messages.done = True
        self._stream.exchange_finished(None)


class HealthWatch:
    """``Watch``: the status now, then each change, while the call lasts."""

    def __init__(self, router: GrpcRouter, stream: Http2Stream) -> None:
        self._router = router
        self._stream = stream
        self._messages = Messages(router.max_message_bytes, stream)
        self._watcher: health.Watcher | None = None

    def data_received(self, data: bytes) -> None:
        for request in self._messages.read(data):
            if self._watcher is not None:
                self._messages.refuse(GrpcCallError(GrpcStatus.UNIMPLEMENTED,
                                                    "expected one request message"), started=True)
                self._router.watches.discard(self)
                return
            try:
                service = health.parse_request(request)
            except GrpcCallError as error:
                self._messages.refuse(error, started=False)
                return
            self._watcher = health.Watcher(service)
            self._router.watches.add(self)
            self._stream.respond_head(200, [(b"content-type", GRPC_CONTENT_TYPE)])
            self._send_update()

    def request_ended(self) -> None:
        if self._watcher is None and self._messages.close():
            self._messages.refuse(GrpcCallError(GrpcStatus.INTERNAL, "no request message"),
                                  started=False)

    def drain_started(self) -> None:
        self._send_update()
        self._router.watches.discard(self)
        # The drain closes connections once their streams end: this one ends now.
        self._messages.finish(CallStatus(GrpcStatus.UNAVAILABLE, "the server is shutting down"),
                              started=True)

    def stream_reset(self) -> None:
        self._router.watches.discard(self)
        self._messages.done = True
        self._stream.exchange_finished(None)

    def _send_update(self) -> None:
        if self._watcher is None or self._messages.done:
            return
        update = self._watcher.update(serving=self._router.serving())
        if update is not None:
            self._stream.send_body(encode_message(update))


class StreamCall:
    """A ``tokenwire.v1`` call, proxied through an exchange (see the module docstring)."""

    def __init__(self, router: GrpcRouter, head: RequestHead, stream: Http2Stream,
                 method: StreamMethod) -> None:
        self._router = router
        self._context = router.context
        self._head = head
        self._stream = stream
        self._method = method
        self._messages = Messages(router.max_message_bytes, stream)
        self._requests: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._exchange: Exchange | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.transcoder = ResponseTranscoder(
            method, metadata_headers=(self._context.config.request_id_header.encode(),))
        self._deadline = Deadline.from_headers(head.headers, self._loop.time())  # GrpcCallError if malformed
        if self._deadline is not None:
            self._timer = self._loop.call_at(self._deadline.at, self._deadline_passed)

    # ------------------------------------------------------------ StreamHandler

    def data_received(self, data: bytes) -> None:
        self._requests += self._messages.read(data)
        if len(self._requests) > 1:
            self._refuse(GrpcCallError(GrpcStatus.UNIMPLEMENTED,
                                       "a server-streaming method takes one request message"))

    def request_ended(self) -> None:
        if not self._messages.close():
            self._cancel_timer()
            return
        if len(self._requests) != 1:
            self._refuse(GrpcCallError(GrpcStatus.INTERNAL,
                                       f"expected one request message, got {len(self._requests)}"))
            return
        if self._deadline is not None and self._deadline.passed(self._loop.time()):
            # Already past (grpc-timeout: 0n, or spent reading the request): no
            # generation for an answer nobody waits for; the timer may not have run yet.
            self._cancel_timer()
            self._deadline_passed()
            return
        try:
            request = decode_request(self._method.request_type, self._requests[0])
            body = self._method.to_body(request)
        except GrpcCallError as error:
            self._refuse(error)
            return
        self._start(_json_bytes(body))

    def stream_reset(self) -> None:
        # Only before the exchange started (after, the stream tells the exchange itself).
        self._cancel_timer()
        self._messages.done = True
        self._stream.exchange_finished(None)

    # ------------------------------------------------------------ Downstream (for the exchange)

    def send_headers(self, status: int, headers: Sequence[Header]) -> None:
        initial = self.transcoder.on_headers(status, headers)
        if initial is not None:
            self._stream.respond_head(200, initial)

    def send_body(self, data: bytes) -> None:
        out = self.transcoder.on_body(data, self._core())
        if out:
            self._stream.send_body(out)

    def end_response(self, *, abrupt: bool, reset: bool) -> None:
        stream = self._stream
        ending = self.transcoder.on_end(self._core(), abrupt=abrupt, reset=reset)
        if ending.data:
            stream.send_body(ending.data)
        # A reset (the client stopped reading): what waits is dropped, the
        # trailers (not flow-controlled) say why.
        end_call(stream, ending.status, started=not ending.trailers_only, drop_waiting=reset,
             extra=ending.extra)

    def closing_probe(self) -> Callable[[], bool] | None:
        return self._stream.closing_probe()

    def exchange_finished(self, exchange: Exchange | None) -> None:
        self._cancel_timer()
        self._stream.exchange_finished(exchange)

    # ------------------------------------------------------------ helpers

    def _start(self, body: bytes) -> None:
        headers = [*request_headers(self._head), (b"content-type", b"application/json"),
                   (b"accept", b"text/event-stream")]
        exchange = new_exchange(self._context, self, method=b"POST", target=self._method.upstream_target,
                                headers=headers, body=body, peer=self._peer(), http_version="2")
        # A gRPC client does not reconnect with Last-Event-ID: a drain ends its call as before.
        exchange.hands_off = False
        self._exchange = exchange
        self._stream.exchange = exchange  # the stream tells it of resets and send windows
        exchange.start()
        self._stream.update_paused()

    def _core(self) -> CoreEnding:
        """The exchange's wire core, whose typed ending the transcoder maps. Only
        the exchange makes the ``Downstream`` calls, so it exists by then."""
        if self._exchange is None:
            raise RuntimeError("a Downstream call before the call's exchange was made")
        return self._exchange.stream

    def _peer(self) -> Peer:
        return self._stream.connection.peer

    def _refuse(self, error: GrpcCallError) -> None:
        self._cancel_timer()
        self._messages.refuse(error, started=False)

    def _deadline_passed(self) -> None:
        self._timer = None
        if self._exchange is None:
            self._messages.finish(CallStatus(GrpcStatus.DEADLINE_EXCEEDED, "the call's deadline passed"),
                                  started=False)
            return
        self.transcoder.deadline_passed()
        self._exchange.feed(StopRequested(EndReason.CANCELLED))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class CancelCall:
    """``Streams.CancelStream``: its one request message becomes ``DELETE
    /v1/streams/{id}``, proxied through an exchange as the HTTP port's is, so
    the owner check, ``answer_cancel`` and ``registry.stop_writer`` are the
    very ones the HTTP cancel runs; :class:`~.cancel.CancelAnswer` turns the
    answer into the reply or a status."""

    def __init__(self, router: GrpcRouter, head: RequestHead, stream: Http2Stream) -> None:
        self._router = router
        self._head = head
        self._stream = stream
        self._messages = Messages(router.max_message_bytes, stream)
        self._requests: list[bytes] = []
        self._exchange: Exchange | None = None
        self._answer = CancelAnswer()

    def data_received(self, data: bytes) -> None:
        self._requests += self._messages.read(data)

    def request_ended(self) -> None:
        if not self._messages.close():
            return
        try:
            if len(self._requests) != 1:
                raise GrpcCallError(GrpcStatus.UNIMPLEMENTED if self._requests else GrpcStatus.INTERNAL,
                                    f"expected one request message, got {len(self._requests)}")
            target = cancel_target(self._requests[0])
        except GrpcCallError as error:
            self._messages.refuse(error, started=False)
            return
        # The metadata as the HTTP request's headers: ``authorization`` (or the
        # operator's resume_owner_header) is the caller, checked as over HTTP.
        exchange = new_exchange(self._router.context, self, method=b"DELETE", target=target,
                                headers=request_headers(self._head), body=b"",
                                peer=self._stream.connection.peer, http_version="2")
        self._exchange = exchange
        self._stream.exchange = exchange
        exchange.start()
        self._stream.update_paused()

    def stream_reset(self) -> None:
        # Only before the exchange started (after, the stream tells the exchange itself).
        self._messages.done = True
        self._stream.exchange_finished(None)

    # ------------------------------------------------------------ Downstream (for the exchange)

    def send_headers(self, status: int, headers: Sequence[Header]) -> None:
        self._answer.on_headers(status, headers)

    def send_body(self, data: bytes) -> None:
        self._answer.on_body(data)

    def end_response(self, *, abrupt: bool, reset: bool) -> None:
        if self._exchange is None:
            raise RuntimeError("a Downstream call before the call's exchange was made")
        ending = self._answer.on_end(self._exchange.stream, abrupt=abrupt)
        if ending.reply is None:
            end_call(self._stream, ending.status, started=False, drop_waiting=reset)
            return
        request_id = self._router.context.config.request_id_header.encode()
        self._stream.respond_head(200, [(b"content-type", GRPC_CONTENT_TYPE),
                                        (request_id, self._exchange.request_id.encode("latin-1"))])
        self._stream.send_body(encode_message(ending.reply))
        end_call(self._stream, ending.status, started=True, drop_waiting=reset)

    def closing_probe(self) -> Callable[[], bool] | None:
        return self._stream.closing_probe()

    def exchange_finished(self, exchange: Exchange | None) -> None:
        self._stream.exchange_finished(exchange)


def _json_bytes(body: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON; with a lone surrogate (a ``\\udXXX`` escape in
    ``extra_json``, not UTF-8) all escaped, so the engine reads what the client wrote."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()
