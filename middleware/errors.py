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
        """The OpenAI-shaped error object: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code.value}}

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


def upstream_error_payload(payload: dict[str, Any]) -> str:
    """An upstream's own error event, mapped to the common in-band shape.

    Engines disagree: OpenAI and vLLM send ``{"error": {"message", "type",
    "code"}}``, TGI ``{"error": "text", "error_type": "..."}``, others a bare
    string. The message survives; ``code`` is the upstream's if it gave a
    string one, else ``upstream_failed``.
    """
    raw = payload.get("error")
    if isinstance(raw, dict):
        message = str(raw.get("message") or json.dumps(raw, ensure_ascii=False))
        error_type = raw.get("type") if isinstance(raw.get("type"), str) else "upstream_error"
        code = raw.get("code") if isinstance(raw.get("code"), str) else ErrorCode.UPSTREAM_FAILED.value
    else:
        message = str(raw)
        error_type = payload.get("error_type") if isinstance(payload.get("error_type"), str) \
            else "upstream_error"
        code = ErrorCode.UPSTREAM_FAILED.value
    error = {"message": message, "type": error_type, "code": code}
    return json.dumps({"error": error}, separators=(",", ":"), ensure_ascii=False)


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


class SSEProtocolError(UpstreamError):
    """The upstream's event stream is malformed or exceeds the size limits."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.INVALID_STREAM, http_status=502)


class LocalProtocolError(Exception):
    """A driver fed the wire core an input its current state does not allow.

    This is a programming error in the driver, not a wire condition: like
    h11's ``LocalProtocolError``, it is raised, never sent.
    """
