"""Incremental detokenisation with stop-string holdback, and its test oracle.

Decoding the whole output again for every token is simple and correct but
quadratic; :class:`IncrementalDetokenizer` decodes only a short window of
recent tokens. It keeps two offsets into the token list (the scheme vLLM uses):

- ``read_offset``: every token before it has been turned into emitted text;
- ``prefix_offset``: where the window starts, the ``read_offset`` of the
  emission before last.

For a new token it decodes ``tokens[prefix_offset:read_offset]`` (text already
emitted) and ``tokens[prefix_offset:]``; the difference is the new text. If the
new text ends in U+FFFD the last token ended inside a multi-byte character, so
nothing is emitted until a later token completes it. Decoding a window and not
a single token keeps tokenizers that strip a leading space at the start of a
decode (SentencePiece's metaspace) correct: both decodes lose the same space.

Why the window may start at an old ``read_offset``: an offset is only recorded
after a decode that ended in a complete character, and UTF-8 is
self-synchronising, so the decoder is in its start state there; decoding from
it gives the same characters as decoding from the very beginning.

:class:`StopStringHoldback` then withholds any suffix of the text that could be
the start of a stop string. A stop string can therefore only begin inside the
held text, never in text already sent, and the stream is cut exactly before
the first occurrence, as if the whole output had been searched at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, as the tokenizer decodes them (special tokens skipped or not)."""

REPLACEMENT_CHARACTER = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the first output token, for leading-space context."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete-character text deltas."""

    __slots__ = ("_decode", "_prefix_offset", "_read_offset", "_token_ids")

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often ``""`` mid-character)."""
        self._token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: return whatever is still held, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        window = self._token_ids
        emitted_text = self._decode(window[self._prefix_offset : self._read_offset])
        window_text = self._decode(window[self._prefix_offset :])
        if not final and (
            window_text.endswith(REPLACEMENT_CHARACTER) or len(window_text) <= len(emitted_text)
        ):
            return ""
        delta = window_text[len(emitted_text) :]
        # Slide the window: the next decode starts at this emission's read
        # offset, so memory and decode cost stay flat however long the output.
        del window[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(window)
        return delta


class StopStringHoldback:
    """Cuts text at the first stop string, withholding any possible stop-string start."""

    __slots__ = ("_held", "_longest_stop", "_stops", "matched_stop")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched_stop: str | None = None
        """The stop string that ended the text, once one has."""

    @property
    def held_text(self) -> str:
        """Text received but not yet released."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(releasable text, stopped)``.

        When ``stopped`` is true, the released text ends just before the stop
        string and nothing more may be fed.
        """
        buffer = self._held + text
        if not self._stops:
            self._held = ""
            return buffer, False
        first_match = -1
        for stop in self._stops:
            index = buffer.find(stop)
            if index >= 0 and (first_match < 0 or index < first_match):
                first_match, self.matched_stop = index, stop
        if first_match >= 0:
            self._held = ""
            return buffer[:first_match], True
        held_chars = self._possible_stop_prefix_chars(buffer)
        self._held = buffer[len(buffer) - held_chars :] if held_chars else ""
        return buffer[: len(buffer) - held_chars], False

    def flush(self) -> str:
        """Release everything held (the stream ended without a stop string)."""
        held, self._held = self._held, ""
        return held

    def _possible_stop_prefix_chars(self, buffer: str) -> int:
        for length in range(min(len(buffer), self._longest_stop - 1), 0, -1):
            suffix = buffer[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0


class OutputTextStream:
    """One request's output text: incremental detokenisation, then stop strings."""

    __slots__ = ("_detokenizer", "_holdback", "_stopped", "text_length_chars")

    def __init__(
        self, decode: Decode, prompt_token_ids: Sequence[int], stops: Sequence[str]
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(decode, prompt_token_ids)
        self._holdback = StopStringHoldback(stops)
        self._stopped = False
        self.text_length_chars = 0

    @property
    def stopped(self) -> bool:
        """A stop string was seen; the output is complete."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._holdback.matched_stop

    def push(self, token_id: int, *, check_stops: bool = True) -> str:
        """Add a token; return the text that may be sent now."""
        text = self._detokenizer.push(token_id)
        if check_stops:
            released, self._stopped = self._holdback.feed(text)
        else:
            released = self._holdback.flush() + text
        self.text_length_chars += len(released)
        return released

    def finish(self) -> str:
        """The stream ended for another reason (length, EOS, abort): release the rest."""
        if self._stopped:
            return ""
        text = self._detokenizer.flush()
        released, self._stopped = self._holdback.feed(text)
        if not self._stopped:
            released += self._holdback.flush()
        self.text_length_chars += len(released)
        return released


def oracle_output_text(
    decode: Decode,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    stops: Sequence[str] = (),
) -> tuple[str, bool]:
    """The re-decode-everything reference: ``(final text, stopped by a stop string)``.

    Decodes prompt and output together, drops the prompt's text, and cuts at
    the earliest stop string. Quadratic if called per token; tests only.
    """
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    full_text = decode([*context, *output_token_ids])
    text = full_text[len(decode(context)) :]
    matches = [index for index in (text.find(s) for s in stops) if index >= 0]
    if matches:
        return text[: min(matches)], True
    return text, False
