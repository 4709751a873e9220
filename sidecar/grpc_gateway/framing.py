"""gRPC over HTTP/2 framing: length-prefixed messages, timeouts, content types,
the text a protobuf string (or ``grpc-message``) can carry.

A gRPC message on the wire is one flag byte (1 = compressed), a 4-byte
big-endian length, then that many bytes (PROTOCOL-HTTP2.md, "Length-Prefixed-
Message"). :class:`MessageReader` takes request body bytes as they arrive and
returns whole messages, refusing a message over the size limit from its
header alone, before buffering it.
"""

from __future__ import annotations

import re
import struct

from tokenwire.middleware.core.errors import GrpcStatus

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""gRPC's own default receive limit."""

_HEADER = struct.Struct(">BI")
_TIMEOUT_UNITS_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` as UTF-8 can carry it, for a protobuf string field (which
    refuses anything else) or ``grpc-message``: two surrogate code points
    that make a pair become their character, a lone surrogate becomes U+FFFD.

    A ``str`` holds a surrogate only from a JSON ``\\udXXX`` escape with no
    partner in the same string (a pair split across chunks, or just a broken
    one); everything else passes through untouched, checked at ASCII speed.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class GrpcCallError(Exception):
    """A call that ends with ``status`` before anything is forwarded."""

    def __init__(self, status: GrpcStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def encode_message(payload: bytes) -> bytes:
    """One uncompressed length-prefixed message."""
    return _HEADER.pack(0, len(payload)) + payload


class MessageReader:
    """Splits a request body into messages; bounded by ``max_message_bytes``."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._max = max_message_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The messages completed by ``data``; ``GrpcCallError`` on a bad one."""
        buffer = self._buffer
        buffer += data
        messages: list[bytes] = []
        while len(buffer) >= _HEADER.size:
            flag, length = _HEADER.unpack_from(buffer)
            if flag == 1:
                # No grpc-encoding is accepted but identity: the spec's answer to
                # a compression the server does not support.
                raise GrpcCallError(GrpcStatus.UNIMPLEMENTED,
                                    "compressed messages are not supported (grpc-encoding: identity)")
            if flag != 0:
                raise GrpcCallError(GrpcStatus.INTERNAL, f"invalid message flag {flag}")
            if length > self._max:
                raise GrpcCallError(GrpcStatus.RESOURCE_EXHAUSTED,
                                    f"message of {length} bytes is over the limit of {self._max}")
            end = _HEADER.size + length
            if len(buffer) < end:
                break
            messages.append(bytes(buffer[_HEADER.size:end]))
            del buffer[:end]
        return messages

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def close(self) -> None:
        """The request body ended; ``GrpcCallError`` if it ended inside a message."""
        if self._buffer:
            raise GrpcCallError(GrpcStatus.INTERNAL, "the request ended inside a message")


def parse_timeout(value: bytes) -> float:
    """``grpc-timeout`` (``TimeoutValue TimeoutUnit``: at most 8 digits, one of
    H M S m u n) in seconds; ``GrpcCallError`` (INTERNAL, as gRPC servers
    answer a malformed header) if it is not one."""
    digits, unit = value[:-1], value[-1:]
    if not digits or len(digits) > 8 or not digits.isdigit() or unit not in _TIMEOUT_UNITS_S:
        raise GrpcCallError(GrpcStatus.INTERNAL, f"malformed grpc-timeout {value[:20]!r}")
    return int(digits) * _TIMEOUT_UNITS_S[unit]


def is_grpc_content_type(value: bytes | None) -> bool:
    """True for ``application/grpc`` and ``application/grpc+proto`` (with
    parameters); ``+json`` and other codecs are not served."""
    if value is None:
        return False
    base = value.split(b";", 1)[0].strip().lower()
    return base in (b"application/grpc", b"application/grpc+proto")
