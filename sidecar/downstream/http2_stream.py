"""One HTTP/2 stream of a client connection: the exchange's :class:`Downstream`.

Theory of operation
-------------------
A stream is born with the request's HEADERS. Its body is read whole (as over
HTTP/1.1: the wire core needs the request classified, and retries need it
again), then an :class:`~tokenwire.sidecar.exchange.loop.Exchange` answers it, or,
where the connection's route says so, another :class:`StreamHandler` (gRPC)
that sees the body as it comes.

Flow control is the backpressure the wire core reads. Response bytes go out as
DATA frames as far as the stream's and the connection's send windows allow;
the rest waits here, and while anything waits (or the socket itself is
paused) the exchange is told ``SocketPaused``, so its core coalesces events and,
if the client never opens its window, its ``write_deadline_s`` ends the stream.
A WINDOW_UPDATE lets the waiting bytes go and the exchange hears
``SocketResumed``. Other streams on the connection keep flowing meanwhile.

How the stream ends is the core's choice, carried by ``CloseClient``: a finished
answer ends with END_STREAM; a reset (a client that stopped reading, a driver
failure) drops what waits and sends RST_STREAM(INTERNAL_ERROR) at once. An
abrupt end (after an in-band error event: the case that closes an HTTP/1.1
connection without its chunked terminator) ends with trailers,
``tokenwire-error-code`` and ``tokenwire-error-number`` (the core's error code,
as gRPC calls end), on a HEADERS frame with END_STREAM, once every DATA byte
before them went to h2, the send windows' included. The SSE body already says the answer failed (its error
event, no terminal marker); the trailers say so to a plain HTTP client.

Why not RST_STREAM after the error event: the clients drop it. curl (7.88)
fails the transfer as soon as it reads the reset and discards the DATA it read
in the same pass; Chromium (fetch, EventSource) errors the body and drops what
its renderer had not read yet, even when a PING acknowledged first proves the
network stack had every DATA frame. RST_STREAM(NO_ERROR) is no better: curl then
exits 0 with no error signal at all, and Chromium takes it for a clean end.
A client that stopped reading would hold the trailers back forever, so
``close_flush_timeout_s`` after the abrupt end the stream is reset instead.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import h2.errors
import h2.exceptions
from tokenwire.middleware import SocketPaused, SocketResumed
from tokenwire.middleware.core.errors import ErrorCode

from ..exchange.loop import Exchange
from .connection import BodyReservation, with_cors
from .http2_request import RequestHead

if TYPE_CHECKING:
    from .http2 import Http2Connection

Header = tuple[bytes, bytes]

# Connection-specific header fields: forbidden in HTTP/2 (RFC 9113 section 8.2.2).
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection",
                                  b"transfer-encoding", b"upgrade"})


class StreamHandler(Protocol):
    """Serves one stream instead of an exchange (what a :data:`StreamRoute` picks).

    It answers through the :class:`Http2Stream` it was given (``send_headers``,
    ``send_body``, ``send_trailers``, ``end_response``) and calls its
    ``exchange_finished(None)`` when done.
    """

    def data_received(self, data: bytes) -> None:
        """Request body bytes, as they come (flow control is credited on delivery)."""

    def request_ended(self) -> None:
        """The client's END_STREAM: no more body."""

    def stream_reset(self) -> None:
        """The client cancelled the stream, or the connection is gone."""


class _End(enum.Enum):
    END_STREAM = "end_stream"
    TRAILERS = "trailers"


def error_trailers(code: ErrorCode | None) -> list[Header]:
    """The trailers of an answer that failed after its head: the core's error
    code and number (``internal_error`` where it named none)."""
    code = code or ErrorCode.INTERNAL
    return [(b"tokenwire-error-code", code.value.encode()),
            (b"tokenwire-error-number", code.number.encode())]


class Http2Stream:
    """One stream: request state in, the :class:`Downstream` calls out."""

    def __init__(self, connection: Http2Connection, head: RequestHead) -> None:
        self._connection = connection
        self._h2 = connection.h2
        self._data = connection.data
        self.head = head
        self.stream_id = head.stream_id
        self.body = bytearray()
        self.reservation = BodyReservation(connection.context)
        self.exchange: Exchange | None = None
        self.handler: StreamHandler | None = None
        self.request_complete = False
        self.closed = False
        """Nothing more may be sent: reset (by either side) or ended."""
        self.finished = False
        """Whoever answered the stream is done with it."""
        self._waiting = bytearray()  # response bytes the send windows hold back
        self._end: _End | None = None  # how to end once _waiting is out
        self._trailers: list[Header] = []
        self._no_body = head.method == b"HEAD"
        self._told_paused = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def connection(self) -> Http2Connection:
        """The connection this stream is on."""
        return self._connection

    # ------------------------------------------------------------ Downstream

    def send_headers(self, status: int, headers: Sequence[Header]) -> None:
        """Send the response head (the exchange's ``CommitHeaders``)."""
        headers = with_cors(self._connection.context, self.head.headers, headers)
        self.respond_head(status, headers)

    def respond_head(self, status: int, headers: Sequence[Header]) -> None:
        """Send ``headers`` as they are (no CORS added)."""
        if self.closed:
            return
        if status in (204, 304):
            self._no_body = True
        fields = [(b":status", str(status).encode())]
        # HTTP/2 field values carry no surrounding whitespace (RFC 9113 section
        # 8.2.1), which an HTTP/1.1 upstream's may; h2 would refuse them.
        fields += [(name.lower(), value.strip()) for name, value in headers
                   if name.lower() not in _CONNECTION_SPECIFIC]
        self._send(lambda: self._h2.send_headers(self.stream_id, fields))

    def send_body(self, data: bytes) -> None:
        """Send response bytes, as far as the windows allow; the rest waits."""
        if self.closed or self._no_body or not data:
            return
        self._waiting += data
        self.push()

    def send_trailers(self, headers: Sequence[Header], *, drop_waiting: bool = False) -> None:
        """End the stream with trailers (a HEADERS frame with END_STREAM), after the body;
        ``drop_waiting``: without the body bytes the send windows still hold back (a
        client that stopped reading; trailers are not flow-controlled)."""
        if drop_waiting:
            self._waiting.clear()
            self._connection.blocked.pop(self.stream_id, None)
        self._trailers = [(name.lower(), value) for name, value in headers]
        self._ending(_End.TRAILERS)

    def end_response(self, *, abrupt: bool, reset: bool) -> None:
        """End the stream as the core says: END_STREAM for a finished answer;
        for a dead one (``abrupt``), after every byte before it, the error
        trailers with END_STREAM (see the module docstring); ``reset``:
        RST_STREAM(INTERNAL_ERROR) now, what waits dropped."""
        if reset:
            self._waiting.clear()
            self.reset(h2.errors.ErrorCodes.INTERNAL_ERROR)
            return
        if not abrupt:
            self._ending(_End.END_STREAM)
            return
        exchange = self.exchange
        self._trailers = error_trailers(exchange.stream.error_code if exchange is not None else None)
        # A client that stopped reading would hold the error event and the
        # trailers back forever: reset then, which still says the answer failed.
        self.set_timer(self._connection.context.config.wire.close_flush_timeout_s,
                       lambda: self.reset(h2.errors.ErrorCodes.INTERNAL_ERROR))
        self._ending(_End.TRAILERS)

    def closing_probe(self) -> Callable[[], bool] | None:
        """None: a stream's reset (RST_STREAM, the connection's loss) reaches
        the exchange from the connection's own callbacks as it is read."""
        return None

    def exchange_finished(self, exchange: Exchange | None) -> None:
        """Whoever answered is done: the stream's resources go."""
        if self.finished:
            return
        self.finished = True
        self.reservation.release()
        self.body = bytearray()
        if self.closed:
            self.cancel_timer()
        self._connection.stream_finished(self)

    # ------------------------------------------------------------ the connection's calls

    def push(self) -> bool:
        """Send what waits as far as the windows allow; True if everything went."""
        h2conn = self._h2
        waiting = self._waiting
        while waiting and not self.closed:
            try:
                window = self._data.window(self.stream_id)
            except (h2.exceptions.StreamClosedError, h2.exceptions.NoSuchStreamError):
                self._closed_under_us()
                return True
            size = min(window, len(waiting), h2conn.max_outbound_frame_size)
            if size <= 0:
                break
            chunk = bytes(waiting[:size]) if size < len(waiting) else bytes(waiting)
            del waiting[:size]
            self._send_data(chunk)
        if waiting and not self.closed:
            self._connection.blocked[self.stream_id] = self
            self.update_paused()
            return False
        self._connection.blocked.pop(self.stream_id, None)
        if self._end is not None:
            self._finish_end()
        self.update_paused()
        return True

    def update_paused(self) -> None:
        """Tell the exchange whether it may write: not while bytes wait for a
        window or the socket is paused."""
        exchange = self.exchange
        if exchange is None:
            return
        paused = bool(self._waiting) or self._connection.write_paused
        if paused != self._told_paused:
            self._told_paused = paused
            exchange.feed(SocketPaused() if paused else SocketResumed())

    def client_gone(self) -> None:
        """The client reset the stream or the connection went: stop answering."""
        self.closed = True
        self._waiting.clear()
        self._connection.blocked.pop(self.stream_id, None)
        self.cancel_timer()
        if self.exchange is not None:
            self.exchange.client_departed()
        elif self.handler is not None:
            self.handler.stream_reset()
        elif not self.finished:
            self.exchange_finished(None)

    def reset(self, code: h2.errors.ErrorCodes) -> None:
        """RST_STREAM now (what waits is dropped)."""
        if self.closed:
            return
        self._waiting.clear()
        self._connection.blocked.pop(self.stream_id, None)
        self._send(lambda: self._h2.reset_stream(self.stream_id, code))
        self.closed = True
        self.cancel_timer()

    # ------------------------------------------------------------ helpers

    def _ending(self, end: _End) -> None:
        if self.closed:
            return
        self._end = end
        if not self._waiting:
            self._finish_end()

    def _finish_end(self) -> None:
        end, self._end = self._end, None
        if end is _End.TRAILERS:
            trailers = self._trailers
            self._send(lambda: self._h2.send_headers(self.stream_id, trailers, end_stream=True))
        else:
            self._send(lambda: self._h2.end_stream(self.stream_id))
        self.closed = True
        self.cancel_timer()
        if not self.request_complete:
            # The answer is complete before the request (a refusal): the rest of
            # the body is not wanted (RFC 9113 section 8.1).
            self._send(lambda: self._h2.reset_stream(self.stream_id, h2.errors.ErrorCodes.NO_ERROR))

    def _send(self, call: Callable[[], object]) -> None:
        """Run one h2 send call; a stream h2 finds closed is closed here too."""
        if self._connection.closing:
            self.closed = True
            return
        try:
            call()
        except (h2.exceptions.StreamClosedError, h2.exceptions.NoSuchStreamError,
                h2.exceptions.TooManyStreamsError):
            # TooManyStreamsError: h2 already dropped this stream (reset by the client
            # in the same read as the event being answered), so it took a HEADERS
            # frame for a new server-initiated stream, which a server may not open.
            self._closed_under_us()
            return
        self._connection.schedule_flush()

    def _send_data(self, chunk: bytes) -> None:
        self._send(lambda: self._data.send(self.stream_id, chunk))

    def _closed_under_us(self) -> None:
        self.closed = True
        self._waiting.clear()
        self._connection.blocked.pop(self.stream_id, None)

    def set_timer(self, delay_s: float, callback: Callable[[], object]) -> None:
        """Call ``callback`` in ``delay_s`` unless the stream closes first (one timer per stream)."""
        self.cancel_timer()
        self._timer = self._connection.loop.call_later(delay_s, callback)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
