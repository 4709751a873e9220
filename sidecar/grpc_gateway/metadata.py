"""gRPC statuses and metadata as HTTP/2 header lists.

A call ends with trailers: ``grpc-status``, ``grpc-message`` (percent-encoded,
PROTOCOL-HTTP2.md) and, for an error, tokenwire's own code in
``tokenwire-error-code`` and, where it has one, ``tokenwire-error-number``
(``E7302``): the same code the SSE error event carries. A call refused before
any message gets them as a *trailers-only* response: one HEADERS frame with
``:status`` 200 that ends the stream. Which status an error gets is decided in
``middleware/core/errors.py`` (:func:`~tokenwire.middleware.core.errors.grpc_status_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.middleware.core.errors import ErrorCode, GrpcStatus

from .framing import valid_text

Header = tuple[bytes, bytes]

GRPC_CONTENT_TYPE = b"application/grpc"
ERROR_CODE_KEY = b"tokenwire-error-code"
ERROR_NUMBER_KEY = b"tokenwire-error-number"
_MESSAGE_MAX_CHARS = 1024


def percent_encode(text: str) -> bytes:
    """``grpc-message`` encoding: UTF-8 (a lone surrogate as U+FFFD), then every
    byte outside 0x20..0x7E and ``%`` as ``%XX``."""
    out = bytearray()
    for byte in valid_text(text).encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def percent_decode(value: bytes) -> str:
    """The inverse of :func:`percent_encode` (lenient, as clients are)."""
    out = bytearray()
    i = 0
    while i < len(value):
        if value[i] == 0x25 and i + 2 < len(value) and _is_hex(value[i + 1:i + 3]):
            out.append(int(value[i + 1:i + 3], 16))
            i += 3
        else:
            out.append(value[i])
            i += 1
    return out.decode("utf-8", "replace")


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)


@dataclass(frozen=True, slots=True)
class CallStatus:
    """How a call ends: its gRPC status, message and tokenwire code."""

    status: GrpcStatus
    message: str = ""
    code: ErrorCode | str | None = None
    """tokenwire's code (an :class:`ErrorCode`, or the name a forwarded error carried)."""
    number: str | None = None

    def __post_init__(self) -> None:
        if self.status is GrpcStatus.OK and self.code is not None:
            raise ValueError("an OK status carries no error code")

    def trailers(self) -> list[Header]:
        """The trailing metadata that ends the call."""
        headers = [(b"grpc-status", b"%d" % self.status)]
        if self.message:
            headers.append((b"grpc-message", percent_encode(self.message[:_MESSAGE_MAX_CHARS])))
        if self.code is not None:
            code = self.code.value if isinstance(self.code, ErrorCode) else self.code
            headers.append((ERROR_CODE_KEY, code.encode("ascii", "replace")))
            number = self.number
            if number is None and isinstance(self.code, ErrorCode):
                number = self.code.number
            if number is not None:
                headers.append((ERROR_NUMBER_KEY, number.encode("ascii", "replace")))
        return headers

    def trailers_only(self, extra: list[Header] | None = None) -> list[Header]:
        """A whole response in one HEADERS frame (``:status`` is the driver's, 200)."""
        return [(b"content-type", GRPC_CONTENT_TYPE), *(extra or []), *self.trailers()]


OK = CallStatus(GrpcStatus.OK)
