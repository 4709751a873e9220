"""The proxy's listening sockets: a burst of connections accepted a few a loop turn, not one.

Theory of operation
-------------------
``loop.create_server`` on uvloop takes *one* connection from the listening
socket per loop turn (libuv's listen callback), and a turn of a busy sidecar
is long: it forwards every stream's reads and sets up the streams accepted
before. A burst of new connections therefore waited one turn each: the last
of a burst of clients started long after the kernel had connected them all,
while the sidecar was idle much of that time (docs/perf/sidecar-http1.md,
"Accepting a burst"). asyncio's own server accepts up to its backlog per
turn, and nginx's turns are microseconds long.

Here each listening socket is registered with ``loop.add_reader``; when it is
readable, connections are accepted until the kernel has none left or
:data:`_MAX_ACCEPTS_PER_TURN` were (the rest on the next turns: the streams
already open then never wait behind more than a few set-ups), and each
becomes a transport through
``loop.connect_accepted_socket`` (TLS handshakes included), the documented way
to hand an accepted socket to the loop. Running out of descriptors (EMFILE and
the like) stops accepting for :data:`_ACCEPT_RETRY_S`, as asyncio does, so the
loop does not spin on a socket it cannot serve; the connections wait in the
kernel's backlog meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Callable

from ..settings import format_host_port
from ..tasks import spawn

logger = logging.getLogger("tokenwire.sidecar")

# Bounds one turn's accepting; the rest are taken on the next turn (the socket
# stays readable). Each accepted connection costs its set-up in the turns
# after, and the open streams' events wait for the turn to end: the smaller
# the bound, the shorter the events' latency tail, while the burst's last
# first event comes about as late (CPU-bound; the sweep:
# docs/perf/sidecar-http1.md, "Accepting a burst"). A few more epoll calls per
# burst are all a small bound costs.
_MAX_ACCEPTS_PER_TURN = 4
# How many queued connections a listening socket's close accepts first (the
# kernel's default listen backlog bound, net.core.somaxconn, is 4096).
_MAX_QUEUED_AT_CLOSE = 4096
# Out of descriptors or memory: how long accepting pauses (asyncio's own delay).
_ACCEPT_RETRY_S = 1.0
_PLAIN_HTTP_HOSTS_KEPT = 1024
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


async def bind_listeners(host: str | None, port: int, *, backlog: int,
                         reuse_port: bool) -> list[socket.socket]:
    """Listening sockets for ``host``:``port``, one per address it resolves to
    (as ``loop.create_server`` binds them: ``SO_REUSEADDR``, IPv6 sockets
    IPv6-only, ``SO_REUSEPORT`` when ``reuse_port``); an empty host is every interface."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, family=socket.AF_UNSPEC,
                                   type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as error:
                where = format_host_port(str(address[0]), int(address[1]))
                raise OSError(error.errno, f"cannot listen on {where}: {error.strerror or error}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class _AcceptedIPv4(socket.socket):
    """An accepted TCP socket whose ``family`` and ``type`` are plain attributes
    of its class. uvloop asks an accepted socket for them three times
    (``connect_accepted_socket``), and ``socket.socket`` answers each through
    a Python property that converts the number to an enum member (about 5 k
    instructions each: with ``accept()``'s own two, nearly a twentieth of a short
    stream's set-up, docs/perf/stream-cost.md)."""

    __slots__ = ()
    family = socket.AF_INET
    type = socket.SOCK_STREAM


class _AcceptedIPv6(socket.socket):
    """:class:`_AcceptedIPv4`'s twin for IPv6."""

    __slots__ = ()
    family = socket.AF_INET6
    type = socket.SOCK_STREAM


_ACCEPTED_CLASSES: dict[int, type[socket.socket]] = {socket.AF_INET: _AcceptedIPv4,
                                                     socket.AF_INET6: _AcceptedIPv6}


_Kind = tuple[type[socket.socket], int, int]
"""What a listener's connections are built as: the class, the family, the protocol."""


def _accept(listener: socket.socket, kind: _Kind) -> tuple[socket.socket, object]:
    """``listener.accept()``, the socket built as ``kind`` says (``socket.accept``
    itself builds a ``socket.socket`` from ``_accept()``'s descriptor the same
    way, after converting the listener's family and type to enums)."""
    fd, address = listener._accept()  # type: ignore[attr-defined]
    cls, family, proto = kind
    return cls(family, socket.SOCK_STREAM, proto, fd), address


AcceptedFactory = Callable[[socket.socket, object], asyncio.BaseProtocol]
"""A protocol for an accepted socket and its peer's address (what ``accept()``
returned), called before the loop has the socket: what is asked of the socket
then costs a C call, where a transport's socket is rebuilt in Python for each
question (``connection.accepted_peer``)."""


class Acceptor:
    """Serves ``sockets``: each connection accepted becomes a transport speaking
    ``protocol_factory(socket, address)``'s protocol (under ``tls`` when given)."""

    def __init__(self, sockets: list[socket.socket], protocol_factory: AcceptedFactory,
                 *, tls: ssl.SSLContext | None = None, tls_handshake_timeout_s: float | None = None) -> None:
        self.sockets = sockets
        # What each listener's connections are built as (a plain socket.socket
        # for a family the lean classes do not cover).
        self._kinds: dict[socket.socket, _Kind] = {
            sock: (_ACCEPTED_CLASSES.get(sock.family, socket.socket), int(sock.family), sock.proto)
            for sock in sockets}
        self._port = sockets[0].getsockname()[1] if sockets else 0
        self._factory = protocol_factory
        self._tls = tls
        self._tls_handshake_timeout_s = tls_handshake_timeout_s if tls is not None else None
        self._loop = asyncio.get_running_loop()
        self._handovers: set[asyncio.Task[object]] = set()
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        # Hosts already told of in the log for plain HTTP on the TLS port: once
        # each (a misconfigured client retries, each time a line otherwise),
        # bounded so that many such hosts cost no more than this many entries.
        self._plain_http_hosts: set[str] = set()

    def start(self) -> None:
        """Start accepting."""
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        """Stop accepting and close the listening sockets (open connections stay).

        The connections the kernel has already established and queued are
        accepted first (up to :data:`_MAX_QUEUED_AT_CLOSE` a socket): closing
        a listening socket resets them, and their clients, whose ``connect()``
        succeeded and who may have sent a request, would get a reset instead
        of an answer. Taken, they are served like any other connection
        during a drain (a new request is refused with 503 and Retry-After);
        :meth:`handed_over` waits until each is a connection of the proxy."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
            try:
                self._accept(sock, _MAX_QUEUED_AT_CLOSE)
            except OSError as error:  # what is still queued is reset by the close
                logger.error("cannot accept the queued connections before closing (%s)", error)
            sock.close()

    async def handed_over(self) -> None:
        """Return once every accepted connection is a transport of the proxy
        (or dropped: a failed TLS handshake)."""
        while self._handovers:
            await asyncio.wait(list(self._handovers))

    def _accept(self, listener: socket.socket, most: int = _MAX_ACCEPTS_PER_TURN) -> None:
        kind = self._kinds[listener]
        for _ in range(most):
            try:
                connection, peer = _accept(listener, kind)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued: nothing to serve
            except OSError as error:
                if error.errno not in _RESOURCE_ERRNOS:
                    raise
                logger.error("cannot accept connections (%s): pausing for %.1f s", error, _ACCEPT_RETRY_S)
                if not self._closed:
                    self._pause()
                return
            connection.setblocking(False)
            spawn(self._handovers, self._hand_over(connection, peer))

    async def _hand_over(self, connection: socket.socket, peer: object) -> object:
        try:
            protocol = self._factory(connection, peer)
            return await self._loop.connect_accepted_socket(
                lambda: protocol, connection, ssl=self._tls,
                ssl_handshake_timeout=self._tls_handshake_timeout_s)
        except (TimeoutError, ssl.SSLError, OSError) as error:
            # A client that failed its TLS handshake or vanished first: its
            # connection was never the proxy's; create_server drops these too.
            logger.debug("connection dropped before it was served: %r", error)
            if getattr(error, "reason", None) == "HTTP_REQUEST":
                self._plain_http(peer)
            connection.close()
            return None

    def _plain_http(self, peer: object) -> None:
        """A client spoke plain HTTP to the TLS port (OpenSSL recognises the
        request line). The handshake's failure has already closed the socket, so
        no 400 can be written as nginx does; the log says it, once per host."""
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if host in self._plain_http_hosts:
            return
        if len(self._plain_http_hosts) >= _PLAIN_HTTP_HOSTS_KEPT:
            self._plain_http_hosts.clear()
        self._plain_http_hosts.add(host)
        logger.warning("plain HTTP from %s on the TLS port %s: the client must use https:// "
                       "(said once per client host)", host, self._port)

    def _pause(self) -> None:
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
        self._retry = self._loop.call_later(_ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self.start()
