"""The engine's answers while its model loads: alive, not ready.

``tokenwire engine`` binds its listener first, then loads the model (seconds to
minutes: torch, the weights, a scheduler process), and only then starts
uvicorn. Until then, a client (the kubelet's probes, the sidecar's health
check) would find a socket that accepts and never answers. :class:`LoadingServer`
answers on that same listening socket meanwhile, in a thread of its own:

* ``GET /healthz``: 200 ``{"status":"ok"}`` (the process lives: a liveness
  probe does not restart an engine that is only slow to load);
* ``GET /readyz`` and ``GET /health``: 503 ``{"status":"loading"}``;
* anything else: 503 with ``Retry-After`` and an OpenAI-shaped error.

:meth:`LoadingServer.stop` stops accepting before uvicorn takes the socket;
connections that arrive in between wait in the listen backlog for uvicorn, so
no client sees the handover. One short connection at a time per thread, each
``Connection: close``: probes, not traffic.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import socket
import stat
import threading

from tokenwire.middleware.core.errors import ErrorCode, error_object

# A probe's whole request head must come within this; longer is a client we drop.
_READ_TIMEOUT_S = 2.0
_MAX_HEAD_BYTES = 8192
# How often the accept loop looks at its stop flag while nobody connects.
_POLL_S = 0.2
_RETRY_AFTER_S = 1


def _answer(status: int, body: dict[str, object], extra: str = "") -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    reason = "OK" if status == 200 else "Service Unavailable"
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n").encode() + payload


def loading_answer(head: bytes) -> bytes:
    """The whole response to one request head while the model loads (no I/O)."""
    method, _, rest = head.partition(b" ")
    path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
    if method in (b"GET", b"HEAD") and path == b"/healthz":
        return _answer(200, {"status": "ok"})
    if method in (b"GET", b"HEAD") and path in (b"/readyz", b"/health"):
        return _answer(503, {"status": "loading"})
    return _answer(503, error_object("the engine is loading its model", "server_error",
                                     ErrorCode.UPSTREAM_UNAVAILABLE),
                   f"retry-after: {_RETRY_AFTER_S}\r\n")


def bind_unix(path: str, backlog: int = 2048) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale socket file there is replaced,
    as uvicorn does; mode 0666, or the old file's), for the loading answers and then uvicorn."""
    mode = 0o666
    with contextlib.suppress(FileNotFoundError):
        existing = os.stat(path)
        if not stat.S_ISSOCK(existing.st_mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
        mode = stat.S_IMODE(existing.st_mode)
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class LoadingServer:
    """Answers on ``sock`` (already listening) until :meth:`stop`; see the module docstring."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tokenwire-loading", daemon=True)

    def start(self) -> LoadingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting (within ``_POLL_S``); the socket stays open, for uvicorn."""
        self._stopping.set()
        self._thread.join()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            readable, _, _ = select.select([self._sock], [], [], _POLL_S)
            if not readable or self._stopping.is_set():
                continue
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue  # another waiter took it, or a signal
            except OSError:
                return  # the socket was closed under us: nothing more to serve
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            conn.setblocking(True)
            conn.settimeout(_READ_TIMEOUT_S)
            head = b""
            try:
                while b"\r\n\r\n" not in head and len(head) < _MAX_HEAD_BYTES:
                    data = conn.recv(4096)
                    if not data:
                        return
                    head += data
                conn.sendall(loading_answer(head))
            except OSError:
                pass  # the client left or stalled: nothing to tell it
