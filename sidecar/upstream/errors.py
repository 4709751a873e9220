"""The sidecar's own HTTP/1.1 client fails in one family of its own.

The client (:mod:`~tokenwire.sidecar.upstream.conn` and the modules under it)
left httpcore for its speed but kept its contract: every failure is an
exception of :class:`UpstreamClientError`, named for what went wrong on the
socket, never a bare ``OSError`` or ``asyncio`` error. :func:`failure_kind`
maps that family onto the wire core's :class:`FailureKind`, once, and
:func:`caller_message` onto the words its caller reads; the attempt
(:func:`~tokenwire.sidecar.upstream.attempt.run_attempt`) reports it to the
core as ``UpstreamFailed``. httpcore is still the client of the health checks,
load scrapes and abort calls; its exceptions stay there.
"""

from __future__ import annotations

from tokenwire.middleware import FailureKind


class UpstreamClientError(Exception):
    """A failure of the sidecar's own upstream client."""


class ConnectFailed(UpstreamClientError):
    """No connection to the pod: refused, unreachable, or its pool closed."""


class ConnectTimedOut(ConnectFailed):
    """No connection within ``upstream_connect_timeout_s``."""


class PoolTimedOut(ConnectFailed):
    """Every connection to the pod stayed in use for the pool's timeout."""


class ReadFailed(UpstreamClientError):
    """The connection broke while the answer was read."""


class WriteFailed(UpstreamClientError):
    """The connection broke (or was closed) while the request was written."""


class RemoteProtocolFault(UpstreamClientError):
    """What the pod sent is not HTTP/1.1 as h11 reads it (or it stopped mid-message)."""


class CutShort(RemoteProtocolFault):
    """The pod closed the connection before its body's framing said the body ended."""


class LocalProtocolFault(UpstreamClientError):
    """The request would not be HTTP/1.1 as h11 writes it: refused before it is sent."""


STALE_CONNECTION_ERRORS: tuple[type[UpstreamClientError], ...] = (
    ReadFailed, WriteFailed, RemoteProtocolFault)
"""How a request fails on a keep-alive connection the pod had closed (a timeout is not that)."""


def failure_kind(error: Exception) -> FailureKind:
    """The wire core's kind of an attempt's failure: a connection that never
    came is ``CONNECT`` (the core may try another pod at once); anything else,
    this family or not, is ``PROTOCOL``."""
    return FailureKind.CONNECT if isinstance(error, ConnectFailed) else FailureKind.PROTOCOL


def caller_message(error: Exception) -> str:
    """What went wrong, in the words of the caller's in-band error or 502/503:
    no class names, addresses or library messages (those go to the log)."""
    for family, message in _CALLER_MESSAGES:
        if isinstance(error, family):
            return message
    return "the proxy could not read the answer"


_CALLER_MESSAGES: tuple[tuple[type[Exception], str], ...] = (
    # Subclasses before their family.
    (ConnectTimedOut, "no connection in time"),
    (PoolTimedOut, "no free connection in time"),
    (ConnectFailed, "no connection"),
    (ReadFailed, "the connection broke during the answer"),
    (CutShort, "the upstream closed the connection before its answer ended"),
    (WriteFailed, "the connection broke while the request was sent"),
    (RemoteProtocolFault, "the answer was not valid HTTP/1.1"),
    (LocalProtocolFault, "the request could not be sent as HTTP/1.1"),
)
