"""The send-buffer cap on the server's own sockets, for the ASGI middleware.

The core sees a client that stops reading only once the server's
``send`` stops completing at once, which it does only when the kernel's send
buffer is full, and Linux grows a TCP socket's send buffer up to
``net.ipv4.tcp_wmem``'s maximum (4 MiB by default): under a server that binds
its own socket (``uvicorn module:app``), a stalled reader took 2.8 MB of
events, uncoalesced, before ``StreamControl.backpressured`` turned true
(measured on loopback; about 80 kB once capped;
docs/architecture.md#slow-readers). ASGI gives an app no socket: no server
(uvicorn's h11, httptools and zttp protocols, hypercorn, granian) puts its
transport or socket in the scope or an extension. The sockets are this
process's own, though, so at the first request on each server port
(``scope["server"]``, the earliest point the middleware learns it: lifespan
startup runs before uvicorn binds) :class:`SendBufferCap` looks through the
process's descriptors (``/proc/self/fd``; ``/dev/fd`` elsewhere) for the TCP
sockets bound to that port and sets ``SO_SNDBUF`` to
``socket_send_buffer_bytes`` on each, through a duplicate descriptor closed at
once: the listener, which the connections it accepts from then on copy it
from, and the connections it already accepted, the request's own among them.
The server's objects are not touched, and on a :func:`listening_socket` the
option is already what it is set to. Where it cannot (no descriptor listing,
no listener on that port in this process, a server that does not give its
address), it says so once for that port, a warning with the fix: serve the app
from a :func:`listening_socket`. A Unix socket's peer is a local proxy, whose
own buffers stand between it and the client: nothing is done or said for one.
What the middleware cannot reach is the server's transport: its write buffer
(asyncio's default high-water mark, 64 KiB) still takes that much before the
server's ``send`` waits.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from dataclasses import dataclass

from .types import Scope

logger = logging.getLogger("tokenwire.middleware")

DESCRIPTOR_FOLDERS = ("/proc/self/fd", "/dev/fd")
"""Where the process's open descriptors are listed (Linux; the BSDs and macOS)."""

FIX = ("serve the app from tokenwire.middleware.listening_socket(host, port, config), "
       "e.g. uvicorn.Server(uvicorn.Config(app)).run(sockets=[listening_socket(\"0.0.0.0\", 8000)])")
"""What the warning tells a deployment to do."""


@dataclass(frozen=True, slots=True)
class Capped:
    """What :func:`cap_port` set ``SO_SNDBUF`` on."""

    listeners: int
    """Listening sockets on the port: every connection they accept from now on is capped."""
    connections: int
    """Connections already accepted on the port."""


def descriptors(folders: tuple[str, ...] = DESCRIPTOR_FOLDERS) -> list[int] | None:
    """The process's open descriptors, listed in the first of ``folders`` there
    is; None where the system lists them in none."""
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        return sorted(int(name) for name in names if name.isdigit())
    return None


def cap_port(port: int, send_buffer_bytes: int,
             folders: tuple[str, ...] = DESCRIPTOR_FOLDERS) -> Capped | None:
    """Set ``SO_SNDBUF`` to ``send_buffer_bytes`` on every TCP socket of this
    process bound to ``port`` (a listener and the connections it accepted);
    None where the process's descriptors cannot be listed (``folders``)."""
    found = descriptors(folders)
    if found is None:
        return None
    listeners = connections = 0
    for fd in found:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            duplicate = os.dup(fd)
        except OSError:  # closed since it was listed (the listing's own descriptor, say)
            continue
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            continue
        with sock:  # closes the duplicate only
            try:
                if (sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6)
                        or sock.getsockname()[1] != port):
                    continue
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 0
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            except OSError:
                continue
        if listening:
            listeners += 1
        else:
            connections += 1
    return Capped(listeners, connections)


class SendBufferCap:
    """One middleware's caps: each server port is looked at once, at its first
    request (:meth:`see`). See the module docstring."""

    __slots__ = ("_seen", "folders", "send_buffer_bytes")

    def __init__(self, send_buffer_bytes: int, folders: tuple[str, ...] = DESCRIPTOR_FOLDERS) -> None:
        self.send_buffer_bytes = send_buffer_bytes
        self.folders = folders
        """Where the process's descriptors are listed (:data:`DESCRIPTOR_FOLDERS`)."""
        self._seen: set[int | str | None] = set()

    def see(self, scope: Scope) -> None:
        """Called with every HTTP request's scope: its port's first caps that
        port's sockets, or warns that a slow client cannot be seen there."""
        server = scope.get("server")  # [host, port]; [path, None] for a Unix socket; or absent
        key: int | str | None = None
        if server is not None and len(server) == 2:
            key = server[1] if isinstance(server[1], int) else "unix" if server[1] is None else None
        if key in self._seen:
            return
        self._seen.add(key)
        if not isinstance(key, int):
            if key is None:
                self.cannot(None, "the server does not say which address it serves (no scope[\"server\"])")
            return  # a Unix socket: a local proxy's
        capped = cap_port(key, self.send_buffer_bytes, self.folders)
        if capped is None:
            self.cannot(key, "this system does not list a process's descriptors "
                             f"({' or '.join(self.folders)}), so the listener cannot be reached")
            return
        if capped.listeners == 0:
            self.cannot(key, "no listening socket on that port in this process to cap")
            return
        logger.info("send buffer capped", extra={"fields": {
            "port": key, "socket_send_buffer_bytes": self.send_buffer_bytes,
            "listeners": capped.listeners, "connections": capped.connections}})

    def cannot(self, port: int | None, why: str) -> None:
        """The one warning for ``port``: a slow client will not be seen there."""
        where = "" if port is None else f" on port {port}"
        logger.warning(
            f"backpressure cannot be seen{where}: {why}; the kernel's send buffer of each connection "
            "stays uncapped (megabytes, net.ipv4.tcp_wmem), so a client that stops reading takes that "
            "much, uncoalesced, before StreamControl.backpressured turns true and max_pending_bytes "
            f"or write_deadline_s can act. To cap it at socket_send_buffer_bytes, {FIX}",
            extra={"fields": {"port": port, "socket_send_buffer_bytes": self.send_buffer_bytes}})
