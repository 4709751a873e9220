"""The sidecar's own chunked-body reader: the same body however the reads are
cut, strict about the grammar, and nothing consumed past the body's end."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.upstream.body import ChunkedBodyReader
from tokenwire.sidecar.upstream.errors import RemoteProtocolFault

_BODY = (b"6\r\ndata: \r\n"
         b"1a;name=value\r\n" + b"x" * 26 + b"\r\n"
         b"A\r\n0123456789\r\n"
         b"0\r\nX-Trailer: 1\r\n\r\n")


def _read(pieces: list[bytes]) -> tuple[bytes, ChunkedBodyReader]:
    reader = ChunkedBodyReader()
    out = b"".join(b"".join(reader.feed(piece)) for piece in pieces)
    return out, reader


def test_every_split_gives_the_same_body() -> None:
    expected = b"data: " + b"x" * 26 + b"0123456789"
    for cut in range(len(_BODY) + 1):
        for second in range(cut, len(_BODY) + 1, 7):
            body, reader = _read([_BODY[:cut], _BODY[cut:second], _BODY[second:]])
            assert body == expected, (cut, second)
            assert reader.done and reader.leftover == b""
    body, reader = _read([bytes([b]) for b in _BODY])
    assert body == expected and reader.done


def test_one_read_of_many_chunks_gives_one_piece_per_chunk() -> None:
    reader = ChunkedBodyReader()
    assert reader.feed(b"2\r\nab\r\n2\r\ncd\r\n3\r\nef") == [b"ab", b"cd", b"ef"]
    assert reader.feed(b"g\r\n") == [b"g"]
    assert not reader.done


def test_bytes_after_the_end_are_left_over_not_body() -> None:
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
def test_malformed_bodies_are_refused(bad: bytes) -> None:
    reader = ChunkedBodyReader()
    with pytest.raises(RemoteProtocolFault):
        reader.feed(bad)
        reader.feed(b"\r\n\r\n")


def _encoded(pieces: list[bytes], sizes_as: list[str]) -> bytes:
    out = []
    for piece, form in zip(pieces, sizes_as, strict=True):
        digits = {"lower": f"{len(piece):x}", "upper": f"{len(piece):X}",
                  "padded": f"{len(piece):016x}", "extension": f"{len(piece):x};a=b"}[form]
        out.append(digits.encode() + b"\r\n" + piece + b"\r\n")
    return b"".join(out) + b"0\r\n\r\n"


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=6),
       forms=st.lists(st.sampled_from(["lower", "upper", "padded", "extension"]), min_size=6, max_size=6),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=4))
def test_any_size_spelling_any_cuts_give_the_same_body(pieces: list[bytes], forms: list[str],
                                                 cuts: list[int]) -> None:
    # The one-chunk path and the byte-by-byte size scan must read every
    # spelling RFC 9112 allows (either case, leading zeros up to 16 digits,
    # an extension) as the general path does, wherever the reads are cut.
    body = _encoded(pieces, forms[:len(pieces)])
    bounds = sorted({0, len(body), *(cut % (len(body) + 1) for cut in cuts)})
    out, reader = _read([body[a:b] for a, b in itertools.pairwise(bounds)])
    assert out == b"".join(pieces)
    assert reader.done and reader.leftover == b""


def test_one_whole_chunk_per_read_is_one_piece_in_every_spelling() -> None:
    for size_line in (b"1a", b"1A", b"000000000000001a", b"1a;x=y", b"1a \t"):
        reader = ChunkedBodyReader()
        assert reader.feed(size_line + b"\r\n" + b"y" * 26 + b"\r\n") == [b"y" * 26], size_line
        assert not reader.done


def _spelled(piece: bytes, form: str) -> bytes:
    digits = {"lower": f"{len(piece):x}", "upper": f"{len(piece):X}", "zero": f"0{len(piece):x}",
              "padded": f"{len(piece):016x}", "extension": f"{len(piece):x};a=b",
              "space": f"{len(piece):x} "}[form]
    return digits.encode() + b"\r\n" + piece + b"\r\n"


@settings(max_examples=400, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(min_value=1, max_value=700), st.binary(min_size=1, max_size=5),
                               st.sampled_from(["lower", "upper", "zero", "padded", "extension", "space"])),
                     min_size=1, max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=6000), max_size=5),
       whole=st.booleans())
def test_property_a_framed_chunk_read_is_what_feed_would_give_spelled_as_the_sidecar_frames_it(
        spec: list[tuple[int, bytes, str]], cuts: list[int], whole: bool) -> None:
    # The sidecar forwards a read that framed_chunk_start accepts as it came
    # and never feeds it to the reader. That is only right if (1) feeding it
    # would have given exactly its data, as one piece, and left the reader as
    # it was (the rest of the body reads the same), and (2) the read is byte
    # for byte what http1.send_body writes for that data: the lowercase "%x"
    # size line, the data, CRLF. Reads are cut anywhere, or one chunk each.
    pieces = [((seed * size)[:size], form) for size, seed, form in spec]
    chunks = [_spelled(piece, form) for piece, form in pieces]
    body = b"".join(chunks) + b"0\r\n\r\n"
    if whole:
        reads = [*chunks, b"0\r\n\r\n"]
    else:
        bounds = sorted({0, len(body), *(cut % (len(body) + 1) for cut in cuts)})
        reads = [body[a:b] for a, b in itertools.pairwise(bounds)]
    skipping, feeding = ChunkedBodyReader(), ChunkedBodyReader()
    out_skipping: list[bytes] = []
    out_feeding: list[bytes] = []
    framed = 0
    for read in reads:
        fed = feeding.feed(read)
        out_feeding += fed
        start = skipping.framed_chunk_start(read)
        if start:
            framed += 1
            data = read[start:len(read) - 2]
            assert fed == [data]
            assert read == b"%x\r\n" % len(data) + data + b"\r\n"
            out_skipping.append(data)
        else:
            out_skipping += skipping.feed(read)
    assert out_skipping == out_feeding
    assert b"".join(out_skipping) == b"".join(piece for piece, _ in pieces)
    assert skipping.done and feeding.done and skipping.leftover == feeding.leftover == b""
    if reads[:-1] == chunks:
        # Every chunk spelled as "%x" spells it (upper case without a-f digits too) went whole.
        assert framed == sum(chunk == _spelled(piece, "lower")
                             for chunk, (piece, _) in zip(chunks, pieces, strict=True))


def test_framed_chunk_start_only_for_one_whole_canonical_chunk_at_a_boundary() -> None:
    reader = ChunkedBodyReader()
    one = b"1a\r\n" + b"y" * 26 + b"\r\n"
    assert reader.framed_chunk_start(one) == 4
    for other in (b"1A\r\n" + b"y" * 26 + b"\r\n", b"01a\r\n" + b"y" * 26 + b"\r\n",
                  b"1a;x=y\r\n" + b"y" * 26 + b"\r\n", one + one, one[:-1], b"0\r\n\r\n", b""):
        assert reader.framed_chunk_start(other) == 0, other
    reader.feed(one[:10])  # inside a chunk: nothing is framed whole now
    assert reader.framed_chunk_start(one) == 0
