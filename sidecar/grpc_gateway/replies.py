"""What every call handler does with its HTTP/2 stream: read, end, pass metadata on.

Each handler of ``driver`` reads its request messages (bounded), ends its call
(trailers, or a trailers-only response) and hands its metadata on as an HTTP
request's headers alike; written once here.

The stream does the I/O; these only say what to send on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import h2.errors

from .framing import GrpcCallError, MessageReader
from .metadata import CallStatus, Header

if TYPE_CHECKING:
    from ..downstream.http2_request import RequestHead
    from ..downstream.http2_stream import Http2Stream

# Request metadata that is gRPC's own, not the engine's: never forwarded.
_GRPC_ONLY = frozenset({b"content-type", b"content-length", b"te", b"grpc-timeout", b"grpc-encoding",
                        b"grpc-accept-encoding", b"grpc-message-type", b"accept", b"accept-encoding"})


def end_call(stream: Http2Stream, status: CallStatus, *, started: bool, drop_waiting: bool = False,
             extra: Sequence[Header] = ()) -> None:
    """End a call: trailers after the initial metadata, else a trailers-only
    response; ``extra``: trailers after the status's (a summary the call asked for)."""
    if started:
        stream.send_trailers([*status.trailers(), *extra], drop_waiting=drop_waiting)
    else:
        stream.send_trailers([(b":status", b"200"), *status.trailers_only(), *extra],
                             drop_waiting=drop_waiting)
    # A client that stopped reading would hold the trailers back forever.
    stream.set_timer(stream.connection.context.config.wire.close_flush_timeout_s,
                     lambda: stream.reset(h2.errors.ErrorCodes.CANCEL))


def request_headers(head: RequestHead) -> list[Header]:
    """A call's metadata as an HTTP request's headers (``Host`` included):
    gRPC's own and binary (``-bin``) metadata left out. ``authorization``
    stays: it is the caller, for the engine and for the resume rules."""
    headers: list[Header] = []
    if head.authority is not None and head.header(b"host") is None:
        headers.append((b"host", head.authority))
    headers += [(name, value) for name, value in head.headers
                if name not in _GRPC_ONLY and not name.endswith(b"-bin")]
    return headers


class Messages:
    """The request messages of a call, bounded; refuses the call on a bad one."""

    def __init__(self, max_message_bytes: int, stream: Http2Stream) -> None:
        self._stream = stream
        self._reader = MessageReader(max_message_bytes)
        self.done = False
        """The call is over (refused or answered): ignore the rest of the request."""

    def read(self, data: bytes) -> list[bytes]:
        """The whole messages ``data`` completes (none once the call is over)."""
        if self.done:
            return []
        try:
            return self._reader.feed(data)
        except GrpcCallError as error:
            self.refuse(error, started=False)
            return []

    def close(self) -> bool:
        """The request ended; False if it ended inside a message (refused)."""
        if self.done:
            return False
        try:
            self._reader.close()
        except GrpcCallError as error:
            self.refuse(error, started=False)
            return False
        return True

    def refuse(self, error: GrpcCallError, *, started: bool) -> None:
        """End the call with ``error``'s status."""
        self.finish(CallStatus(error.status, error.message), started=started)

    def finish(self, status: CallStatus, *, started: bool) -> None:
        """End the call with ``status`` (once) and let the stream go."""
        if self.done:
            return
        self.done = True
        end_call(self._stream, status, started=started)
        self._stream.exchange_finished(None)
