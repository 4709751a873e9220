"""Time to first token and inter-token gaps: the meter alone, then inside the core."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.middleware import UpstreamData, UpstreamEnded
from tokenwire.middleware.core.chunks import carries_token, read_chunk
from tokenwire.middleware.core.meter import GAP_BUCKETS_S, TokenMeter, gap_bucket

from .wire_harness import Driver, chunk, completion_chunk, event, tool_args

DONE = "[DONE]"


@pytest.mark.parametrize(("data", "token"), [
    (chunk(role="assistant", text=""), False),  # vLLM's and our engine's role chunk
    (chunk(role="assistant"), False),
    (chunk(finish="stop"), False),
    (chunk(usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
           extra={"choices": []}), False),
    ('{"error":{"message":"boom","type":"x","code":"y"}}', False),
    (chunk("Hello"), True),
    (chunk(" ", role="assistant"), True),  # TGI and Ollama repeat the role beside the text
    (chunk("why", field="reasoning_content"), True),
    (chunk("why", field="reasoning"), True),
    (chunk(extra_delta={"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]}), True),
    (tool_args('{"a":'), True),
    (completion_chunk("x"), True),
    ('{"type":"content_block_delta","delta":{"type":"text_delta","text":"Hi"}}', True),
    ("plain text of a non-JSON stream", True),
    ("", False),
], ids=lambda v: v if isinstance(v, bool) else str(v)[:40])
def test_carries_token_table(data: str, token: bool) -> None:
    assert carries_token(data.encode()) is token
    assert carries_token(b"data: " + data.encode() + b"\n\n") is token
    if data.startswith('{"id"'):  # an OpenAI chunk: the parsed fact agrees with the regex
        assert read_chunk(data).carries_token is token


def test_meter_when_role_chunk_first_then_times_from_the_first_token() -> None:
    meter = TokenMeter(10.0, carries_token)
    meter.queued(chunk(role="assistant", text=""))
    meter.wrote(1, 10.1)  # the role chunk: not a token
    assert meter.ttft_s is None and meter.content_events == 0
    meter.queued(chunk("a"))
    meter.wrote(1, 10.9)
    meter.wrote(1, 10.92)
    meter.wrote(2, 11.0)  # two merged events, one arrival
    assert meter.ttft_s == pytest.approx(0.9)
    assert meter.gap_count == 2 and meter.gap_sum_s == pytest.approx(0.1)
    assert meter.max_gap_s == pytest.approx(0.08)
    assert meter.content_events == 4
    assert sum(meter.gap_buckets) == 2 and len(meter.gap_buckets) == len(GAP_BUCKETS_S)


def test_core_when_role_chunk_then_silent_prefill_then_ttft_is_the_tokens_not_the_roles() -> None:
    """The issue's case: an engine sends its role chunk at once and its first
    token 0.8 s later; TTFT is 0.8 s, and no gap includes the prefill."""
    d = Driver(now=0.0)
    d.sse_headers(at=0.01)
    d.send(event(chunk(role="assistant", text="")), at=0.1)
    d.send(event(chunk("Hel")), at=0.81)
    d.send(event(chunk("lo")), at=0.83)
    d.send(event(chunk(finish="stop")), at=0.84)
    d.send(event(DONE), at=0.85)
    d.send(UpstreamEnded(), at=0.86)
    record = d.finished.record
    assert record.ttfb_s == pytest.approx(0.1)
    assert record.ttft_s == pytest.approx(0.81)
    assert record.max_event_gap_s == pytest.approx(0.02)
    assert record.event_gap_sum_s == pytest.approx(0.85 - 0.81)
    assert record.content_events == 3  # Hel, lo, the finish chunk; not [DONE]
    assert record.tokens_out == (2, "counted")  # the tokens: Hel, lo (the finish chunk carries none)


def test_core_when_first_token_takes_the_fast_path_then_still_metered() -> None:
    """Once the role chunk made the stream STREAMING, plain ``data:`` reads skip
    the parser (``forward_read`` and the fast branch): the meter sees them too."""
    d = Driver(now=0.0)
    d.sse_headers(at=0.0)
    d.send(UpstreamData(b"data: " + chunk(role="assistant", text="").encode() + b"\n\n"), at=0.05)
    role_only = b"data: " + chunk(role="assistant").encode() + b"\n\n"
    assert d.stream.forward_read(role_only, 0.1) is not None
    assert d.stream.meter.ttft_s is None
    frames = b"".join(b"data: " + chunk(t).encode() + b"\n\n" for t in ("a", "b"))
    assert d.stream.forward_read(frames, 0.5) == frames
    assert d.stream.meter.ttft_s == pytest.approx(0.5)
    d.send(UpstreamData(b"data: " + chunk("c").encode() + b"\n\n"), at=0.6)
    assert d.stream.meter.gap_count == 1
    assert d.stream.meter.content_events == 3


def test_core_when_upstream_sends_usage_then_tokens_from_usage() -> None:
    d = Driver(now=0.0)
    d.sse_headers(at=0.0)
    d.send(event(chunk("a")), at=0.2)
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    d.send(event(chunk(usage=usage, extra={"choices": []})), at=0.3)
    d.send(event(DONE), at=0.3)
    d.send(UpstreamEnded(), at=0.3)
    record = d.finished.record
    assert record.ttft_s == pytest.approx(0.2) and record.ttfb_s == pytest.approx(0.2)
    assert record.tokens_out == (7, "usage")
    assert record.to_json()["tokens_source"] == "usage"


@settings(max_examples=500, deadline=None)
@given(gap_s=st.one_of(st.floats(allow_nan=True), st.sampled_from(GAP_BUCKETS_S)))
def test_gap_bucket_is_bisect_left_for_every_gap(gap_s: float) -> None:
    # The meter's scan must put every gap, a bound itself, inf and NaN
    # included, where bisect_left over the bounds would.
    assert gap_bucket(gap_s) == bisect.bisect_left(GAP_BUCKETS_S, gap_s)
