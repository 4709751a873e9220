"""A raw HTTP/2 client for tests: a blocking socket and h2's client-side state machine.

Real frames on a real socket, so a test can do what no polite client does
(cancel at once, never open its window, flood SETTINGS) and read exactly what
the sidecar answered, frame by frame.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

Header = tuple[bytes, bytes]


@dataclass(frozen=True)
class GoAway:
    """A GOAWAY the sidecar sent."""

    last_stream_id: int
    error_code: int


@dataclass
class StreamState:
    """What arrived on one stream."""

    status: int | None = None
    headers: list[Header] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset_code: int | None = None
    trailers: list[Header] = field(default_factory=list)
    first_data_at: float | None = None
    data_times: list[float] = field(default_factory=list)


class H2Client:
    """One HTTP/2 connection to the sidecar (plaintext prior knowledge, or TLS with ALPN h2)."""

    def __init__(self, port: int, *, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None,
                 settings: dict[int, int] | None = None,
                 timeout_s: float = 10.0) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
            sock = tls.wrap_socket(sock, server_hostname="localhost")
            assert sock.selected_alpn_protocol() == "h2"
        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        if settings:
            self.conn.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        self.conn.initiate_connection()
        self.credits: Callable[[int], bool] = lambda stream_id: True
        """Whether DATA received on a stream is credited back at once (a reader that
        keeps up); a stream it says no to never has its window opened."""
        self.streams: dict[int, StreamState] = {}
        self.goaway: GoAway | None = None
        self._frames = bytearray()  # received bytes not yet split into frames
        self.closed = False
        self.send_failed = False
        self.flush()

    # ------------------------------------------------------------ sending

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.closed and not self.send_failed:
            try:
                self.sock.sendall(data)
            except OSError:
                self.send_failed = True  # the peer hung up; what it sent may still be read

    def request(self, path: str, *, method: str = "GET", body: bytes = b"",
                headers: Iterable[Header] = (), end: bool = True, flush: bool = True,
                authority: bytes = b"localhost") -> int:
        """Open a stream; its id."""
        stream_id = self.conn.get_next_available_stream_id()
        fields = [(b":method", method.encode()), (b":path", path.encode()), (b":scheme", b"http"),
                  (b":authority", authority), *headers]
        self.conn.send_headers(stream_id, fields, end_stream=end and not body)
        if body:
            self.conn.send_data(stream_id, body, end_stream=end)
        self.streams[stream_id] = StreamState()
        if flush:
            self.flush()
        return stream_id

    def reset(self, stream_id: int, code: int = 8) -> None:
        """RST_STREAM (CANCEL by default)."""
        self.conn.reset_stream(stream_id, code)
        self.flush()

    # ------------------------------------------------------------ receiving

    def read_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Read and handle frames until ``predicate()`` or the connection ends; its last value."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.closed:
                return predicate()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return predicate()
            except (ConnectionError, ssl.SSLError):
                self.closed = True
                continue
            if not data:
                self.closed = True
                continue
            try:
                events = self.conn.receive_data(self._without_goaway(data))
            except h2.exceptions.ProtocolError:
                self.closed = True
                continue
            for event in events:
                self._handle(event)
            self.flush()
        return True

    def response(self, stream_id: int, timeout_s: float = 10.0) -> StreamState:
        """Wait for the stream to end (END_STREAM or RST_STREAM)."""
        state = self.streams[stream_id]
        self.read_until(lambda: state.ended or state.reset_code is not None, timeout_s)
        return state

    def _without_goaway(self, data: bytes) -> bytes:
        """``data`` less any GOAWAY frame, which is recorded instead: h2's state
        machine allows nothing after a GOAWAY, where RFC 9113 lets the streams
        up to its last stream id finish."""
        self._frames += data
        passed = bytearray()
        while len(self._frames) >= 9:
            length = int.from_bytes(self._frames[:3], "big")
            if len(self._frames) < 9 + length:
                break
            frame, self._frames = self._frames[:9 + length], self._frames[9 + length:]
            if frame[3] == 0x7:
                self.goaway = GoAway(int.from_bytes(frame[9:13], "big") & 0x7FFFFFFF,
                                     int.from_bytes(frame[13:17], "big"))
            else:
                passed += frame
        return bytes(passed)

    def _handle(self, event: h2.events.Event) -> None:
        now = time.monotonic()
        if isinstance(event, h2.events.ResponseReceived):
            state = self.streams.setdefault(event.stream_id, StreamState())
            state.headers = [(bytes(k), bytes(v)) for k, v in event.headers or []]
            state.status = int(dict(state.headers)[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            state = self.streams.setdefault(event.stream_id, StreamState())
            state.body += event.data or b""
            state.data_times.append(now)
            if state.first_data_at is None:
                state.first_data_at = now
            if event.flow_controlled_length and self.credits(event.stream_id):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.TrailersReceived):
            state = self.streams.setdefault(event.stream_id, StreamState())
            state.trailers = [(bytes(k), bytes(v)) for k, v in event.headers or []]
        elif isinstance(event, h2.events.StreamEnded):
            self.streams.setdefault(event.stream_id, StreamState()).ended = True
        elif isinstance(event, h2.events.StreamReset):
            self.streams.setdefault(event.stream_id, StreamState()).reset_code = int(event.error_code or 0)

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chat_headers(tokens: int = 5, delay_s: float = 0.0) -> list[Header]:
    """Headers for a streamed chat request to the fake upstream."""
    return [(b"content-type", b"application/json"), (b"accept", b"text/event-stream"),
            (b"x-fake-tokens", str(tokens).encode()), (b"x-fake-delay-s", str(delay_s).encode())]


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One raw HTTP/2 frame."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


# GET /models/v1/models from HPACK's static table and literals without indexing
# only: one block serves any number of streams, with no encoder state.
STATIC_GET_BLOCK = b"\x82\x86\x04\x11/models/v1/models\x01\x01x"


def read_goaway(sock: socket.socket, timeout_s: float = 10.0) -> GoAway | None:
    """Read a raw HTTP/2 connection until it ends; its GOAWAY, if one came."""
    deadline = time.monotonic() + timeout_s
    buffer = b""
    goaway = None
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(65536)
        except (TimeoutError, OSError):
            break
        if not data:
            break
        buffer += data
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            if buffer[3] == 0x7:
                goaway = GoAway(int.from_bytes(buffer[9:13], "big") & 0x7FFFFFFF,
                                int.from_bytes(buffer[13:17], "big"))
            buffer = buffer[9 + length:]
    return goaway
