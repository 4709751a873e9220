"""Incremental detokenisation against the re-decode-everything oracle."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenwire.engine.detok import (
    IncrementalDetokenizer,
    OutputTextStream,
    StopStringHoldback,
    oracle_output_text,
)
from tokenwire.engine.loader import LoadedModel

TEXTS = (
    "Plain English, with punctuation: yes!",
    "Emoji: 👍🏽 thumbs, 👨‍👩‍👧 a family, 🏳️‍🌈 a flag, and 🤖.",
    "中文：你好，世界。日本語：東京は晴れです。한국어: 안녕하세요",  # noqa: RUF001 - the point
    "Hebrew שלום עולם and Arabic مرحبا بالعالم, right to left.",
    "Mixed: café naïve Ωμέγα — “quotes” … ½ ∑ 🐍 end",
)
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _decoder(loaded: LoadedModel):  # type: ignore[no-untyped-def]
    backend = loaded.tokenizer.backend_tokenizer
    return lambda ids: backend.decode(list(ids), skip_special_tokens=True)


def _stream_deltas(decode, prompt: Sequence[int], tokens: Sequence[int]) -> list[str]:  # type: ignore[no-untyped-def]
    detokenizer = IncrementalDetokenizer(decode, prompt)
    deltas = [detokenizer.push(token) for token in tokens]
    deltas.append(detokenizer.flush())
    return deltas


@SETTINGS
@given(data=st.data())
def test_random_token_streams_match_the_oracle(tiny_f32: LoadedModel, data: st.DataObject) -> None:
    vocab = len(tiny_f32.tokenizer)
    token_ids = st.integers(min_value=0, max_value=vocab - 1)
    prompt = data.draw(st.lists(token_ids, max_size=8), label="prompt")
    tokens = data.draw(st.lists(token_ids, max_size=40), label="tokens")
    decode = _decoder(tiny_f32)

    deltas = _stream_deltas(decode, prompt, tokens)

    expected, _ = oracle_output_text(decode, prompt, tokens)
    assert "".join(deltas) == expected
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_is_emitted_in_whole_characters(tiny_f32: LoadedModel, text: str) -> None:
    decode = _decoder(tiny_f32)
    prompt = tiny_f32.tokenizer("Say:").input_ids
    tokens = tiny_f32.tokenizer(text).input_ids
    assert len(tokens) > len(text.encode()) // 8  # really split into many byte-level tokens

    deltas = _stream_deltas(decode, prompt, tokens)

    assert "".join(deltas) == text
    emitted = ""
    for delta in deltas:
        assert "\ufffd" not in delta
        emitted += delta
        assert text.startswith(emitted)


@SETTINGS
@given(data=st.data())
def test_stop_strings_spanning_token_boundaries(tiny_f32: LoadedModel, data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(TEXTS), label="text")
    start = data.draw(st.integers(0, len(text) - 1), label="start")
    end = data.draw(st.integers(start + 1, min(len(text), start + 6)), label="end")
    stop = text[start:end]
    decoy = data.draw(st.sampled_from(["zzz", "\u05e9\u05dc\u05d5\u05dd!", "👍🏽👍🏽"]),
                      label="decoy")
    decode = _decoder(tiny_f32)
    tokens = tiny_f32.tokenizer(text).input_ids
    stream = OutputTextStream(decode, [], (decoy, stop))

    emitted = ""
    expected, stopped_by_oracle = oracle_output_text(decode, [], tokens, (decoy, stop))
    for token in tokens:
        emitted += stream.push(token)
        assert expected.startswith(emitted)  # never a character of the stop string
        if stream.stopped:
            break
    emitted += stream.finish()

    assert stopped_by_oracle and stream.stopped
    first_match = min(i for i in (text.find(stop), text.find(decoy)) if i >= 0)
    assert emitted == expected == text[:first_match]


def test_holdback_releases_text_that_turns_out_not_to_be_a_stop() -> None:
    holdback = StopStringHoldback(["</end>"])
    assert holdback.feed("Hello </") == ("Hello ", False)
    assert holdback.held_text == "</"
    assert holdback.feed("en") == ("", False)
    assert holdback.feed("try>") == ("</entry>", False)
    assert holdback.feed(" then </end> tail") == (" then ", True)
    assert holdback.matched_stop == "</end>"


def test_holdback_picks_the_earliest_of_several_stops() -> None:
    holdback = StopStringHoldback(["world", "lo w"])
    released, stopped = holdback.feed("hello world")
    assert (released, stopped, holdback.matched_stop) == ("hel", True, "lo w")


def test_output_stream_flushes_held_text_when_the_stream_ends_otherwise(
    tiny_f32: LoadedModel,
) -> None:
    decode = _decoder(tiny_f32)
    tokens = tiny_f32.tokenizer("Good night, moo").input_ids
    stream = OutputTextStream(decode, [], ("moon",))
    emitted = "".join(stream.push(token) for token in tokens)
    assert not emitted.endswith("moo")  # held: it could become "moon"
    assert emitted + stream.finish() == "Good night, moo"
