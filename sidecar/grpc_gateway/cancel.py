"""``tokenwire.v1.Streams/CancelStream``: the HTTP cancel by id, made over gRPC.

The call is not a second implementation of the cancel. Its one request
message names a stream; the driver makes of it the very request the HTTP
port takes, ``DELETE /v1/streams/{id}`` with the call's metadata as headers
(``authorization`` among them, whose hash is the caller: the owner check is
the HTTP one), and hands it to an ordinary
:class:`~tokenwire.sidecar.exchange.loop.Exchange`: the resume rules
(``enter_resume``) find it a ``CancelStream``, the driver's ``answer_cancel``
stops the stream's writer through ``registry.stop_writer`` and a fresh core
answers. With resume off, the request goes to the engine, as the HTTP one does.

:class:`CancelAnswer` sits where that exchange writes to its client and turns
the answer into the unary call's ending:

* the 200 JSON body (``{"id", "object": "stream", "status"}``) becomes the
  one ``CancelStreamReply`` and ``grpc-status: 0``;
* the core's own refusal (its typed ending) becomes a status by its code
  (:func:`cancel_status`): ``stream_not_found`` ``NOT_FOUND`` (an unknown id
  and another caller's alike, the same message), ``stream_elsewhere``
  ``FAILED_PRECONDITION``, ``resume_unavailable`` ``UNAVAILABLE``;
* an engine's own answer (resume off) is read as a streaming call reads an
  engine's error answer (:func:`~.call.passthrough_status`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

from tokenwire.middleware.core.errors import ErrorCode, GrpcStatus, WireError, grpc_status_of
from tokenwire.middleware.core.resume import STREAMS_PATH

from tokenwire.v1 import streaming_pb2 as pb

from .call import CoreEnding, passthrough_status
from .framing import GrpcCallError, valid_text
from .metadata import OK, CallStatus, Header

_MAX_ANSWER_BYTES = 64 * 1024


def cancel_target(request: bytes) -> bytes:
    """The HTTP target for a serialized ``CancelStreamRequest``:
    ``/v1/streams/{stream_id}``. The id is percent-encoded, so an id with a
    ``/``, ``?`` or ``#`` names no other path or query: it is then an id the
    resume rules refuse (404, as any unknown id), never another request."""
    message = pb.CancelStreamRequest()
    try:
        message.ParseFromString(request)
    except Exception:  # protobuf's DecodeError; any failure is a malformed message
        raise GrpcCallError(GrpcStatus.INTERNAL, "malformed CancelStreamRequest") from None
    if not message.stream_id:
        raise GrpcCallError(GrpcStatus.INVALID_ARGUMENT, "stream_id is required")
    return (STREAMS_PATH + quote(message.stream_id, safe="")).encode("ascii")


def cancel_status(error: WireError, http_status: int | None) -> CallStatus:
    """The status for the error the cancel's core ended with.

    The core's own refusals name what happened by their code (the HTTP status
    is only that code's rendering), so the code decides: ``stream_elsewhere``
    is ``FAILED_PRECONDITION`` as ``errors.py``'s table says, where the 409 it
    goes out with over HTTP would read ``ALREADY_EXISTS`` (an engine's
    conflict). Only an engine's failure (``upstream_failed``) says more by
    its status, as in a streaming call."""
    by_status = http_status if error.code is ErrorCode.UPSTREAM_FAILED else None
    return CallStatus(grpc_status_of(error.code, by_status), valid_text(error.message), error.code)


@dataclass(frozen=True, slots=True)
class CancelEnding:
    """How the unary call ends: with its one reply message, or a status alone."""

    status: CallStatus
    reply: bytes | None = None
    """The serialized ``CancelStreamReply`` (then ``status`` is OK)."""


class CancelAnswer:
    """The response side of one ``CancelStream`` call (see the module docstring)."""

    def __init__(self) -> None:
        self._status: int | None = None
        self._body = bytearray()

    def on_headers(self, status: int, headers: Sequence[Header]) -> None:
        """The answer's head: only its status counts (a unary call's initial
        metadata goes out with its one message)."""
        self._status = status

    def on_body(self, data: bytes) -> None:
        self._body += data[:_MAX_ANSWER_BYTES - len(self._body)]

    def on_end(self, core: CoreEnding, *, abrupt: bool) -> CancelEnding:
        """The call's ending for ``core``'s ``CloseClient``."""
        error = core.error
        if error is not None:
            return CancelEnding(cancel_status(error, self._status))
        text = self._body.decode("utf-8", "replace")
        if abrupt or self._status is None:
            return CancelEnding(CallStatus(GrpcStatus.UNAVAILABLE, "the answer broke off",
                                           ErrorCode.UPSTREAM_FAILED))
        if self._status != 200:
            return CancelEnding(passthrough_status(text, self._status))
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("id"), str)
                and isinstance(body.get("status"), str)):
            return CancelEnding(CallStatus(GrpcStatus.UNKNOWN, "the cancel's answer was not understood: "
                                           + " ".join(text.split())[:200]))
        reply = pb.CancelStreamReply(stream_id=body["id"], status=body["status"])
        return CancelEnding(OK, reply.SerializeToString())
