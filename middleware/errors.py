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
from enum import StrEnum
from typing import Any, ClassVar

from .chunks import error_payload, message_of, status_of


class ErrorCode(StrEnum):
    """Stable error codes; the ``E73xx`` numbers follow the ThemisDB scheme."""

    STREAM_NOT_FOUND = "stream_not_found"  # E7300
    CANCELLED = "cancelled"  # E7301
    BACKPRESSURE_EXCEEDED = "backpressure_exceeded"  # E7302
    SEND_TIMEOUT = "send_timeout"  # E7303
    INVALID_STREAM = "invalid_stream"  # E7304
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_FAILED = "upstream_failed"
    SHUTDOWN = "shutdown"
    BAD_REQUEST = "bad_request"
    INVALID_LAST_EVENT_ID = "invalid_last_event_id"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    RESUME_UNAVAILABLE = "resume_unavailable"
    INTERNAL = "internal_error"

    @property
    def number(self) -> str | None:
        """The numeric alias (``E7300``...) where the scheme defines one."""
        return _NUMBERS.get(self)


_NUMBERS = {
    ErrorCode.STREAM_NOT_FOUND: "E7300",
    ErrorCode.CANCELLED: "E7301",
    ErrorCode.BACKPRESSURE_EXCEEDED: "E7302",
    ErrorCode.SEND_TIMEOUT: "E7303",
    ErrorCode.INVALID_STREAM: "E7304",
}


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
        with tokenwire's own code (and its E73xx number, where it has one) beside
        as ``"tokenwire"``: the same place as on a forwarded engine error."""
        return error_payload(self.message, self.error_type, self.code.value,
                             tokenwire=self.tokenwire_fields())

    def tokenwire_fields(self) -> dict[str, str]:
        """``{"code": ..., "number": ...}``: tokenwire's stable code of this error."""
        number = self.code.number
        return {"code": self.code.value} if number is None else {"code": self.code.value,
                                                                  "number": number}

    def body(self) -> bytes:
        """JSON body for a response whose status line is still ours to choose."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    def sse_data(self) -> str:
        """The ``data:`` payload of the in-band error event."""
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False)

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


NO_CLIENT_RETRY = (b"x-should-retry", b"false")
"""The header the OpenAI SDKs (Python and Node) obey over their own retry rule:
set where another attempt from the client would only multiply the load."""


class LocalProtocolError(Exception):
    """A driver fed the wire core an input its current state does not allow.

    This is a programming error in the driver, not a wire condition: like
    h11's ``LocalProtocolError``, it is raised, never sent.
    """
