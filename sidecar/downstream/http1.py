"""The client side over HTTP/1.1: one ``asyncio.Protocol`` per connection, driving h11.

Theory of operation
-------------------
A connection moves through four phases, and one timer guards each:

    IDLE ──first byte──▶ HEAD ──Request──▶ BODY ──EndOfMessage──▶ RESPONSE
     ▲                                                               │
     └────────────── response complete, keep-alive ◀────────────────┘

* IDLE: between requests; ``keepalive_timeout_s`` closes it silently (a new
  connection gets ``header_read_timeout_s`` instead).
* HEAD: ``header_read_timeout_s`` to finish the request head, else 408
  (slowloris); h11's buffer limit gives 431 for a head over ``max_head_bytes``.
* BODY: the whole body is read (bounded by ``max_body_bytes``, 413) within
  ``body_read_timeout_s``; the wire core needs the request classified (stream
  or not) before it starts, and retries need the body to send it again.
* RESPONSE: an :class:`~tokenwire.sidecar.exchange.loop.Exchange` owns the
  response. The connection keeps reading so a client that leaves is seen at
  once (``connection_lost`` → ``ClientGone``), even while the upstream is
  silent; pipelined requests wait in h11's buffer (reading pauses if they pile
  up) and are served in order once the response is complete.

Requests refused before reaching an upstream (limits, malformed, smuggling,
too many connections) get a small JSON error, ``Connection: close``, and a
lingering close: half-close, drain what the client is still sending, then
close, so the client reads the status instead of a reset.

``pause_writing``/``resume_writing`` become ``SocketPaused``/``SocketResumed``
(the socket is tuned for that in ``connection.set_up_transport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import struct
import typing
from collections.abc import Callable, Sequence

import h11
from tokenwire.middleware import SocketPaused, SocketResumed
from tokenwire.middleware.core.headers import header_value

from ..context import SidecarContext
from ..exchange.loop import Exchange
from .connection import (
    BUSY_BODIES,
    LINGER_S,
    BodyReservation,
    Peer,
    new_exchange,
    preflight,
    refusal,
    set_up_transport,
    with_cors,
)
from .framing import ChunkedScanner, head_length, request_line_end, request_line_problem
from .h11_layout import chunk_size_line, declares_chunked, refusal_head, send_response_head
from .http1_faults import h11_fault, request_problem

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# Pipelined requests buffered beyond this pause reading until the current response ends.
_PIPELINE_BUFFER_BYTES = 64 * 1024


class Phase(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    RESPONSE = "response"
    CLOSING = "closing"


class ClientConnection(asyncio.Protocol):
    """One client connection: h11 in, exchanges out. See the module docstring."""

    def __init__(self, context: SidecarContext, *, over_limit: bool | None = None) -> None:
        """``over_limit``: whether the connection came in past ``max_connections``
        (None: counted when the transport arrives)."""
        self._context = context
        self._config = context.config
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        # The transport's write, bound once (send_framed: a method lookup per event otherwise).
        self._transport_write: Callable[[bytes], None] | None = None
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self._config.max_head_bytes)
        self._phase = Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._peer = Peer(host=None, server_port=None, scheme="http", client_cert_der=None)
        self._over_limit = over_limit
        self._write_paused = False
        self._reading_paused = False
        self._lost = False
        self._request: h11.Request | None = None
        # Its headers as a list, made once: h11's Headers is iterated in Python,
        # a call per header, and the exchange, the CORS check and the head read them.
        self._request_headers: list[Header] = []
        self._body = bytearray()
        self._exchange: Exchange | None = None
        self._chunked_body = False
        self._held_head = b""  # the response head, until the first body bytes (see send_headers)
        # What arrived since the current request head began, for _framing_problem.
        # One buffer, not a list of reads: a client sending a byte per packet
        # would otherwise cost an object per byte.
        self._head_received = bytearray()
        # The current head's request line was complete and found servable.
        self._line_checked = False
        # Follows a chunked body beside h11 (framing.py); None otherwise.
        self._chunks: ChunkedScanner | None = None
        # This request's body, counted in context.buffered_body_bytes.
        self._body_reserved = BodyReservation(context)

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        transport = typing.cast(asyncio.Transport, transport)
        self._transport = transport
        self._transport_write = transport.write
        context = self._context
        if self._over_limit is None:
            self._over_limit = len(context.connections) >= self._config.max_connections
        context.connections.add(self)
        context.metrics.active_connections.inc()
        self._peer = set_up_transport(context, transport)
        self._arm_timer(self._config.header_read_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._phase is Phase.CLOSING:
            return  # lingering close: drain and ignore
        if self._phase is Phase.IDLE:
            self._phase = Phase.HEAD
            self._arm_timer(self._config.header_read_timeout_s)
        if self._phase is Phase.HEAD:
            # Bounded: h11 refuses a head still incomplete past max_head_bytes.
            self._head_received += data
            # Checked once, when the line is complete: only a read with a LF can complete it.
            if not self._line_checked and b"\n" in data and self._request_line_refused():
                return
        elif self._phase is Phase.BODY and self._chunks is not None:
            problem = self._chunks.feed(data)
            if problem is not None:
                self._refuse(*problem)
                return
        try:
            self._conn.receive_data(data)
        except h11.RemoteProtocolError as error:
            self._refuse_malformed(error)
            return
        if self._phase is Phase.RESPONSE:
            # Pipelined bytes wait in h11's buffer; stop reading if they pile up.
            if len(self._conn.trailing_data[0]) > _PIPELINE_BUFFER_BYTES and self._transport:
                self._transport.pause_reading()
                self._reading_paused = True
            return
        self._process()

    def eof_received(self) -> bool | None:
        # A client that half-closes mid-response is treated as gone, as most
        # servers do; returning None closes the transport (→ connection_lost).
        if self._phase in (Phase.HEAD, Phase.BODY):
            with contextlib.suppress(h11.RemoteProtocolError):
                self._conn.receive_data(b"")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        exchange = self._exchange
        if exchange is not None:
            # First: the exchange closes the upstream before any bookkeeping.
            exchange.client_departed()
        self._cancel_timer()
        if self._exchange is None:
            self._release_body()
        elif self._exchange.departed:
            # Its stream's end waits for the burst of departures to be over
            # (each next client's upstream is cut first): so does this.
            self._context.departures.defer(self._forget)
            return
        self._forget()

    def _forget(self) -> None:
        """The connection is gone: no longer counted or drained."""
        context = self._context
        if self in context.connections:
            context.connections.discard(self)
            context.metrics.active_connections.dec()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._exchange is not None:
            self._exchange.feed(SocketPaused())

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._exchange is not None:
            self._exchange.feed(SocketResumed())

    # ------------------------------------------------------------ requests

    def _process(self) -> None:
        """Handle buffered request events until a response starts or data runs out."""
        while self._exchange is None and self._phase is not Phase.CLOSING and not self._lost:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as error:
                self._refuse_malformed(error)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_request(event)
            elif isinstance(event, h11.Data):
                # Typed bytes, but h11 hands a bytearray out: read untyped, as
                # compiled code checks a typed read's type at run time.
                untyped: typing.Any = event
                self._on_body(untyped.data)
            elif isinstance(event, h11.EndOfMessage):
                self._start_exchange()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return

    def _on_request(self, request: h11.Request) -> None:
        config = self._config
        self._phase = Phase.BODY
        self._arm_timer(config.body_read_timeout_s)
        headers = list(request.headers)
        received, self._head_received = self._head_received, bytearray()
        if self._context.draining or self._over_limit:
            self._refuse(503, "the server is not taking new requests", retry_after_s=1)
            return
        problem = request_problem(request, headers, received, config)
        if problem is not None:
            self._refuse(*problem)
            return
        length = header_value(headers, b"content-length")
        if length is not None and not self._reserve_body(int(length)):
            return
        if any(name == b"transfer-encoding" for name, _ in headers):
            self._chunks = ChunkedScanner(config.max_body_bytes)
            fault = self._chunks.feed(memoryview(received)[head_length(received):])
            if fault is not None:
                self._refuse(*fault)
                return
        self._request = request
        self._request_headers = headers
        self._body = bytearray()
        if self._conn.they_are_waiting_for_100_continue:
            self._write(self._conn.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _on_body(self, data: bytes | bytearray) -> None:
        self._body += data
        if len(self._body) > self._config.max_body_bytes:
            self._refuse(413, f"request body over {self._config.max_body_bytes} bytes")
        elif self._chunks is not None:
            # A chunked body announces no length: it is counted as it comes.
            self._reserve_body(len(data))

    def _reserve_body(self, body_bytes: int) -> bool:
        """Count ``body_bytes`` more against ``max_buffered_body_bytes``; refuse
        with 503 (and False) if all connections together would hold more."""
        if self._body_reserved.reserve(body_bytes):
            return True
        self._refuse(503, BUSY_BODIES, retry_after_s=1)
        return False

    def _release_body(self) -> None:
        self._body_reserved.release()

    def _start_exchange(self) -> None:
        request = self._request
        assert request is not None
        self._phase = Phase.RESPONSE
        self._cancel_timer()
        headers = self._request_headers
        answer = preflight(self._context, request.method, headers)
        if answer is not None:
            self._answer_preflight(*answer)
            return
        body = bytes(self._body)
        self._body = bytearray()
        exchange = new_exchange(self._context, self, method=request.method, target=request.target,
                                headers=headers, body=body, peer=self._peer,
                                http_version=request.http_version.decode())
        self._exchange = exchange
        exchange.send_framed = self.send_framed
        exchange.start()
        if self._write_paused:
            exchange.feed(SocketPaused())

    # ------------------------------------------------------------ Downstream (for the exchange)

    def send_headers(self, status: int, headers: Sequence[Header]) -> None:
        """Send the response head (called by the exchange on ``CommitHeaders``)."""
        if self._request is not None:
            headers = with_cors(self._context, self._request_headers, headers)
        else:
            headers = list(headers)
        if self._context.draining:
            headers.append((b"connection", b"close"))
        head = send_response_head(self._conn, status, headers)
        # h11 chose the body framing and wrote it into the head. When it is
        # chunked, send_body frames the chunks itself (h11_layout: why that is
        # h11's framing); a Content-Length body keeps going through h11, which
        # checks the length.
        request = self._request
        self._chunked_body = declares_chunked(head, status, None if request is None else request.method)
        # Held for a moment: the first body bytes usually follow at once, and
        # head and body then leave in one send(). This loop turn sends it at the latest.
        self._held_head = head
        self._loop.call_soon(self._send_held_head)

    def _send_held_head(self) -> None:
        head, self._held_head = self._held_head, b""
        self._write(head)

    def send_body(self, data: bytes) -> None:
        head, self._held_head = self._held_head, b""
        if not self._chunked_body:
            self._write(head + self._conn.send(h11.Data(data=data)))
        elif data and self._transport is not None and not self._lost:
            self._transport.write(b"".join((head, chunk_size_line(len(data)), data, b"\r\n")))
        else:
            self._write(head)

    def send_framed(self, data: bytes, framed: bytes) -> None:
        """``send_body(data)``, given ``framed``: ``data`` framed as
        ``send_body`` frames a chunk (its ``%x`` size line, the data, CRLF),
        as an upstream's chunk came. Those bytes are written as they are,
        with no frame made and joined around the data again."""
        write = self._transport_write
        if self._chunked_body and not self._held_head and write is not None and not self._lost:
            write(framed)
        else:
            self.send_body(data)

    def end_response(self, *, abrupt: bool, reset: bool) -> None:
        """End the response: cleanly, by closing without the terminator, or by a reset."""
        transport = self._transport
        if transport is None or self._lost:
            return
        if not reset:
            self._send_held_head()
        if reset:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0: the close sends RST and discards what the client never read.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        elif abrupt:
            self._phase = Phase.CLOSING
            transport.close()
            # A client that stopped reading would hold the flush forever.
            self._loop.call_later(self._config.wire.close_flush_timeout_s, transport.abort)
        else:
            self._write(self._conn.send(h11.EndOfMessage()))

    def closing_probe(self) -> Callable[[], bool] | None:
        """The transport's ``is_closing``: while an exchange runs, true once
        the loop saw the connection end (a reset read, a failed write, a
        half-close), a turn before ``connection_lost``."""
        return None if self._transport is None else self._transport.is_closing

    def exchange_finished(self, exchange: Exchange | None) -> None:
        """The exchange is over: serve the next request on this connection, or close it."""
        if self._exchange is exchange:
            self._exchange = None
        self._release_body()  # the exchange held the body for retries until now
        if self._lost or self._phase is Phase.CLOSING or self._transport is None:
            return
        conn = self._conn
        if (self._context.draining or conn.our_state is not h11.DONE
                or conn.their_state is not h11.DONE):
            self._close()
            return
        conn.start_next_cycle()
        self._request = None
        self._request_headers = []
        self._chunks = None
        self._line_checked = False
        self._head_received = bytearray()
        self._chunked_body = False
        self._phase = Phase.IDLE
        self._arm_timer(self._config.keepalive_timeout_s)
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        buffered = conn.trailing_data[0]
        if buffered:
            self._phase = Phase.HEAD
            self._head_received = bytearray(buffered)
            self._arm_timer(self._config.header_read_timeout_s)
            if not self._request_line_refused():
                self._process()

    def _answer_preflight(self, status: int, headers: list[Header], body: bytes) -> None:
        """Answer a CORS preflight here: the engine knows nothing of the sidecar's origins."""
        # Straight to h11, not send_headers: that would treat these as a proxied response's.
        self._write(self._conn.send(h11.Response(status_code=status, headers=headers)))
        if body:
            self._write(self._conn.send(h11.Data(data=body)))
        self._write(self._conn.send(h11.EndOfMessage()))
        self.exchange_finished(None)

    # ------------------------------------------------------------ shutdown

    @property
    def idle(self) -> bool:
        """Between requests, nothing of a new one received: safe to close on shutdown."""
        return self._phase is Phase.IDLE and self._exchange is None

    def close_if_idle(self) -> None:
        if self.idle:
            self._close()

    def abort(self) -> None:
        """Drop the connection at once (shutdown's last resort)."""
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------ helpers

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._lost and data:
            self._transport.write(data)

    def _close(self) -> None:
        self._phase = Phase.CLOSING
        self._cancel_timer()
        if self._transport is not None:
            self._transport.close()

    def _refuse_malformed(self, error: h11.RemoteProtocolError) -> None:
        # h11 hints 501 for a Transfer-Encoding it does not implement (RFC 9110
        # says SHOULD); here such a framing is a malformed or smuggling request,
        # the client's fault, which must not count as a server error (5xx is
        # what load balancers eject backends for and what clients retry).
        status = error.error_status_hint
        self._refuse(400 if status == 501 else status, h11_fault(error))

    def _request_line_refused(self) -> bool:
        """Refuse a request line h11 would wait on or accept wrongly, as soon as
        it is complete (see framing.py); True if refused."""
        received = self._head_received
        problem = request_line_problem(received)
        if problem is None:
            self._line_checked = request_line_end(received) != -1
            return False
        self._refuse(*problem)
        return True

    def _refuse(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        """Answer with an error status, nothing forwarded, then close lingeringly."""
        if self._phase is Phase.CLOSING or self._transport is None or self._lost:
            return
        self._release_body()
        headers, body = refusal(self._context, status, message, retry_after_s=retry_after_s)
        self._transport.write(refusal_head(status, headers) + body)
        self._phase = Phase.CLOSING
        transport = self._transport
        if self._reading_paused:
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._arm_timer(LINGER_S, transport.abort)
        else:
            # TLS cannot half-close; close_notify after the response is the best there is.
            transport.close()

    def _arm_timer(self, delay_s: float, callback: Callable[[], object] | None = None) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(delay_s, self._on_timer if callback is None else callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._phase is Phase.IDLE:
            self._close()
        elif self._phase in (Phase.HEAD, Phase.BODY):
            self._refuse(408, "the request was not received in time")
