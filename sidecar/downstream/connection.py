"""What the HTTP/1.1 and HTTP/2 connections share: the socket, the peer, the
request body's share of memory, CORS, refusals, and turning a request into an
:class:`~tokenwire.sidecar.exchange.loop.Exchange`.

Each protocol's connection (``http1.py``, ``http2.py``) parses its own framing
and calls these, so a request is forwarded the same way whichever protocol it
came in on: the same upstream headers, the same request ids, the same wire core.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from tokenwire.middleware import ClientError, ErrorCode
from tokenwire.middleware.core import frames
from tokenwire.middleware.core.headers import header_value

from ..context import SidecarContext
from ..exchange.forwarding import (
    request_id_from,
    upstream_request_headers,
    upstream_request_id,
    wants_stream,
)
from ..exchange.loop import Downstream, Exchange
from . import cors

Header = tuple[bytes, bytes]


class OpenConnection(Protocol):
    """What shutdown needs of any client connection (``context.connections``)."""

    @property
    def idle(self) -> bool: ...

    def close_if_idle(self) -> None: ...

    def abort(self) -> None: ...


@dataclass(frozen=True, slots=True, init=False)
class Peer:
    """What the socket says about the client, for the forwarding headers."""

    host: str | None
    server_port: int | None
    scheme: str
    client_cert_der: bytes | None
    """The client's verified certificate (mTLS), DER-encoded."""

    def __init__(self, host: str | None, server_port: int | None, scheme: str,
                 client_cert_der: bytes | None) -> None:
        # Written out, not generated: dataclass's __init__ is interpreted, an
        # object.__setattr__ call a field; this one is compiled (a stream's set-up,
        # docs/perf/stream-cost.md). tests/middleware/test_written_inits.py holds it to the fields.
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "server_port", server_port)
        object.__setattr__(self, "scheme", scheme)
        object.__setattr__(self, "client_cert_der", client_cert_der)


def accepted_peer(context: SidecarContext, sock: socket.socket, address: object, *, tls: bool) -> Peer:
    """Tune a client socket the acceptor just took, and what it says of the peer.

    Done on the accepted ``socket.socket`` before the loop has it: each question
    asked of a uvloop transport's socket (``get_extra_info``, its
    ``setsockopt``) builds and detaches a ``socket.socket`` in Python, about a
    twentieth of a short stream's set-up for these four (docs/perf/stream-cost.md).
    The send buffer is capped (``socket_send_buffer_bytes``) so that a slow
    reader is seen by the sidecar, where events can still be coalesced, not
    hidden in the kernel; ``address`` is what ``accept()`` returned.
    """
    wire = context.config.wire
    try:  # not contextlib.suppress: three interpreted calls a connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.socket_send_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    host = str(address[0]) if isinstance(address, tuple) and address else None
    try:
        local = sock.getsockname()
    except OSError:
        local = None
    port = int(local[1]) if isinstance(local, tuple) and len(local) >= 2 else None
    return Peer(host=host, server_port=port, scheme="https" if tls else "http", client_cert_der=None)


def set_up_transport(context: SidecarContext, transport: asyncio.Transport, peer: Peer) -> Peer:
    """Set the transport's high-water mark (``write_high_water_bytes``: see
    :func:`accepted_peer`) and return ``peer``, with the client's certificate
    under mTLS (known once the handshake is over)."""
    transport.set_write_buffer_limits(high=context.config.wire.write_high_water_bytes)
    if peer.scheme != "https" or not context.config.tls_client_ca:
        return peer
    ssl_object = transport.get_extra_info("ssl_object")
    cert = None if ssl_object is None else ssl_object.getpeercert(binary_form=True)
    return Peer(host=peer.host, server_port=peer.server_port, scheme=peer.scheme, client_cert_der=cert)


class BodyReservation:
    """The bytes of one request's body counted against ``max_buffered_body_bytes``
    (bodies are read whole and kept until their answer ends, for retries)."""

    __slots__ = ("_context", "reserved_bytes")

    def __init__(self, context: SidecarContext) -> None:
        self._context = context
        self.reserved_bytes = 0

    def reserve(self, body_bytes: int) -> bool:
        """Count ``body_bytes`` more; False (nothing counted) if all connections
        together would then hold more than ``max_buffered_body_bytes``."""
        context = self._context
        if body_bytes and context.buffered_body_bytes + body_bytes > context.config.max_buffered_body_bytes:
            return False
        context.buffered_body_bytes += body_bytes
        self.reserved_bytes += body_bytes
        return True

    def release(self) -> None:
        self._context.buffered_body_bytes -= self.reserved_bytes
        self.reserved_bytes = 0


# How long a refused or closed connection may keep sending before it is cut off
# (the lingering close of both protocols: the client reads its answer, not a reset).
LINGER_S: Final = 2.0

BUSY_BODIES: Final = "too many request bodies are being received; try again shortly"
"""The refusal when :meth:`BodyReservation.reserve` fails: many large uploads at
once would hold the loop and memory hostage; each one is fine again shortly, so
this is "busy" (503), not "too large"."""


def refusal(context: SidecarContext, status: int, message: str, *,
            retry_after_s: int | None = None) -> tuple[list[Header], bytes]:
    """The headers and JSON body of a request refused before any upstream saw it (counted)."""
    context.metrics.rejected_requests.labels(str(status)).inc()
    error = ClientError(message, ErrorCode.BAD_REQUEST, http_status=status, retry_after_s=retry_after_s)
    body = error.body()
    headers = error.response_headers()
    headers.append((b"content-length", str(len(body)).encode()))
    return headers, body


def cors_origins(context: SidecarContext, headers: Sequence[Header]) -> tuple[str, ...]:
    """The origins whose pages may read this request's answer (see ``cors.py``)."""
    return cors.origins_for(context.config.cors_allow_origins, context.admin_origins,
                            header_value(headers, b"origin"))


def with_cors(context: SidecarContext, request_headers: Sequence[Header],
              response_headers: Sequence[Header]) -> list[Header]:
    """``response_headers`` plus the CORS headers the request's origin is due."""
    headers = list(response_headers)
    origins = cors_origins(context, request_headers)
    if origins:
        headers = cors.with_cors_headers(headers, origins, header_value(request_headers, b"origin"),
                                         request_id_header=context.config.request_id_header.encode())
    return headers


def preflight(context: SidecarContext, method: bytes,
              headers: Sequence[Header]) -> tuple[int, list[Header], bytes] | None:
    """The answer to a CORS preflight, given here (the engine knows nothing of
    the sidecar's origins); None if the request is not one."""
    origins = cors_origins(context, headers)
    if not origins or not cors.is_preflight(method, headers):
        return None
    status, answer, body = cors.preflight_response(
        origins, headers, request_id_header=context.config.request_id_header.encode())
    return status, list(answer), body


def new_exchange(context: SidecarContext, downstream: Downstream, *, method: bytes, target: bytes,
                 headers: Sequence[Header], body: bytes, peer: Peer, http_version: str) -> Exchange:
    """The exchange that forwards one whole request (``headers`` as HTTP/1.1
    has them, ``Host`` included), not yet started."""
    config = context.config
    if frames.QUERY_PARAM in target:  # an EventSource's way to ask; no split of every other target
        headers = frames.with_query(headers, target.partition(b"?")[2])
    dialect = context.dialects.for_path(target.decode("latin-1"))
    # Usage asked of the engine for the record, where the client did not ask.
    asked = dialect.ask_usage(body) if config.request_usage and method == b"POST" else None
    if asked is not None:
        body = asked
    id_header = config.request_id_header.encode()
    request_id = request_id_from(headers, id_header)
    upstream_id = upstream_request_id(headers, id_header, request_id)
    upstream_headers = upstream_request_headers(
        headers, body_bytes=len(body), peer_host=peer.host, scheme=peer.scheme,
        request_id=upstream_id, request_id_header=id_header, client_request_id=request_id,
        server_port=peer.server_port, client_cert_der=peer.client_cert_der,
        drop_underscores=config.drop_underscore_headers)
    context.metrics.ends.count_request("h2" if http_version == "2" else "http/1.1")
    return Exchange(
        context, downstream, request_id=request_id, upstream_request_id=upstream_id, method=method,
        target=target, upstream_headers=upstream_headers, body=body,
        expect_stream=wants_stream(headers, body), http_version=http_version,
        client_address=peer.host or "", dialect=dialect, hide_usage_chunk=asked is not None,
        frames=frames.asked(headers))
