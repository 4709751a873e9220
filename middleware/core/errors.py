"""Typed errors, by whose fault, and their one conversion to the wire.

Every failure tokenwire reports to a client is a :class:`WireError`. Its
subclass says whose fault it is (the client's, the upstream's, ours); the
instance carries a stable ``code`` and an HTTP status. This module is the one
place where an error becomes bytes: a JSON error body when the status line has
not been sent yet, or an in-band SSE error event after it has.

The in-band shape is OpenAI's, ``{"error": {"message", "type", "code"}}``, which
the OpenAI SDKs raise as ``APIError`` when it arrives inside a stream.
"""

from __future__ import annotations

import json
from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Final

from .chunks import dumps, error_payload, message_of, status_of


class ErrorCode(StrEnum):
    """Stable error codes; each has a stable number in :data:`ERROR_TABLE`."""

    STREAM_NOT_FOUND = "stream_not_found"
    CANCELLED = "cancelled"
    BACKPRESSURE_EXCEEDED = "backpressure_exceeded"
    SEND_TIMEOUT = "send_timeout"
    INVALID_STREAM = "invalid_stream"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_FAILED = "upstream_failed"
    SHUTDOWN = "shutdown"
    BAD_REQUEST = "bad_request"
    INVALID_LAST_EVENT_ID = "invalid_last_event_id"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    RESUME_UNAVAILABLE = "resume_unavailable"
    INTERNAL = "internal_error"
    UNAUTHORIZED = "unauthorized"
    STREAM_ELSEWHERE = "stream_elsewhere"
    REPLAY_GAP = "replay_gap"
    WRITER_GONE = "writer_gone"

    @property
    def number(self) -> str:
        """The stable number (``E7300``...), as listed in :data:`ERROR_TABLE`."""
        return _NUMBERS[self]

    @property
    def label(self) -> str:
        """Number and name together, ``E7302 backpressure_exceeded``: what logs and trailers show."""
        return f"{_NUMBERS[self]} {self.value}"


ERROR_TABLE: Final[tuple[tuple[str, ErrorCode, str], ...]] = (
    # E7300-E7304 are the ThemisDB streaming codes, with the same meanings.
    ("E7300", ErrorCode.STREAM_NOT_FOUND, "no such stream (a resume id or a cancel of an unknown request)"),
    ("E7301", ErrorCode.CANCELLED, "the stream was cancelled: its client left, or an operator ended it"),
    ("E7302", ErrorCode.BACKPRESSURE_EXCEEDED,
     "the client read too slowly: what waited for it went past max_pending_bytes"),
    ("E7303", ErrorCode.SEND_TIMEOUT, "the client took nothing for write_deadline_s"),
    # ThemisDB's "invalid token sequence": here, an upstream answer that is not a
    # valid sequence of events (malformed SSE, a line or event over the size
    # limits, a compressed or non-event-stream body where a stream was due).
    ("E7304", ErrorCode.INVALID_STREAM, "invalid token sequence: the upstream's event stream is malformed"),
    # tokenwire's own, numbered on from the scheme.
    ("E7305", ErrorCode.UPSTREAM_UNAVAILABLE, "no upstream could be connected to"),
    ("E7306", ErrorCode.UPSTREAM_TIMEOUT, "the upstream did not answer (headers, or bytes) in time"),
    ("E7307", ErrorCode.UPSTREAM_FAILED,
     "the upstream failed: an error event or status, a broken or early-ended stream"),
    ("E7308", ErrorCode.SHUTDOWN, "the server is shutting down"),
    ("E7309", ErrorCode.BAD_REQUEST, "the request is malformed or over a limit"),
    ("E7310", ErrorCode.INVALID_LAST_EVENT_ID, "a Last-Event-ID that names no stream of this server"),
    ("E7311", ErrorCode.IDEMPOTENCY_KEY_REUSED, "an Idempotency-Key reused with a different request"),
    ("E7312", ErrorCode.RESUME_UNAVAILABLE, "the replay store is unreachable or lost the stream"),
    ("E7313", ErrorCode.INTERNAL, "a bug in tokenwire, or an engine's own failure to generate"),
    ("E7314", ErrorCode.UNAUTHORIZED, "the admin API's bearer token was missing or wrong"),
    ("E7315", ErrorCode.STREAM_ELSEWHERE,
     "a cancel of a live stream that its writer, alive in another process sharing the store, "
     "did not stop within 2 s"),
    ("E7316", ErrorCode.REPLAY_GAP,
     "the replay store lost events of the stream (an outage): a resume stops where they are missing"),
    ("E7317", ErrorCode.WRITER_GONE,
     "the process writing the stream is gone (its lease lapsed): a resume gets what it stored, then this"),
)
"""Every error code: its stable number, its name, and what it means. The one
table: the README lists it, logs and records carry ``number`` and ``code``,
error objects carry both as ``"tokenwire": {"code", "number"}``."""

_NUMBERS: Final = {code: number for number, code, _ in ERROR_TABLE}


def tokenwire_fields(code: ErrorCode) -> dict[str, str]:
    """``{"code": ..., "number": ...}``: what rides as ``"tokenwire"`` in an error object."""
    return {"code": code.value, "number": code.number}


def error_object(message: str, error_type: str, code: ErrorCode, **fields: object) -> dict[str, object]:
    """An OpenAI-shaped error body, ``{"error": {"message", "type", "code", ..., "tokenwire"}}``,
    for answers that are not a raised :class:`WireError` (the admin API, the engine)."""
    return {"error": {"message": message, "type": error_type, **fields, "code": code.value,
                      "tokenwire": tokenwire_fields(code)}}


class WireError(Exception):
    """Base of every error tokenwire puts on the wire.

    ``http_status`` is used when the error happens before the response status
    line was sent; afterwards the same error travels in-band.
    """

    error_type: ClassVar[str] = "server_error"
    default_status: ClassVar[int] = 500

    def __init__(
        self,
        message: str,
        code: ErrorCode,
        *,
        http_status: int | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.http_status = http_status if http_status is not None else self.default_status
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict[str, object]:
        """The OpenAI-shaped error object, ``{"error": {"message", "type", "code"}}``,
        with tokenwire's own code and its E73xx number beside
        as ``"tokenwire"``: the same place as on a forwarded engine error."""
        return error_payload(self.message, self.error_type, self.code.value,
                             tokenwire=self.tokenwire_fields())

    def tokenwire_fields(self) -> dict[str, str]:
        """``{"code": ..., "number": ...}``: tokenwire's stable code of this error."""
        return tokenwire_fields(self.code)

    def body(self) -> bytes:
        """JSON body for a response whose status line is still ours to choose."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    def sse_data(self) -> str:
        """The ``data:`` payload of the in-band error event (valid UTF-8 even when an
        engine's message holds a lone surrogate: it stays escaped)."""
        return dumps(self.to_json())

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        """Headers for the error response (content type, ``Retry-After``)."""
        headers = [(b"content-type", b"application/json")]
        if self.retry_after_s is not None:
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
        return headers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code.value})"


class ClientError(WireError):
    """The client sent something wrong, or went away, or reads too slowly."""

    error_type = "invalid_request_error"
    default_status = 400


class UpstreamError(WireError):
    """The engine behind us failed: refused, timed out, broke the stream."""

    error_type = "upstream_error"
    default_status = 502


class LocalError(WireError):
    """Our own fault, or our own decision (shutdown, an operator's cancel)."""

    error_type = "server_error"
    default_status = 500


def upstream_timeout(message: str) -> UpstreamError:
    """The upstream took too long (headers, silence, the whole stream, a read): 504."""
    return UpstreamError(message, ErrorCode.UPSTREAM_TIMEOUT, http_status=504)


def shutting_down() -> LocalError:
    """The process is going away (a drain that ran out, a handed-off stream's end): 503."""
    return LocalError("the server is shutting down", ErrorCode.SHUTDOWN, http_status=503, retry_after_s=1)


class SSEProtocolError(UpstreamError):
    """The upstream's event stream is malformed or exceeds the size limits."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.INVALID_STREAM, http_status=502)


class UpstreamErrorEvent(UpstreamError):
    """An upstream's own error event (``{"error": ...}``), forwarded as it came.

    Its error object keeps every field the engine gave (``code``, ``param``,
    ``type``...), so ``e.code`` in a client means what the engine meant;
    tokenwire's own code rides beside them as ``"tokenwire": {"code": ...}``.
    Engines that send a bare string (TGI's ``{"error": "text", "error_type"}``,
    llama.cpp's ``error:`` field) get the common object shape, which the
    OpenAI SDKs need in order to raise at all.

    As the first event it becomes the response itself, with the status the
    error carries (400 for a client error); it is never retried (the engine
    refused this request, another attempt gets the same answer), and
    ``x-should-retry: false`` tells the OpenAI SDKs not to retry it either:
    straight from the engine they would have raised without retrying.
    """

    def __init__(self, payload: dict[str, Any]) -> None:
        error = payload.get("error")
        super().__init__(message_of(error), ErrorCode.UPSTREAM_FAILED,
                         http_status=status_of(payload, error))
        self.payload = payload

    def to_json(self) -> dict[str, object]:
        error = self.payload.get("error")
        ours = self.tokenwire_fields()
        if isinstance(error, dict):
            forwarded: dict[str, object] = dict(self.payload)
            forwarded["error"] = {**error, "tokenwire": error.get("tokenwire", ours)}
            return forwarded
        kind = self.payload.get("error_type")
        return error_payload(self.message, kind if isinstance(kind, str) else "upstream_error",
                             self.code.value, tokenwire=ours)

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().response_headers(), NO_CLIENT_RETRY]


NO_CLIENT_RETRY: Final = (b"x-should-retry", b"false")
"""The header the OpenAI SDKs (Python and Node) obey over their own retry rule:
set where another attempt from the client would only multiply the load."""


class LocalProtocolError(Exception):
    """A driver fed the wire core an input its current state does not allow.

    This is a programming error in the driver, not a wire condition: like
    h11's ``LocalProtocolError``, it is raised, never sent.
    """


class GrpcStatus(IntEnum):
    """gRPC status codes (grpc/doc/statuscodes.md), for the gRPC transcoder."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# Mid-stream (in-band) errors: the code decides; the HTTP status was never sent.
_GRPC_STATUS_OF_CODE: Final = {
    ErrorCode.STREAM_NOT_FOUND: GrpcStatus.NOT_FOUND,
    ErrorCode.CANCELLED: GrpcStatus.CANCELLED,
    ErrorCode.BACKPRESSURE_EXCEEDED: GrpcStatus.RESOURCE_EXHAUSTED,
    ErrorCode.SEND_TIMEOUT: GrpcStatus.RESOURCE_EXHAUSTED,
    ErrorCode.INVALID_STREAM: GrpcStatus.UNAVAILABLE,
    ErrorCode.UPSTREAM_UNAVAILABLE: GrpcStatus.UNAVAILABLE,
    ErrorCode.UPSTREAM_TIMEOUT: GrpcStatus.UNAVAILABLE,
    ErrorCode.UPSTREAM_FAILED: GrpcStatus.UNAVAILABLE,
    ErrorCode.SHUTDOWN: GrpcStatus.UNAVAILABLE,
    ErrorCode.BAD_REQUEST: GrpcStatus.INVALID_ARGUMENT,
    ErrorCode.INVALID_LAST_EVENT_ID: GrpcStatus.INVALID_ARGUMENT,
    ErrorCode.IDEMPOTENCY_KEY_REUSED: GrpcStatus.FAILED_PRECONDITION,
    ErrorCode.RESUME_UNAVAILABLE: GrpcStatus.UNAVAILABLE,
    ErrorCode.REPLAY_GAP: GrpcStatus.DATA_LOSS,
    ErrorCode.WRITER_GONE: GrpcStatus.UNAVAILABLE,
    ErrorCode.INTERNAL: GrpcStatus.INTERNAL,
    ErrorCode.UNAUTHORIZED: GrpcStatus.UNAUTHENTICATED,
    ErrorCode.STREAM_ELSEWHERE: GrpcStatus.FAILED_PRECONDITION,
}

# Before the first message an error has its HTTP status, which says more than
# the code: an engine's 400 (code upstream_failed) is the caller's mistake.
_GRPC_STATUS_OF_HTTP: Final = {
    400: GrpcStatus.INVALID_ARGUMENT,
    401: GrpcStatus.UNAUTHENTICATED,
    403: GrpcStatus.PERMISSION_DENIED,
    404: GrpcStatus.NOT_FOUND,
    408: GrpcStatus.DEADLINE_EXCEEDED,
    409: GrpcStatus.ALREADY_EXISTS,
    413: GrpcStatus.RESOURCE_EXHAUSTED,
    422: GrpcStatus.INVALID_ARGUMENT,
    429: GrpcStatus.RESOURCE_EXHAUSTED,
    499: GrpcStatus.CANCELLED,
    500: GrpcStatus.INTERNAL,
    501: GrpcStatus.UNIMPLEMENTED,
}


def grpc_status_of(code: ErrorCode | None, http_status: int | None = None) -> GrpcStatus:
    """The gRPC status an error ends a call with.

    ``http_status`` is the status the error had as an HTTP answer, when it
    came before the first message (the engine's 400 → ``INVALID_ARGUMENT``);
    after it, only ``code`` counts (``backpressure_exceeded`` →
    ``RESOURCE_EXHAUSTED``). Never ``OK``: an error is never a finished answer.
    """
    if http_status is not None:
        by_http = _GRPC_STATUS_OF_HTTP.get(http_status)
        if by_http is not None:
            return by_http
        if http_status >= 500:
            return GrpcStatus.UNAVAILABLE
        if code is None and 400 <= http_status < 500:
            return GrpcStatus.INVALID_ARGUMENT
    if code is None:
        return GrpcStatus.UNKNOWN
    return _GRPC_STATUS_OF_CODE.get(code, GrpcStatus.UNKNOWN)
