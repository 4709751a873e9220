"""Which protocol a new client connection speaks: ALPN under TLS, the preface on plaintext.

Under TLS the handshake is over when the connection reaches the listener, so
the protocol the client and the sidecar agreed on (ALPN ``h2`` or ``http/1.1``)
picks the connection object at once. On plaintext, a client inside a cluster
speaks HTTP/2 with prior knowledge: its first bytes are the connection preface.
The first bytes are read here until they match the preface or cannot, then
replayed into the chosen connection, which takes the transport over
(``set_protocol``): after that this object is out of the path.
"""

from __future__ import annotations

import asyncio
import typing

from ..context import SidecarContext
from ..downstream.connection import Peer
from ..downstream.http1 import ClientConnection
from ..downstream.http2 import PREFACE, Http2Connection, StreamRoute


class ProtocolSelector(asyncio.Protocol):
    """A new connection until its protocol is known (see the module docstring)."""

    def __init__(self, context: SidecarContext, peer: Peer, route: StreamRoute | None = None) -> None:
        self._context = context
        self._peer = peer
        self._route = route
        self._transport: asyncio.Transport | None = None
        self._received = b""
        self._over_limit = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        transport = typing.cast(asyncio.Transport, transport)
        self._transport = transport
        peer = self._peer
        if not self._context.config.http2:
            self._hand_over(ClientConnection(self._context, peer))
            return
        ssl_object = transport.get_extra_info("ssl_object") if peer.scheme == "https" else None
        if ssl_object is not None:
            chosen = ssl_object.selected_alpn_protocol()
            self._hand_over(Http2Connection(self._context, peer, route=self._route) if chosen == "h2"
                            else ClientConnection(self._context, peer))
            return
        # Counted as a connection (shutdown closes it; the limit sees it) while
        # undecided, and measured against the limit now, in the order connections came.
        self._over_limit = len(self._context.connections) >= self._context.config.max_connections
        self._context.connections.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            self._context.config.header_read_timeout_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        received = self._received + data
        if len(received) < len(PREFACE) and PREFACE.startswith(received):
            self._received = received  # not decided yet
            return
        self._forget()
        protocol: asyncio.Protocol
        if received.startswith(PREFACE):
            protocol = Http2Connection(self._context, self._peer, route=self._route,
                                       over_limit=self._over_limit)
        else:
            protocol = ClientConnection(self._context, self._peer, over_limit=self._over_limit)
        self._hand_over(protocol)
        protocol.data_received(received)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()

    # What shutdown asks of a connection (connection.OpenConnection).

    @property
    def idle(self) -> bool:
        return True

    def close_if_idle(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _forget(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._context.connections.discard(self)

    def _hand_over(self, protocol: asyncio.Protocol) -> None:
        transport = self._transport
        assert transport is not None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
