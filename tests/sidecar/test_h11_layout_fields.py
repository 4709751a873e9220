"""``fields_valid`` says yes exactly when h11 accepts every header of a list."""

from __future__ import annotations

import h11
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.downstream.h11_layout import fields_valid

Header = tuple[bytes, bytes]

# Token characters, separators, every kind of whitespace, NUL, controls, obs-text.
_ALPHABET = st.sampled_from([*b"aZ09-_.~!|", *b" \t\n\r\x0b\x0c\x00\x01\x7f\x80\xff:;,\"()/"])
_FIELD = st.lists(_ALPHABET, max_size=6).map(bytes)


def _h11_accepts(headers: list[Header]) -> bool:
    # Host (h11 requires one) and only names h11 does not also check for framing.
    try:
        h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"x"), *headers])
    except h11.LocalProtocolError:
        return False
    return True


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
@settings(max_examples=2000, deadline=None)
@given(st.lists(st.tuples(_FIELD, _FIELD), max_size=4))
@example([(b"x-a", b"one two")])
@example([(b"x-a", b" lead")])
@example([(b"x-a", b"trail\t")])
@example([(b"x-a", b"")])
@example([(b"", b"v")])
@example([(b"x-a", b"a\nb")])
@example([(b"x-a", b"a\r\nx-b: smuggled")])
@example([(b"x-a", b"\x80\xff")])
@example([(b"x a", b"v")])
@example([(b"x\na", b"v")])
@example([(b"\n", b"")])
@example([(b"x-a", b"\n")])
@example([(b"x-a", b" ")])
@example([(b"x-a", b"a"), (b"x-b\n", b"")])
@example([(b"x-a", b"v\x0c")])
@example([(b"x-a", b"\x7f\x01")])
def test_fields_valid_is_h11s_judgement(headers: list[Header]) -> None:
    framing = {b"content-length", b"transfer-encoding", b"host"}
    headers = [(name, value) for name, value in headers if name.lower() not in framing]
    assert fields_valid([(b"host", b"x"), *headers]) == _h11_accepts(headers)


def test_fields_valid_leaves_other_types_to_h11() -> None:
    assert fields_valid([]) is True
    assert fields_valid([(b"x-a", bytearray(b"v"))]) is False
    assert fields_valid([("x-a", "v")]) is False  # type: ignore[list-item]
