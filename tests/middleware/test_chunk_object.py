"""``chunk_object`` reads a payload exactly as ``json.loads`` does (it calls json's
scanner without json.loads' frames): the same object, or None wherever
json.loads raises or reads something other than an object."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenwire.middleware.core.chunks import chunk_object

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_SPACE = st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\ufeff", max_size=3)
_JUNK = st.sampled_from(["", "", "", "x", "}", "{", ",", "]", "\"", "1", "null", "{}", "\\"])


def _loads(text: str) -> object:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


@settings(max_examples=600, deadline=None)
@given(value=_VALUES, before=_SPACE, after=_SPACE, junk=_JUNK, cut=st.integers(0, 40))
@example(value={"a": 1}, before="", after="", junk="", cut=0)
@example(value={"a": " "}, before="\ufeff", after="", junk="", cut=0)
@example(value={"a": 1}, before=" \n", after="\r\t", junk="", cut=0)
@example(value={"a": 1}, before="", after=" ", junk="x", cut=0)
@example(value={"a": [1, 2]}, before="", after="", junk="", cut=5)
def test_chunk_object_reads_what_json_loads_reads(value: object, before: str, after: str, junk: str,
                                                  cut: int) -> None:
    text = before + json.dumps(value, separators=(",", ":") if cut % 2 else (", ", ": ")) + after + junk
    if cut > 20:
        text = text[:cut - 20]  # a payload cut short
    assert chunk_object(text) == _loads(text)


def test_chunk_object_refuses_what_is_not_one_object() -> None:
    for text in ["", " ", "[]", "1", "null", '{"a": 1} {"b": 2}', '{"a": 1', '{"a": NaN}x',
                 '{"a": "\x01"}', "\ufeff{}", '{"a": 1}\x0b']:
        assert chunk_object(text) == _loads(text), text
    assert chunk_object(' {"a": Infinity} \n') == {"a": float("inf")}  # json.loads reads it too
