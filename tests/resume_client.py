"""A resuming SSE client for the tests of both drivers: reads events (with their
ids) off a real socket, can stop after N events and drop the connection (with a
reset, as a phone losing its network), then reconnect the way an EventSource
does. Self-contained: tests/ is on sys.path for every test folder."""

from __future__ import annotations

import random
import socket
import struct
import time
from dataclasses import dataclass, field

import h11
from tokenwire.middleware import SSEEvent, SSEParser


def request_bytes(method: str, path: str, *, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    sent = {"Content-Type": "application/json", **(headers or {})}
    if body:
        sent["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in sent.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def reset(sock: socket.socket) -> None:
    """Close with RST (linger 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class SSEResponse:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[SSEEvent] = field(default_factory=list)
    body: bytes = b""
    clean_end: bool = False
    dropped: bool = False
    """We dropped the connection ourselves after ``stop_after`` events."""

    @property
    def data_events(self) -> list[SSEEvent]:
        return [e for e in self.events if e.data is not None]

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.data_events if e.id is not None]

    @property
    def stream_id(self) -> str:
        return self.headers["x-tokenwire-stream-id"]


def read_events(sock: socket.socket, *, stop_after: int | None = None, timeout_s: float = 10.0,
                drop: bool = True) -> SSEResponse:
    """Read one response; with ``stop_after``, reset the connection once that
    many data events arrived (a phone losing its network)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    parser = SSEParser()
    response = SSEResponse()
    body = bytearray()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            break  # cut without the chunked terminator: clean_end stays False
        if event is h11.NEED_DATA:
            if time.monotonic() > deadline:
                raise AssertionError("timed out reading the stream")
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            response.status = event.status_code
            response.headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
            for parsed in parser.feed(bytes(event.data)):
                response.events.append(parsed)
                if stop_after is not None and len(response.data_events) >= stop_after:
                    response.body = bytes(body)
                    response.dropped = True
                    if drop:
                        reset(sock)
                    return response
        elif isinstance(event, h11.EndOfMessage):
            response.clean_end = True
            break
        elif isinstance(event, h11.ConnectionClosed):
            break
        else:
            raise AssertionError(f"unexpected {event!r}")
    response.body = bytes(body)
    return response


def open_stream(port: int, method: str, path: str, *, body: bytes = b"",
                headers: dict[str, str] | None = None, stop_after: int | None = None,
                timeout_s: float = 10.0) -> SSEResponse:
    """One request on a fresh connection; see :func:`read_events`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        sock.sendall(request_bytes(method, path, body=body, headers=headers))
        return read_events(sock, stop_after=stop_after, timeout_s=timeout_s)
    finally:
        sock.close()


def resume(port: int, stream_id: str, last_event_id: str | None, **kwargs: object) -> SSEResponse:
    """What an EventSource does on reconnect: GET the stream with Last-Event-ID."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    return open_stream(port, "GET", f"/v1/streams/{stream_id}", headers=headers, **kwargs)  # type: ignore[arg-type]


def resume_through_drops(port: int, first: SSEResponse, rng: random.Random,
                         max_cut: int = 5) -> list[SSEEvent]:
    """Reconnect after ``first`` (cut by the caller) until the stream ends,
    dropping some reconnects again at random points: every data event received,
    in order. Each reconnect that is not dropped must end cleanly."""
    received = list(first.data_events)
    while True:
        cut = rng.choice([None, rng.randint(1, max_cut)])
        more = resume(port, first.stream_id, received[-1].id, stop_after=cut)
        if more.status == 204:  # after the last event: an EventSource would stop here
            return received
        received += more.data_events
        if not more.dropped:
            assert more.clean_end, more
            return received
