"""Request framing checks that h11 leaves to the edge: the request line and chunked bodies.

h11 is a correct but patient parser: given a request line without a version
(HTTP/0.9) or a chunk size no body could have, it waits for more bytes until a
timeout, and it lets through what RFC 9112 forbids but tolerates (bare CR or
NUL in a chunk extension, any ``HTTP/d.d`` version). An edge proxy answers
those at once, as nginx does: the client learns what was wrong, and nothing
ambiguous goes on to a parser behind us that may read it differently.

Both checks look at the raw bytes beside h11, which still does the parsing;
they only ever refuse. Data in a chunked body is skipped, not scanned: only the
size lines and trailers are read, so a large body costs nothing here.
"""

from __future__ import annotations

import enum
import re
from typing import Final

from .request_rules import Problem

_VERSION: Final = re.compile(rb"HTTP/([0-9])\.([0-9])")
# RFC 9112 section 7.1.1: chunk-ext = *( BWS ";" BWS name [ BWS "=" BWS ( token / quoted-string ) ] )
_TOKEN: Final = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_QUOTED: Final = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_EXT: Final = re.compile(rb"(?:[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb"|"
                               + _QUOTED + rb"))?)*[ \t]*")
_HEX: Final = re.compile(rb"[0-9A-Fa-f]+")
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TRAILER_LINE: Final = re.compile(_TOKEN + rb":[\t \x21-\x7e\x80-\xff]*")
# A chunk size needing more than 64 bits is no size at all (nginx: "invalid chunked body").
_MAX_SIZE_DIGITS: Final = 16
# The longest chunk-size line or trailer line accepted (extensions included).
_MAX_LINE_BYTES: Final = 4096


def request_line_end(received: bytes | bytearray) -> int:
    """Where the request line at the start of ``received`` ends (its LF), or -1
    while it is incomplete."""
    start = 0
    # RFC 9112 section 2.2: empty lines before the request line are ignored.
    while received.startswith(b"\r\n", start):
        start += 2
    return received.find(b"\n", start)


def request_line_problem(received: bytes | bytearray) -> Problem | None:
    """What makes the request line at the start of ``received`` unservable, once
    that line is complete; None if it is fine or not complete yet.

    A line with no version is HTTP/0.9 (400); a version other than 1.0 or 1.1
    is 505, as nginx answers ``HTTP/2.0`` or ``HTTP/9.9`` over HTTP/1 framing.
    """
    end = request_line_end(received)
    if end == -1:
        return None
    start = 0
    while received.startswith(b"\r\n", start):
        start += 2
    line = bytes(received[start:end]).removesuffix(b"\r")
    parts = line.split(b" ")
    if len(parts) == 2 and not parts[1].startswith(b"HTTP/"):
        return 400, "an HTTP/0.9 request line (no HTTP version); HTTP/1.0 or 1.1 is required"
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return 400, "a malformed request line (method, target and version, one space apart)"
    version = _VERSION.fullmatch(parts[2])
    if version is None:
        return 400, "a malformed HTTP version in the request line"
    if version.group(1) != b"1" or version.group(2) not in (b"0", b"1"):
        return 505, "only HTTP/1.0 and HTTP/1.1 are supported"
    return None


def head_length(received: bytes | bytearray) -> int:
    """Where the body starts in ``received``, which begins with a whole request
    head (CRLF line ends; h11 and ``_framing_problem`` have checked it)."""
    start = 0
    while received.startswith(b"\r\n", start):
        start += 2
    end = received.find(b"\r\n\r\n", start)
    return len(received) if end == -1 else end + 4


class _State(enum.Enum):
    SIZE = "size"
    DATA = "data"
    DATA_END = "data_end"
    TRAILER = "trailer"
    DONE = "done"


class ChunkedScanner:
    """Follows a chunked request body beside h11 and names the first framing
    fault: a malformed size, an impossible one, a size over ``max_body_bytes``
    (413), an invalid extension (bare CR, NUL, anything RFC 9112 does not
    allow), a bare LF, chunk data not followed by CRLF, a malformed trailer.
    After the last chunk's trailers it ignores what follows (the next request).
    """

    __slots__ = ("_line", "_max_body_bytes", "_remaining", "_state", "_total")

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body_bytes = max_body_bytes
        self._state = _State.SIZE
        self._line = bytearray()
        self._remaining = 0
        self._total = 0

    @property
    def done(self) -> bool:
        """The body's framing ended (last chunk and trailers read)."""
        return self._state is _State.DONE

    def feed(self, data: bytes | bytearray | memoryview) -> Problem | None:
        """Follow ``data``; the first fault found, else None."""
        view = memoryview(data)
        at, size = 0, len(view)
        while at < size:
            state = self._state
            if state is _State.DONE:
                return None
            if state is _State.DATA:
                taken = min(self._remaining, size - at)
                at += taken
                self._remaining -= taken
                if not self._remaining:
                    self._state = _State.DATA_END
                continue
            if state is _State.DATA_END:
                # Exactly CRLF, which may arrive a byte at a time.
                piece = bytes(view[at:at + 2 - len(self._line)])
                at += len(piece)
                self._line += piece
                if not b"\r\n".startswith(bytes(self._line)):
                    return 400, "chunk data not followed by CRLF (a chunk of another length than its size)"
                if len(self._line) == 2:
                    self._line.clear()
                    self._state = _State.SIZE
                continue
            end = bytes(view[at:at + _MAX_LINE_BYTES + 1]).find(b"\n")
            if end == -1:
                self._line += view[at:]
                at = size
                if len(self._line) > _MAX_LINE_BYTES:
                    return 400, "a chunk-size or trailer line that never ends"
                continue
            self._line += view[at:at + end + 1]
            at += end + 1
            if len(self._line) > _MAX_LINE_BYTES + 1:
                return 400, "a chunk-size or trailer line that never ends"
            line = bytes(self._line)
            self._line.clear()
            if not line.endswith(b"\r\n"):
                return 400, "a bare LF in the chunked body (lines end with CRLF)"
            problem = self._size_line(line[:-2]) if state is _State.SIZE else self._trailer_line(line[:-2])
            if problem is not None:
                return problem
        return None

    def _size_line(self, line: bytes) -> Problem | None:
        digits = _HEX.match(line)
        if digits is None:
            return 400, "a chunk size that is not a hexadecimal number"
        rest = line[digits.end():]
        if rest.strip(b" \t"):  # whitespace alone before the CRLF is tolerated, as nginx does
            extension = rest.lstrip(b" \t").startswith(b";")
            where = "a chunk extension" if extension else "a chunk-size line"
            if _CONTROL.search(rest) is not None:
                return 400, f"a control character (CR, NUL or the like) in {where}"
            if not extension:
                return 400, "a chunk size that is not a hexadecimal number"
            if _CHUNK_EXT.fullmatch(rest) is None:
                return 400, "an invalid chunk extension (RFC 9112: ;name or ;name=value)"
        significant = digits.group().lstrip(b"0")
        if len(significant) > _MAX_SIZE_DIGITS:
            return 400, "an impossible chunk size (over 64 bits)"
        chunk_bytes = int(significant or b"0", 16)
        self._total += chunk_bytes
        if self._total > self._max_body_bytes:
            return 413, f"request body over {self._max_body_bytes} bytes"
        if chunk_bytes:
            self._remaining = chunk_bytes
            self._state = _State.DATA
        else:
            self._state = _State.TRAILER
        return None

    def _trailer_line(self, line: bytes) -> Problem | None:
        if not line:
            self._state = _State.DONE
            return None
        if _TRAILER_LINE.fullmatch(line) is None:
            return 400, "a malformed trailer field in the chunked body"
        return None
