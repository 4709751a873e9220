"""The client side over HTTP/1.1: one ``asyncio.Protocol`` per connection, plain or driving h11.

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
  silent; pipelined requests wait in a buffer (reading pauses if they pile
  up) and are served in order once the response is complete.

A connection reads its plain requests itself and takes h11 on at the first
one that is not, for good (``http1_plain.py`` says what plain is and why).

Requests refused before reaching an upstream (limits, malformed, smuggling,
too many connections) get a small JSON error, ``Connection: close``, and a
lingering close (``http1_phases.py``: the phases, their timers and the
connection's endings).

``pause_writing``/``resume_writing`` become ``SocketPaused``/``SocketResumed``
(the socket is tuned for that in ``connection.accepted_peer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import typing
from collections.abc import Callable, Sequence
from typing import Final

import h11
from tokenwire.middleware import SocketPaused, SocketResumed
from tokenwire.middleware.core.headers import header_value

from ..context import SidecarContext
from ..exchange.loop import Exchange
from .connection import (
    BUSY_BODIES,
    Peer,
    new_exchange,
    preflight,
    set_up_transport,
    with_cors,
)
from .framing import ChunkedScanner, head_length
from .h11_layout import (
    CHUNKED_END,
    chunk_size_line,
    declares_chunked,
    plain_response_head,
    send_response_head,
)
from .http1_faults import request_problem
from .http1_phases import ConnectionPhases, Phase
from .http1_plain import adopted, read_head, server_connection

logger = logging.getLogger("tokenwire.sidecar")

Header = tuple[bytes, bytes]

# Pipelined requests buffered beyond this pause reading until the current response ends.
_PIPELINE_BUFFER_BYTES: Final = 64 * 1024
# A line feed as an int, the needle of a memchr (why: middleware/core/sse.py, _LF).
_LF: typing.Final = 0x0A


class ClientConnection(ConnectionPhases):
    """One client connection: requests in (plain, or through h11), exchanges out.
    See the module docstring."""

    def __init__(self, context: SidecarContext, peer: Peer, *, over_limit: bool | None = None) -> None:
        """``peer``: what the acceptor learnt of the client (``connection.accepted_peer``).
        ``over_limit``: whether the connection came in past ``max_connections``
        (None: counted when the transport arrives)."""
        super().__init__(context)
        # The transport's write, bound once (send_framed: a method lookup per event otherwise).
        self._transport_write: Callable[[bytes], None] | None = None
        # None while every request has been plain (http1_plain.py); h11 from the first that is not.
        self._conn: h11.Connection | None = None
        self._peer = peer
        self._over_limit = over_limit
        self._write_paused = False
        # The current request's method (None between requests), target and version.
        self._method: bytes | None = None
        self._target = b""
        self._http_version = b"1.1"
        # Plain: what is left of the body, the request's head as read and its body
        # (the exchange's own bytes, no copy; both for adopted(), and let go when the
        # exchange ends), what came after it, whether the response has ended cleanly.
        self._plain_left = 0
        self._plain_head_bytes = b""
        self._request_body = b""
        self._pending = bytearray()
        self._plain_ended = False
        # Its headers as a list, made once: h11's Headers is iterated in Python,
        # a call per header, and the exchange, the CORS check and the head read them.
        self._request_headers: list[Header] = []
        self._body = bytearray()
        self._chunked_body = False
        self._held_head = b""  # the response head, until the first body bytes (see send_headers)
        # Follows a chunked body beside h11 (framing.py); None otherwise.
        self._chunks: ChunkedScanner | None = None

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
        self._peer = set_up_transport(context, transport, self._peer)
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
            # Only a read with a LF can complete a line or a head. A plain head,
            # whole, is served at once: its request line and framing are h11's by
            # construction (http1_plain declines any other); else the request line
            # is checked, once, when it is complete.
            if self._conn is None and _LF in data and self._plain_head():
                return
            if not self._line_checked and _LF in data and self._request_line_refused():
                return
        elif self._phase is Phase.BODY and self._chunks is not None:
            problem = self._chunks.feed(data)
            if problem is not None:
                self._refuse(*problem)
                return
        if self._conn is None:
            self._plain_received(data)
        else:
            self._h11_received(self._conn, data)

    def _h11_received(self, conn: h11.Connection, data: bytes) -> None:
        """``data`` through h11: its events handled, or kept while a response runs."""
        try:
            conn.receive_data(data)
        except h11.RemoteProtocolError as error:
            self._refuse_malformed(error)
            return
        if self._phase is Phase.RESPONSE:
            self._pause_if_piled_up(len(conn.trailing_data[0]))  # pipelined bytes wait in h11's buffer
            return
        self._process()

    def _pause_if_piled_up(self, buffered_bytes: int) -> None:
        """Stop reading while the pipelined requests buffered pile up (see exchange_finished)."""
        if buffered_bytes > _PIPELINE_BUFFER_BYTES and self._transport:
            self._transport.pause_reading()
            self._reading_paused = True

    def eof_received(self) -> bool | None:
        # A client that half-closes mid-response is treated as gone, as most
        # servers do; returning None closes the transport (→ connection_lost).
        if self._phase in (Phase.HEAD, Phase.BODY) and self._conn is not None:
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
        self._timer.close()
        self._timer_callback = None
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
        self._context.connections.discard(self)

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
        conn = self._conn
        assert conn is not None
        while self._exchange is None and self._phase is not Phase.CLOSING and not self._lost:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as error:
                self._refuse_malformed(error)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_request(event.method, event.target, event.http_version, list(event.headers))
                if conn.they_are_waiting_for_100_continue and self._phase is Phase.BODY:
                    self._write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
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

    def _plain_received(self, data: bytes) -> None:
        """``data`` on a connection without h11 (see ``http1_plain.py``)."""
        phase = self._phase
        if phase is Phase.HEAD:  # not plain (data_received tried), or not whole yet
            self._h11_head()
        elif phase is Phase.BODY:
            self._plain_body(data)
        elif phase is Phase.RESPONSE:
            self._pending += data
            self._pause_if_piled_up(len(self._pending))

    def _plain_head(self) -> bool:
        """Serve the request head received so far if it is plain and whole
        (True); False: h11 must read it."""
        received = self._head_received
        head = read_head(received)
        if head is None:
            return False
        rest = bytes(received[head.head_bytes:])
        self._plain_head_bytes = head.raw
        self._on_request(head.method, head.target, b"1.1", head.headers, plain=True)
        if self._phase is Phase.BODY:
            self._plain_left = head.body_bytes
            self._plain_body(rest)
        return True

    def _h11_head(self) -> None:
        """h11 from here on, given all of this request so far."""
        conn = self._conn = server_connection(self._config.max_head_bytes)
        self._h11_received(conn, bytes(self._head_received))

    def _plain_body(self, data: bytes) -> None:
        """Body bytes of a plain request (and any after it, kept for later)."""
        left = self._plain_left
        part = data[:left]
        if part:
            self._plain_left = left - len(part)
            self._on_body(part)
            if self._phase is not Phase.BODY:
                return
        if not self._plain_left:
            self._pending += data[left:]
            self._start_exchange()

    def _on_request(self, method: bytes, target: bytes, http_version: bytes, headers: list[Header],
                    *, plain: bool = False) -> None:
        config = self._config
        self._phase = Phase.BODY
        self._arm_timer(config.body_read_timeout_s)
        received, self._head_received = self._head_received, bytearray()
        if self._context.draining or self._over_limit:
            self._refuse(503, "the server is not taking new requests", retry_after_s=1)
            return
        problem = request_problem(method, target, http_version, headers, None if plain else received, config)
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
        self._method, self._target, self._http_version = method, target, http_version
        self._request_headers = headers
        self._body = bytearray()

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

    def _start_exchange(self) -> None:
        method = self._method
        assert method is not None
        self._phase = Phase.RESPONSE
        self._cancel_timer()
        headers = self._request_headers
        body = self._request_body = bytes(self._body)
        self._body = bytearray()
        answer = preflight(self._context, method, headers)
        if answer is not None:
            self._answer_preflight(*answer)
            return
        exchange = new_exchange(self._context, self, method=method, target=self._target,
                                headers=headers, body=body, peer=self._peer,
                                http_version=self._http_version.decode())
        self._exchange = exchange
        exchange.send_framed = self.send_framed
        exchange.start()
        if self._write_paused:
            exchange.feed(SocketPaused())

    # ------------------------------------------------------------ Downstream (for the exchange)

    def send_headers(self, status: int, headers: Sequence[Header]) -> None:
        """Send the response head (called by the exchange on ``CommitHeaders``)."""
        method = self._method
        if method is not None:
            headers = with_cors(self._context, self._request_headers, headers)
        else:
            headers = list(headers)
        if self._context.draining:
            headers.append((b"connection", b"close"))
        plain = None if self._conn is not None or method == b"HEAD" else plain_response_head(status, headers)
        # h11 chose the body framing and wrote it into the head. When it is
        # chunked, send_body frames the chunks itself (h11_layout: why that is
        # h11's framing); a Content-Length body keeps going through h11, which
        # checks the length. A plain response is chunked.
        head = send_response_head(self._h11(), status, headers) if plain is None else plain
        self._chunked_body = declares_chunked(head, status, method)
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
            self._write(head + (self._h11().send(h11.Data(data=data)) or b""))
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
        elif self._conn is None and self._chunked_body:
            self._write(CHUNKED_END)
            self._plain_ended = True
        else:
            self._write(self._h11().send(h11.EndOfMessage()) or b"")

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
        self._plain_head_bytes = self._request_body = b""
        if self._lost or self._phase is Phase.CLOSING or self._transport is None:
            return
        conn = self._conn
        if self._context.draining or (not self._plain_ended if conn is None else (
                conn.our_state is not h11.DONE or conn.their_state is not h11.DONE)):
            self._close()
            return
        buffered: bytes | bytearray
        if conn is None:
            buffered, self._pending = self._pending, bytearray()
            self._plain_ended = False
        else:
            conn.start_next_cycle()
            buffered = conn.trailing_data[0]
        self._method = None
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
        if buffered:
            self._phase = Phase.HEAD
            self._head_received = bytearray(buffered)
            self._arm_timer(self._config.header_read_timeout_s)
            if self._conn is None and self._plain_head():
                return
            if self._request_line_refused():
                return
            if self._conn is None:
                self._h11_head()
            else:
                self._process()

    def _answer_preflight(self, status: int, headers: list[Header], body: bytes) -> None:
        """Answer a CORS preflight here: the engine knows nothing of the sidecar's origins."""
        # Straight to h11, not send_headers: that would treat these as a proxied response's.
        conn = self._h11()
        self._write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
        if body:
            self._write(conn.send(h11.Data(data=body)) or b"")
        self._write(conn.send(h11.EndOfMessage()) or b"")
        self.exchange_finished(None)

    # ------------------------------------------------------------ helpers

    def _h11(self) -> h11.Connection:
        """h11, taken on now if the connection has been plain: it is given the
        request read so far and what came after it (``http1_plain.adopted``)."""
        if self._conn is None:
            self._conn = adopted(self._config.max_head_bytes, self._plain_head_bytes + self._request_body,
                                 self._pending)
            self._pending = bytearray()
            self._plain_head_bytes = b""
        return self._conn
