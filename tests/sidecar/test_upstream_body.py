"""The sidecar's own chunked-body reader: the same body however the reads are
cut, strict about the grammar, and nothing consumed past the body's end."""

from __future__ import annotations

import httpcore
import pytest
from tokenwire.sidecar.upstream_body import ChunkedBodyReader

_BODY = (b"6\r\ndata: \r\n"
         b"1a;name=value\r\n" + b"x" * 26 + b"\r\n"
         b"A\r\n0123456789\r\n"
         b"0\r\nX-Trailer: 1\r\n\r\n")


def _read(pieces: list[bytes]) -> tuple[bytes, ChunkedBodyReader]:
    reader = ChunkedBodyReader()
    out = b"".join(b"".join(reader.feed(piece)) for piece in pieces)
    return out, reader


def test_everySplit_givesTheSameBody() -> None:
    expected = b"data: " + b"x" * 26 + b"0123456789"
    for cut in range(len(_BODY) + 1):
        for second in range(cut, len(_BODY) + 1, 7):
            body, reader = _read([_BODY[:cut], _BODY[cut:second], _BODY[second:]])
            assert body == expected, (cut, second)
            assert reader.done and reader.leftover == b""
    body, reader = _read([bytes([b]) for b in _BODY])
    assert body == expected and reader.done


def test_oneReadOfManyChunks_givesOnePiecePerChunk() -> None:
    reader = ChunkedBodyReader()
    assert reader.feed(b"2\r\nab\r\n2\r\ncd\r\n3\r\nef") == [b"ab", b"cd", b"ef"]
    assert reader.feed(b"g\r\n") == [b"g"]
    assert not reader.done


def test_bytesAfterTheEnd_areLeftOver_notBody() -> None:
    body, reader = _read([b"1\r\na\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", b"more"])
    assert body == b"a"
    assert reader.done
    assert reader.leftover == b"HTTP/1.1 200 OK\r\nmore"


@pytest.mark.parametrize("bad", [
    b"zz\r\n",                       # not hex
    b"\r\n",                         # no size
    b"1\nab",                        # bare LF after the size
    b"1 2\r\n",                      # junk after the size
    b"1;a\x00b\r\n",                 # NUL in an extension
    b"11111111111111111\r\n",        # 17 hex digits: beyond any real length
    b"1\r\nab\r\n",                  # data longer than its size
    b"0\r\nno colon\r\n\r\n",        # malformed trailer
    b"1" * 5000,                     # a size line that never ends
])
def test_malformedBodies_areRefused(bad: bytes) -> None:
    reader = ChunkedBodyReader()
    with pytest.raises(httpcore.RemoteProtocolError):
        reader.feed(bad)
        reader.feed(b"\r\n\r\n")
