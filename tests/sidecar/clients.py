"""Small blocking clients on raw sockets: they see exactly what went on the wire
(chunked terminator or not, resets, heartbeats) where HTTP libraries hide it."""

from __future__ import annotations

import itertools
import json
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11


@dataclass
class RawResponse:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    clean_end: bool = False
    """True if the body ended with its framing complete (chunked terminator / full length)."""
    error: str = ""

    def datas(self) -> list[str]:
        """The ``data:`` payloads of the SSE body, in order."""
        return sse_datas(self.body)

    def json(self) -> Any:
        return json.loads(self.body)


def sse_datas(body: bytes) -> list[str]:
    return [line[len(b"data: "):].decode() for line in body.split(b"\n") if line.startswith(b"data: ")]


def chat_body(stream: bool = True, **extra: Any) -> bytes:
    return json.dumps({"model": "fake", "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def request_bytes(method: str, path: str, *, body: bytes = b"", headers: dict[str, str] | None = None,
                  host: str = "127.0.0.1") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if body and "Transfer-Encoding" not in all_headers:
        all_headers.setdefault("Content-Length", str(len(body)))
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def connect(port: int, *, host: str = "127.0.0.1", timeout_s: float = 10.0,
            receive_buffer_bytes: int | None = None,
            ssl_context: ssl.SSLContext | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.settimeout(timeout_s)
    sock.connect((host, port))
    if ssl_context is not None:
        return ssl_context.wrap_socket(sock, server_hostname="localhost")
    return sock


def reset(sock: socket.socket) -> None:
    """Close with RST (linger 0), as a crashed client or a killed tab would."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class ResponseReader:
    """Reads one response off ``sock`` in steps: the head first, the rest later."""

    def __init__(self, sock: socket.socket, timeout_s: float = 10.0, *, buffered: bytes = b"") -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.conn = h11.Connection(h11.CLIENT)
        # h11 must believe it sent a request to parse a response.
        self.conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        self.conn.send(h11.EndOfMessage())
        if buffered:  # (b"" would mean EOF to h11)
            # Bytes already read off the socket past the previous response (pipelining).
            self.conn.receive_data(buffered)
        self.response = RawResponse()
        self._body = bytearray()

    @property
    def trailing(self) -> bytes:
        """What was read past the end of this response: the next one's start."""
        data, _closed = self.conn.trailing_data
        return bytes(data)

    def read(self, *, head_only: bool = False) -> RawResponse:
        response = self.response
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as error:
                response.error = str(error)
                break
            if event is h11.NEED_DATA:
                if time.monotonic() > deadline:
                    response.error = "timeout"
                    break
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    response.error = "timeout"
                    break
                except (ConnectionResetError, ssl.SSLError) as error:
                    response.error = f"reset: {error}"
                    break
                self.conn.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                response.status = event.status_code
                response.headers = {k.decode(): v.decode() for k, v in event.headers}
                if head_only:
                    break
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                response.clean_end = True
                break
            elif isinstance(event, h11.ConnectionClosed):
                break
        response.body = bytes(self._body)
        return response


def read_response(sock: socket.socket, *, timeout_s: float = 10.0, head_only: bool = False) -> RawResponse:
    """Read one response (skipping 1xx) until its end or the connection's."""
    return ResponseReader(sock, timeout_s).read(head_only=head_only)


def read_responses(sock: socket.socket, count: int, *, timeout_s: float = 10.0) -> list[RawResponse]:
    """Read ``count`` pipelined responses; one ``recv`` may hold the end of
    one and the start of the next, so nothing read is thrown away."""
    responses: list[RawResponse] = []
    buffered = b""
    for _ in range(count):
        reader = ResponseReader(sock, timeout_s, buffered=buffered)
        responses.append(reader.read())
        buffered = reader.trailing
    return responses


def exchange(port: int, method: str, path: str, *, body: bytes = b"",
             headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> RawResponse:
    """One request on a fresh connection, response read to the end."""
    with connect(port, timeout_s=timeout_s) as sock:
        sock.sendall(request_bytes(method, path, body=body, headers=headers))
        return read_response(sock, timeout_s=timeout_s)


def wait_for(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.005) -> float:
    """Poll until ``predicate()`` is true; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError("condition not met in time")
        time.sleep(interval_s)
    return time.monotonic() - start


class StreamWatcher(threading.Thread):
    """A bystander: reads one long stream in the background and notes when each
    read carrying events arrived, so a test can assert that what it does to
    the sidecar meanwhile never stalled this client. ``stop()`` ends it."""

    def __init__(self, port: int, *, path: str = "/normal/v1/chat/completions", tokens: int = 100_000,
                 delay_s: float = 0.01, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(daemon=True)
        self.sock = connect(port, ssl_context=ssl_context)
        self.sock.sendall(request_bytes("POST", path, body=chat_body(), headers={
            "x-fake-tokens": str(tokens), "x-fake-delay-s": str(delay_s)}))
        self.arrivals: list[float] = []
        self.body = bytearray()
        self.error = ""
        self.first_event = threading.Event()
        self._stopping = threading.Event()

    def run(self) -> None:
        self.sock.settimeout(0.5)
        try:
            while not self._stopping.is_set():
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    self.error = "closed by the server"
                    return
                self.body += data
                if b"data: " in data:
                    self.arrivals.append(time.monotonic())
                    self.first_event.set()
        except OSError as error:
            if not self._stopping.is_set():
                self.error = f"{type(error).__name__}: {error}"

    def stop(self) -> float:
        """Stop reading and close; the longest gap between reads that carried events."""
        self._stopping.set()
        self.join(5)
        self.sock.close()
        assert not self.error, self.error
        assert len(self.arrivals) > 10, f"the bystander stream barely moved: {len(self.arrivals)} reads"
        return max(b - a for a, b in itertools.pairwise(self.arrivals))


def tls_server_files(ca: Any, directory: Path, *, name: str = "server") -> dict[str, str]:
    """Write a certificate for localhost/127.0.0.1 from the trustme ``ca`` and its
    key under ``directory``: the sidecar's ``tls_cert``/``tls_key``, and ``ca``."""
    cert = ca.issue_cert("localhost", "127.0.0.1")
    paths = {key: directory / f"{name}-{key}.pem" for key in ("tls_cert", "tls_key", "ca")}
    paths["tls_cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(paths["tls_key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return {key: str(path) for key, path in paths.items()}


def tls_client_context(ca: Any) -> ssl.SSLContext:
    """A client context that trusts ``ca`` (a trustme CA)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context
