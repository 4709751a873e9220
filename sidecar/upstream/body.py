"""The upstream's chunked response body, read without an object per chunk.

Theory of operation
-------------------
The sidecar's own client reads the upstream's response head
(:mod:`~tokenwire.sidecar.upstream.head`); the body of a chunked response is
then read here. Through h11 and httpcore every chunk was a ``Data`` event
yielded through three async-generator layers: a state-machine pass and four
Python objects per token, even when one socket read held many chunks.
:class:`ChunkedBodyReader` takes a whole read at once and returns the body
bytes of each chunk it holds (a list: the wire core still sees one input per
chunk, as the upstream framed it, so what it writes does not depend on how
the reads were cut; the sidecar then writes what they give in one go).

It is sans-IO: ``feed(data)`` returns the body pieces, ``done`` says whether the
last chunk and the trailer section were read. ``framed_chunk_start(data)``
says where the data starts in a read that is exactly one whole chunk framed
as the sidecar would frame it for its own client (a size line of lowercase hex
digits, no leading zero, no extension): such a read can be forwarded to an
HTTP/1.1 client as it came, framing and all (a :class:`ChunkDelivery` offers
that), instead of slicing the data out and joining a new frame around it. Bytes after the end are not
consumed; ``leftover`` holds them, and a response followed by anything is a
reason to close its connection rather than pool it (the next response on it
would start with those bytes).

The grammar is RFC 9112 section 7.1, as strict as h11: the size is hex digits,
chunk extensions are skipped, the data must be followed by CRLF, trailer fields
are read and dropped (they are not forwarded). Lines are bounded so a hostile
upstream cannot make the buffer grow without limit.
"""

from __future__ import annotations

import re
from typing import Final

from .errors import RemoteProtocolFault

# Longest chunk-size line (size, extensions, CRLF) and trailer section accepted.
_MAX_SIZE_LINE_BYTES: Final = 4096
_MAX_TRAILER_BYTES: Final = 64 * 1024
# A chunk-size line: hex digits, then optional extensions (";" onwards, no CR/LF/NUL).
_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"
# The reader's states (module constants: mypyc compiles them to literals).
_SIZE: Final = 0
_DATA: Final = 1
_DATA_END: Final = 2
_TRAILER: Final = 3
_DONE: Final = 4
_SIZE_LINE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n\x00]*)?\Z")


def _size_line(data: bytes, pos: int, end: int, canonical: bool = False) -> tuple[int, int]:
    """A plain chunk-size line at ``pos``: 1 to 16 hex digits and CRLF, nothing
    else. Returns the size and where the chunk's data starts, or (-1, 0) for
    anything else (an extension, a line not all here yet, a malformed one),
    which the reader's general path then takes. ``canonical``: only the line
    ``b"%x\r\n" % size`` writes (lowercase digits, the first not ``0``).

    Byte by byte, not ``find``/``strip``/``int(..., 16)``: compiled, indexing
    ``bytes`` is a C array read, while each of those is a generic method call
    that parses its arguments (three a chunk; docs/perf/sidecar-http1.md)."""
    if canonical and pos < end and data[pos] == 48:
        return -1, 0
    size = 0
    index = pos
    stop = min(end, pos + 16)
    while index < stop:
        byte = data[index]
        if 48 <= byte <= 57:
            size = size * 16 + byte - 48
        elif 97 <= byte <= 102:
            size = size * 16 + byte - 87
        elif 65 <= byte <= 70 and not canonical:
            size = size * 16 + byte - 55
        else:
            break
        index += 1
    if index == pos or index + 1 >= end or data[index] != 13 or data[index + 1] != 10:
        return -1, 0
    return size, index + 2


class ChunkedBodyReader:
    """Decodes one ``Transfer-Encoding: chunked`` body, a read at a time."""

    __slots__ = ("_buffer", "_remaining", "_state", "_trailer_bytes", "done", "leftover")

    def __init__(self) -> None:
        self._buffer = b""
        self._remaining = 0
        self._state = _SIZE
        self._trailer_bytes = 0
        self.leftover = b""
        """Bytes that came after the body's end (never part of the body)."""
        self.done = False
        """The last chunk and the trailer section have been read (an attribute,
        not a property: it is read after every socket read)."""

    def framed_chunk_start(self, data: bytes) -> int:
        """Where the chunk's data starts if ``data`` is, at a chunk boundary,
        exactly one whole chunk with a canonical size line (see
        :func:`_size_line`, ``canonical``); else 0. Changes nothing: the read is
        one chunk, after which the reader is where it was (what ``feed`` would
        have returned is ``[data[start:-2]]``)."""
        if self._state != _SIZE or self._buffer:
            return 0
        end = len(data)
        size, start = _size_line(data, 0, end, canonical=True)
        if size > 0 and end == start + size + 2 and data[end - 2] == 13 and data[end - 1] == 10:
            return start
        return 0

    def feed(self, data: bytes) -> list[bytes]:
        """The body bytes in ``data``, one piece per chunk (or part of one);
        raises :class:`RemoteProtocolFault` on a malformed body."""
        if self._state == _DONE:
            self.leftover += data
            return []
        if self._state == _SIZE and not self._buffer:
            # The usual read of a streaming upstream: exactly one whole chunk.
            end = len(data)
            size, start = _size_line(data, 0, end)
            if size > 0 and end == start + size + 2 and data[end - 2] == 13 and data[end - 1] == 10:
                return [data[start:end - 2]]
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        out: list[bytes] = []
        pos = 0
        end = len(buffer)
        state = self._state
        while pos < end:
            if state == _DATA:
                take = min(self._remaining, end - pos)
                out.append(buffer[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _DATA_END
            elif state == _SIZE:
                size, start = _size_line(buffer, pos, end)
                if size > 0:
                    pos = start
                    self._remaining = size
                    state = _DATA
                    continue
                line_end = buffer.find(b"\r\n", pos, pos + _MAX_SIZE_LINE_BYTES)
                if line_end == -1:
                    if end - pos >= _MAX_SIZE_LINE_BYTES or buffer.find(b"\n", pos) != -1:
                        raise RemoteProtocolFault("malformed chunk-size line from the upstream")
                    break
                digits = buffer[pos:line_end]
                if not 0 < len(digits) <= 16 or digits.strip(_HEX_DIGITS):
                    # Not bare hex digits: extensions, or malformed.
                    match = _SIZE_LINE.match(buffer, pos, line_end)
                    if match is None:
                        raise RemoteProtocolFault("malformed chunk-size line from the upstream")
                    digits = match.group(1)
                size = int(digits, 16)
                pos = line_end + 2
                if size:
                    self._remaining = size
                    state = _DATA
                else:
                    state = _TRAILER
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if buffer[pos:pos + 2] != b"\r\n":
                    raise RemoteProtocolFault("chunk data not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state == _TRAILER:
                line_end = buffer.find(b"\r\n", pos)
                if line_end == -1:
                    if self._trailer_bytes + end - pos > _MAX_TRAILER_BYTES:
                        raise RemoteProtocolFault("trailer section too large")
                    break
                self._trailer_bytes += line_end + 2 - pos
                if self._trailer_bytes > _MAX_TRAILER_BYTES:
                    raise RemoteProtocolFault("trailer section too large")
                if line_end == pos:
                    pos += 2
                    state = _DONE
                    self.done = True
                    self.leftover = buffer[pos:]
                    pos = end
                    break
                if buffer.find(b"\n", pos, line_end) != -1 or buffer.find(b":", pos, line_end) == -1:
                    raise RemoteProtocolFault("malformed trailer field from the upstream")
                pos = line_end + 2
        self._state = state
        if pos < end:
            self._buffer = buffer[pos:]
        return out


class ChunkDelivery:
    """Where a chunked body's reads go (``UpstreamStream.deliver_chunked``):
    called with each read's chunk data, in order, as a plain callable would be.
    A read that is exactly one chunk framed as the sidecar frames its own
    client's chunks (:meth:`ChunkedBodyReader.framed_chunk_start`) is offered
    whole to :meth:`framed_chunk` instead, so the driver may forward it as it
    came."""

    def __call__(self, chunks: list[bytes]) -> None:
        raise NotImplementedError

    def framed_chunk(self, data: bytes, framed: bytes) -> None:
        """One read that is exactly one chunk: its data, and the read itself
        (``b"%x\\r\\n" % len(data) + data + b"\\r\\n"``, byte for byte)."""
        self([data])
