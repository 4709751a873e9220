"""Reading one HTTP/1.1 response, and the SSE events in its body, as a client sees them.

The one response reader of the tools (``demo``, ``probe``) and of the tests.
:class:`ResponseParser` is sans-IO: bytes in (``receive_data``), events out
(``next_event``), the response so far in ``response``. :class:`BlockingReader`
drives it from a blocking socket (any pace: the demo's slow reader takes 512
bytes every 50 ms); the probe drives it from asyncio streams and stamps each
read itself.

It reports what went over the wire rather than hiding it, which is the point
of a client for a wire that may be cut: ``clean_end`` is True only when the
body ended with its framing complete (chunked terminator or full length); a
body cut short, a reset, a timeout or a framing error leaves it False and says
why in ``error``. h11 checks the framing; the core's ``SSEParser`` parses the
events (with limits far above the core's: a client reports, it does not police).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import h11

from tokenwire.middleware.core.errors import SSEProtocolError
from tokenwire.middleware.core.sse import SSEEvent, SSEParser

STREAM_ID_HEADER_NAME = "x-tokenwire-stream-id"
_CLIENT_SSE_LIMIT_BYTES = 1 << 30


@dataclass
class SSEResponse:
    """One response as read so far: head, body, SSE events, how it ended."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    """Header names lower-cased; a repeated header keeps its last value."""
    body: bytes = b""
    """The body with its framing removed."""
    events: list[SSEEvent] = field(default_factory=list)
    """The body's SSE events and comments, in order (empty for a body that is not SSE)."""
    clean_end: bool = False
    """The body ended with its framing complete (chunked terminator / full length)."""
    error: str = ""
    """Why reading stopped early: a framing error, a reset, a timeout (empty if none)."""
    stopped: bool = False
    """The reader's ``stop`` ended the last read before the response ended."""
    raw: bytes = b""
    """Every byte read, head and framing included (only with ``keep_raw``)."""

    @property
    def data_events(self) -> list[SSEEvent]:
        """The events that carry ``data`` (no comments, no id-only events)."""
        return [event for event in self.events if event.data is not None]

    def datas(self) -> list[str]:
        """The ``data`` of every event, in order."""
        return [event.data for event in self.events if event.data is not None]

    @property
    def ids(self) -> list[str]:
        """The ``id`` of every data event that has one, in order."""
        return [event.id for event in self.data_events if event.id is not None]

    @property
    def stream_id(self) -> str:
        """The resume stream id a resumable sidecar sent (empty if none)."""
        return self.headers.get(STREAM_ID_HEADER_NAME, "")

    def json(self) -> Any:
        return json.loads(self.body)


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


HEAD: Final = _Marker("HEAD")
"""``next_event``: the response head arrived (``response.status`` and ``headers`` are set)."""
NEED_DATA: Final = _Marker("NEED_DATA")
"""``next_event``: nothing more until ``receive_data``."""
END: Final = _Marker("END")
"""``next_event``: the response is over (``clean_end`` and ``error`` say how)."""

ParserEvent = SSEEvent | _Marker


def request_bytes(connection: h11.Connection, method: str, target: str, body: bytes = b"", *,
                  headers: Sequence[tuple[str, str]] = (), host: str = "tokenwire") -> bytes:
    """One request as ``connection`` (an ``h11.CLIENT``) writes it: ``host`` and,
    for a body, ``content-length`` and a JSON ``content-type`` unless given."""
    names = {name.lower() for name, _ in headers}
    sent = [] if "host" in names else [("host", host)]
    sent += headers
    if body or method == "POST":
        if "content-type" not in names:
            sent.append(("content-type", "application/json"))
        sent.append(("content-length", str(len(body))))
    out = connection.send(h11.Request(method=method, target=target, headers=sent)) or b""
    if body:
        out += connection.send(h11.Data(data=body)) or b""
    return out + (connection.send(h11.EndOfMessage()) or b"")


class ResponseParser:
    """Sans-IO reader of one HTTP/1.1 response and its SSE events.

    ``connection``: the ``h11.CLIENT`` that sent the request (so a response to
    HEAD is read as bodiless); without one, a GET is assumed, for a request
    written by hand. ``buffered``: bytes already read past the previous
    response on this connection (pipelining). ``keep_raw`` keeps every byte
    in ``response.raw``.
    """

    def __init__(self, connection: h11.Connection | None = None, *, buffered: bytes = b"",
                 keep_raw: bool = False) -> None:
        if connection is None:
            connection = h11.Connection(h11.CLIENT)
            # h11 must believe it sent a request to parse a response.
            connection.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            connection.send(h11.EndOfMessage())
        self.connection = connection
        self.response = SSEResponse()
        self.done = False
        self._keep_raw = keep_raw
        self._raw = bytearray()
        self._body = bytearray()
        self._sse: SSEParser | None = SSEParser(max_line_bytes=_CLIENT_SSE_LIMIT_BYTES,
                                                max_event_bytes=_CLIENT_SSE_LIMIT_BYTES)
        self._pending: list[SSEEvent] = []
        if buffered:  # (b"" would mean EOF to h11)
            self.receive_data(buffered)

    @property
    def trailing(self) -> bytes:
        """Bytes read past the end of this response: the next one's start."""
        data, _closed = self.connection.trailing_data
        return bytes(data)

    def receive_data(self, data: bytes) -> None:
        """Bytes read off the connection; ``b""`` is its end."""
        if self._keep_raw:
            self._raw += data
        if not self.done:
            self.connection.receive_data(data)

    def fail(self, error: str) -> None:
        """The connection failed (a reset, a timeout): the response is over, unclean."""
        if not self.done:
            self.response.error = self.response.error or error
            self._finish()

    def next_event(self) -> ParserEvent:
        """The next thing the bytes so far complete: :data:`HEAD`, an SSE event
        (comments included), :data:`NEED_DATA` or, from then on, :data:`END`."""
        while not self._pending:
            if self.done:
                return END
            try:
                event = self.connection.next_event()
            except h11.RemoteProtocolError as error:
                # A body cut without its chunked terminator is how the wire core says
                # "this stream did not finish": reported, never read as an end.
                self.fail(f"{type(error).__name__}: {error}")
                continue
            if event is h11.NEED_DATA:
                return NEED_DATA
            if isinstance(event, h11.Response):
                self.response.status = event.status_code
                self.response.headers = {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1")
                                         for k, v in event.headers}
                return HEAD
            if isinstance(event, h11.Data):
                self._body += event.data
                self._parse_sse(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.response.clean_end = True
                self._finish()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                self._finish()
            # an h11.InformationalResponse (1xx) is skipped
        parsed = self._pending.pop(0)
        self.response.events.append(parsed)
        return parsed

    def current(self) -> SSEResponse:
        """The response so far, its body (and ``raw``) brought up to date."""
        if len(self.response.body) != len(self._body):
            self.response.body = bytes(self._body)
        if len(self.response.raw) != len(self._raw):
            self.response.raw = bytes(self._raw)
        return self.response

    def _parse_sse(self, data: bytes) -> None:
        if self._sse is None:
            return
        try:
            self._pending += self._sse.feed(data)
        except SSEProtocolError as error:
            self._sse = None
            self.response.error = self.response.error or f"SSEProtocolError: {error}"

    def _finish(self) -> None:
        self.done = True
        self.current()


def parse_response(raw: bytes) -> SSEResponse:
    """A whole response already read off a connection (its end included)."""
    parser = ResponseParser()
    parser.receive_data(raw)
    parser.receive_data(b"")
    while parser.next_event() is not END:
        pass
    return parser.current()


StopReading = Callable[[SSEResponse, SSEEvent], bool]
"""Called after each event; True stops reading (the caller then owns the socket)."""


class BlockingReader:
    """Reads one response off a blocking socket, ``recv_bytes`` at a time.

    ``interval_s`` sleeps between reads (a slow reader). ``timeout_s`` bounds
    the whole read (None: only the socket's own timeout).
    """

    def __init__(self, sock: socket.socket, parser: ResponseParser | None = None, *,
                 recv_bytes: int = 65536, interval_s: float = 0.0, timeout_s: float | None = 10.0) -> None:
        self.sock = sock
        self.parser = parser or ResponseParser()
        self.recv_bytes = recv_bytes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.wall_s = 0.0
        """Seconds spent in :meth:`read` so far."""

    @property
    def response(self) -> SSEResponse:
        return self.parser.response

    def read(self, *, head_only: bool = False, stop: StopReading | None = None) -> SSEResponse:
        """Read until the response ends, or its head arrives (``head_only``), or
        ``stop`` says so; call again to read on."""
        started = time.perf_counter()
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        parser = self.parser
        parser.response.stopped = False
        try:
            while True:
                event = parser.next_event()
                if event is END:
                    break
                if event is HEAD:
                    if head_only:
                        break
                elif event is NEED_DATA:
                    if deadline is not None and time.monotonic() > deadline:
                        parser.fail("timeout")
                        continue
                    if self.interval_s and parser.response.status:
                        time.sleep(self.interval_s)
                    parser.receive_data(self.sock.recv(self.recv_bytes))
                elif isinstance(event, SSEEvent) and stop is not None and stop(parser.response, event):
                    parser.response.stopped = True
                    break
        except TimeoutError:
            parser.fail("timeout")
        except (ConnectionError, ssl.SSLError) as error:
            parser.fail(f"reset: {type(error).__name__}: {error}")
        except OSError as error:
            parser.fail(f"{type(error).__name__}: {error}")
        self.wall_s += time.perf_counter() - started
        return parser.current()


def read_response(sock: socket.socket, *, timeout_s: float | None = 10.0, head_only: bool = False,
                  stop: StopReading | None = None, keep_raw: bool = False) -> SSEResponse:
    """Read one response to a request written by hand (1xx skipped) until its
    end, the connection's, or ``stop``; see :class:`BlockingReader`."""
    reader = BlockingReader(sock, ResponseParser(keep_raw=keep_raw), timeout_s=timeout_s)
    return reader.read(head_only=head_only, stop=stop)
