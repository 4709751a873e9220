"""Each engine's wire format, replayed through the sidecar and the middleware.

For every transcript in ``transcripts/`` (written from the engine's documented
format; each file cites its sources):

* a fast reader gets the engine's events one for one, text exact, and the
  stream ends as the engine ended it: ``[DONE]`` and a clean end, or the
  common in-band error ``{"error": {"message", "type", "code"}}`` and a body
  cut without its terminator;
* a slow reader (coalescing) gets the same text in the same runs, every
  barrier (role chunk, tool calls, finish_reason, usage, errors, foreign JSON)
  as its own event where it was, and fewer events than were sent;
* the wire core alone, with the whole transcript pending behind a paused
  socket (the most merging there can be), keeps the same promises.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from tokenwire.middleware import (
    SocketPaused,
    SocketResumed,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
    WireStream,
    WriteCompleted,
)

from .replay import (
    BASE,
    DRIVERS,
    EVENT_STREAM,
    Expect,
    Transcript,
    check_error_event,
    expected_datas,
    normalised,
    parse,
    scenario_for,
    sse_data,
    text_piece,
    texts,
    transcript_names,
)

NO_MARKER = BASE.replace(terminal_marker=None)

EXPECT: dict[str, Expect] = {
    "vllm_chat_reasoning": Expect(),
    "vllm_reasoning_field": Expect(),
    "vllm_tool_calls": Expect(),
    "vllm_error": Expect(ends_in_error=True, error_message="illegal memory access",
                         error_type="InternalServerError"),
    "tgi_chat": Expect(),
    "tgi_chat_error": Expect(ends_in_error=True, error_message="CUDA out of memory", error_type="generation"),
    # TGI's native route has no terminal marker: its last event carries
    # generated_text and details, then the body ends.
    "tgi_generate_stream": Expect(config=NO_MARKER),
    "tgi_generate_stream_error": Expect(ends_in_error=True, error_message="OutOfMemoryError",
                                        error_type="generation", config=NO_MARKER),
    "sglang_chat_reasoning": Expect(),
    "sglang_tool_calls": Expect(),
    "sglang_error": Expect(ends_in_error=True, error_message="longer than the model's context length",
                           error_type="BadRequestError"),
    "llamacpp_chat_reasoning": Expect(),
    "llamacpp_tool_calls": Expect(),
    # llama.cpp reports the failure in an `error:` field, then sends [DONE]: the
    # parser turns that field into an error event (middleware/core/sse.py).
    "llamacpp_error": Expect(ends_in_error=True, error_message="Input prompt is too big"),
    "ollama_chat_reasoning": Expect(),
    "ollama_tool_calls": Expect(),
    # Ollama writes its error as a bare JSON line (no `data:`) and ends the body
    # without [DONE]: its message is unreadable, the truncation is not.
    "ollama_error": Expect(ends_in_error=True, error_message=None),
}
def cases(names: list[str]) -> list[object]:
    return list(names)


def test_every_transcript_has_an_expectation() -> None:
    assert sorted(EXPECT) == transcript_names()


def test_transcripts_cover_the_shapes_the_issue_names() -> None:
    """Role-only first chunks, usage chunks, tool-call deltas, reasoning deltas and
    in-band errors each appear in at least one transcript."""
    datas = [d for name in transcript_names() for d in sse_data(Transcript.load(name).body)]
    objs = [json.loads(d) for d in datas if d.startswith("{")]
    deltas = [c.get("delta") or {} for o in objs for c in o.get("choices") or []]
    assert any(set(k for k, v in d.items() if v is not None) == {"role"} for d in deltas)
    assert any(o.get("usage") and o.get("choices") == [] for o in objs)
    assert any(d.get("tool_calls") for d in deltas)
    assert any(d.get("reasoning_content") for d in deltas) and any(d.get("reasoning") for d in deltas)
    assert sum(1 for n, e in EXPECT.items() if e.ends_in_error) >= 5


def run(driver: str, name: str, *, repeat_text: int = 1, client_stall_s: float = 0.0):  # type: ignore[no-untyped-def]
    transcript, expect = Transcript.load(name), EXPECT[name]
    scenario = scenario_for(transcript, expect.config, repeat_text=repeat_text, client_stall_s=client_stall_s)
    return transcript, expect, scenario, parse(asyncio.run(DRIVERS[driver](scenario)))


@pytest.mark.parametrize("name", cases(sorted(EXPECT)))
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_fast_reader_gets_the_engines_events_one_for_one_and_its_ending(driver: str, name: str) -> None:
    transcript, expect, _, result = run(driver, name)
    assert result.status == 200
    assert result.headers[b"content-type"].startswith(b"text/event-stream")
    got = sse_data(result.body)
    expected = expected_datas(transcript, expect)
    if expect.ends_in_error:
        assert not result.complete, "an errored stream must not end cleanly"
        check_error_event(got[-1], expect, transcript.body)
        got = got[:-1]
    else:
        assert result.complete
    assert got == expected
    assert texts(got) == texts(sse_data(transcript.body))


SLOW_READER_TEXT_BYTES = 512 * 1024
"""Mergeable chunks are repeated until they add up to this much: far more than
the socket buffers of a stalled reader hold, so most of them must wait, and
merge, in user space."""


def mergeable_bytes(name: str) -> int:
    return sum(len(raw) for raw in Transcript.load(name).raw_events()
               if (datas := sse_data(raw)) and text_piece(datas[0]))


MERGEABLE = [n for n in sorted(EXPECT) if mergeable_bytes(n)]


@pytest.mark.slow
@pytest.mark.parametrize("name", cases(MERGEABLE))
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_slow_reader_coalesces_text_exactly_and_never_across_a_barrier(driver: str, name: str) -> None:
    repeat = -(-SLOW_READER_TEXT_BYTES // mergeable_bytes(name))
    transcript, expect, scenario, result = run(driver, name, repeat_text=repeat, client_stall_s=0.4)
    sent = [d for step in scenario.steps for d in sse_data(step.data)]  # type: ignore[union-attr]
    expected = expected_datas(Transcript(transcript.name, "", b"".join(
        step.data for step in scenario.steps)), expect)  # type: ignore[union-attr]
    assert expected is not None
    got = sse_data(result.body)
    if expect.ends_in_error:
        assert not result.complete
        check_error_event(got[-1], expect, transcript.body)
        got = got[:-1]
    else:
        assert result.complete
    assert normalised(got) == normalised(expected)
    assert texts(got) == texts(expected)
    assert len(got) < len(expected) <= len(sent), "the stalled reader must have made the driver coalesce"


def core_output(body: bytes, config: object, *, split_bytes: int | None) -> tuple[bytes, bool]:
    """The wire core alone: the socket pauses before the first byte, the whole
    transcript arrives (in ``split_bytes`` pieces: framing must not matter), then
    the socket resumes and everything pending is written."""
    stream = WireStream(config, now=0.0, request_id="compat")  # type: ignore[arg-type]
    complete: list[bool] = []

    def feed(event: object) -> None:
        for action in stream.handle(event, 0.0):  # type: ignore[arg-type]
            if type(action).__name__ == "CloseClient":
                complete.append(not action.abrupt)  # type: ignore[attr-defined]

    out = bytearray()
    feed(UpstreamHeaders(200, EVENT_STREAM))
    feed(SocketPaused())
    pieces = [body] if split_bytes is None else [body[i:i + split_bytes]
                                                 for i in range(0, len(body), split_bytes)]
    for piece in pieces:
        feed(UpstreamData(piece))
    feed(UpstreamEnded())
    feed(SocketResumed())
    while data := stream.data_to_send(0.0):
        out += data
        feed(WriteCompleted())
    assert stream.finished
    return bytes(out), complete == [True]


@pytest.mark.parametrize("split_bytes", [None, 7], ids=["whole", "7-byte-pieces"])
@pytest.mark.parametrize("name", cases(sorted(EXPECT)))
def test_core_with_everything_pending_merges_only_what_may_merge(name: str, split_bytes: int | None) -> None:
    transcript, expect = Transcript.load(name), EXPECT[name]
    body, complete = core_output(transcript.body, expect.config, split_bytes=split_bytes)
    got = sse_data(body)
    expected = expected_datas(transcript, expect)
    assert expected is not None
    if expect.ends_in_error:
        assert not complete
        check_error_event(got[-1], expect, transcript.body)
        got = got[:-1]
    else:
        assert complete
    assert normalised(got) == normalised(expected)
    assert texts(got) == texts(expected)
    runs = sum(1 for a, b in itertools.pairwise(expected)
               if (pa := text_piece(a)) and (pb := text_piece(b)) and pa[0] == pb[0])
    assert len(got) == len(expected) - runs, "every run of mergeable chunks must have merged"
