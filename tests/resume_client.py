"""A resuming SSE client for the tests of both drivers: reads events (with their
ids) off a real socket, can stop after N events and drop the connection (with a
reset, as a phone losing its network), then reconnect the way an EventSource
does. Self-contained: tests/ is on sys.path for every test folder."""

from __future__ import annotations

import random
import socket
import struct

from tokenwire.middleware import SSEEvent

from tokenwire.tools.sse_client import SSEResponse, read_response

__all__ = ["SSEResponse", "open_stream", "read_events", "reset", "resume", "resume_through_drops"]


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


def read_events(sock: socket.socket, *, stop_after: int | None = None, timeout_s: float = 10.0,
                drop: bool = True) -> SSEResponse:
    """Read one response; with ``stop_after``, stop once that many data events
    arrived (``stopped``) and, with ``drop``, reset the connection (a phone
    losing its network)."""
    def enough(response: SSEResponse, event: SSEEvent) -> bool:
        return stop_after is not None and event.data is not None \
            and len(response.data_events) >= stop_after

    response = read_response(sock, timeout_s=timeout_s, stop=enough)
    if response.error == "timeout":
        raise AssertionError("timed out reading the stream")
    if response.stopped and drop:
        reset(sock)
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
        if not more.stopped:
            assert more.clean_end, more
            return received
