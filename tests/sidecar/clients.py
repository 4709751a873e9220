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
from pathlib import Path
from typing import Any

from tokenwire.middleware.core.sse import SSEParser

from tokenwire.tools.sse_client import BlockingReader, ResponseParser, SSEResponse, read_response

__all__ = ["RawResponse", "read_response"]


RawResponse = SSEResponse
"""One response as the raw-socket clients read it (``tokenwire.tools.sse_client``)."""


def sse_datas(body: bytes) -> list[str]:
    """The ``data`` of every SSE event in ``body``, in order."""
    return [event.data for event in SSEParser().feed(body) if event.data is not None]


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


def open_silent_streams(port: int, request_ids: list[str]) -> list[socket.socket]:
    """One client per id, each with a streaming chat request on the fake
    upstream's ``/silent`` path (its head, then 60 s of silence): their
    sockets, each response head read."""
    socks = []
    for request_id in request_ids:
        sock = connect(port)
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": "60", "X-Request-Id": request_id}))
        socks.append(sock)
    for sock in socks:
        assert read_response(sock, head_only=True).status == 200
    return socks


class ResponseReader(BlockingReader):
    """Reads one response off ``sock`` in steps: the head first (``head_only``), the rest later."""

    def __init__(self, sock: socket.socket, timeout_s: float = 10.0, *, buffered: bytes = b"") -> None:
        super().__init__(sock, ResponseParser(buffered=buffered), timeout_s=timeout_s)

    @property
    def trailing(self) -> bytes:
        """What was read past the end of this response: the next one's start."""
        return self.parser.trailing


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
