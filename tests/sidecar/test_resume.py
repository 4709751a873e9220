"""Resume through the sidecar (in-memory store): ids, reconnects, idempotency, grace.

Real sockets on 127.0.0.1; the fake engine streams OpenAI chunks."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from clients import chat_body, exchange, wait_for
from conftest import RunningSidecar
from resume_client import SSEResponse, open_stream, resume, resume_through_drops
from tokenwire.middleware import EndReason
from upstreams import FakeUpstream, expected_text

PATH = "/normal/v1/chat/completions"


def text_of(events: list[Any]) -> str:
    """The answer's text from the data events (role, finish and usage chunks add nothing)."""
    parts: list[str] = []
    for event in events:
        if event.data is None or event.data == "[DONE]":
            continue
        chunk = json.loads(event.data)
        if "error" in chunk:
            continue
        for choice in chunk.get("choices", []):
            parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def seqs(response: SSEResponse) -> list[int]:
    return [int(i.rpartition(".")[2]) for i in response.ids]


def start_stream(sidecar: RunningSidecar, *, tokens: int, delay_s: float = 0.0,
                 stop_after: int | None = None, headers: dict[str, str] | None = None,
                 body: bytes | None = None) -> SSEResponse:
    sent = {"x-fake-tokens": str(tokens), "x-fake-delay-s": str(delay_s), **(headers or {})}
    return open_stream(sidecar.port, "POST", PATH, body=body if body is not None else chat_body(),
                       headers=sent, stop_after=stop_after)


@pytest.fixture
def resumable(start_sidecar: Callable[..., RunningSidecar]) -> Callable[..., RunningSidecar]:
    def start(**overrides: Any) -> RunningSidecar:
        return start_sidecar(resume=True, **overrides)
    return start


def test_every_event_has_a_contiguous_id_and_the_first_event_says_retry(
        resumable: Callable[..., RunningSidecar]) -> None:
    sidecar = resumable(resume_retry_ms=700)
    response = start_stream(sidecar, tokens=6)
    assert response.status == 200 and response.clean_end
    # retry: rides on the first event, never a frame of its own (an empty event to
    # openai-python and httpx-sse, which then crash decoding its data).
    assert response.body.startswith(b"data: ")
    assert [e.retry for e in response.events if e.comment is None][:2] == [700, None]
    assert all(e.data for e in response.events if e.comment is None)
    stream_id = response.stream_id
    assert len(stream_id) >= 16
    # role, 6 tokens, finish, usage, [DONE]: every data event numbered 1..10 in order.
    assert response.ids == [f"{stream_id}.{n}" for n in range(1, 11)]
    assert text_of(response.events) == expected_text(6)


def test_without_resume_no_ids_and_no_stream_header(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    response = start_stream(sidecar, tokens=3)
    assert "x-tokenwire-stream-id" not in response.headers
    assert response.ids == [] and b"retry:" not in response.body


def test_get_stream_replays_every_event_after_last_event_id_exactly_once(
        resumable: Callable[..., RunningSidecar]) -> None:
    sidecar = resumable()
    full = start_stream(sidecar, tokens=8)
    stream_id = full.stream_id
    for after in (0, 1, 5, 11):
        replay = resume(sidecar.port, stream_id, f"{stream_id}.{after}" if after else None)
        assert replay.status == 200 and replay.clean_end, replay
        assert seqs(replay) == list(range(after + 1, 13))
        assert [e.data for e in replay.data_events] == [e.data for e in full.data_events][after:]
        assert replay.body.startswith(b"data: ") and replay.events[0].retry is not None
    # After the last event ([DONE] is 12): 204 tells an EventSource to stop reconnecting.
    done = resume(sidecar.port, stream_id, f"{stream_id}.12")
    assert done.status == 204 and done.events == []


def test_a_re_sent_post_with_last_event_id_gets_the_rest_without_a_second_generation(
        resumable: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = resumable()
    first = start_stream(sidecar, tokens=5, headers={"x-request-id": "resend-1"})
    again = start_stream(sidecar, tokens=5, headers={"x-request-id": "resend-2",
                                                     "Last-Event-ID": first.ids[3]})
    assert seqs(again) == list(range(5, 10))  # role, 5 tokens, finish, usage, [DONE]
    assert text_of(first.data_events[:4]) + text_of(again.events) == expected_text(5)
    assert upstream.requests_with("resend-2") == []


@pytest.mark.parametrize(("path", "last_event_id", "status", "code"), [
    ("/v1/streams/NoSuchStreamAtAll", None, 404, "stream_not_found"),
    ("/v1/streams/bad%20id", None, 404, "stream_not_found"),
    ("/v1/streams/NoSuchStreamAtAll", "garbage", 400, "invalid_last_event_id"),
    ("/v1/streams/NoSuchStreamAtAll", "OtherStream123.4", 400, "invalid_last_event_id"),
])
def test_unknown_or_malformed_resume_requests_get_a_clear_error(
        resumable: Callable[..., RunningSidecar], path: str, last_event_id: str | None,
        status: int, code: str) -> None:
    sidecar = resumable()
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    response = exchange(sidecar.port, "GET", path, headers=headers)
    assert response.status == status
    assert response.json()["error"]["code"] == code


def test_idempotency_key_repeat_replays_the_same_answer_with_one_upstream_request(
        resumable: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = resumable()
    headers = {"Idempotency-Key": "order-42", "x-request-id": "idem-a"}
    # The first one is still generating when the repeat arrives.
    first: list[SSEResponse] = []
    import threading

    worker = threading.Thread(target=lambda: first.append(
        start_stream(sidecar, tokens=20, delay_s=0.01, headers=headers)))
    worker.start()
    wait_for(lambda: upstream.requests_with("idem-a"))
    repeat = start_stream(sidecar, tokens=20, delay_s=0.01,
                          headers={**headers, "x-request-id": "idem-b"})
    worker.join(10)
    assert [e.data for e in repeat.data_events] == [e.data for e in first[0].data_events]
    assert repeat.ids == first[0].ids and text_of(repeat.events) == expected_text(20)
    assert len(upstream.requests_with("idem-a")) == 1 and upstream.requests_with("idem-b") == []
    metrics = exchange(sidecar.admin_port or 0, "GET", "/metrics").body.decode()
    assert 'tokenwire_replays_total{kind="idempotent"} 1.0' in metrics
    # The repeat's first token came from the replay store: counted apart from the engine's.
    sidecar.record("idem-b")
    metrics = exchange(sidecar.admin_port or 0, "GET", "/metrics").body.decode()
    assert ('tokenwire_time_to_first_token_seconds_count{http_version="1.1",status_class="2xx",'
            'upstream="replay"} 1.0') in metrics
    assert (f'tokenwire_time_to_first_token_seconds_count{{http_version="1.1",status_class="2xx",'
            f'upstream="{upstream.url}"}} 1.0') in metrics
    # Same key, different body: refused, still nothing sent upstream.
    other = exchange(sidecar.port, "POST", PATH, body=chat_body(temperature=0.5),
                     headers={**headers, "x-request-id": "idem-c"})
    assert other.status == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert upstream.requests_with("idem-c") == []


def test_a_failure_before_the_first_event_releases_the_idempotency_key(
        resumable: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = resumable(retry_attempts=0)
    # The fake engine fails the first request of this request id with a 503, then answers.
    headers = {"Idempotency-Key": "retry-me", "x-request-id": "fail-1", "x-fake-fail-first": "1"}
    failed = exchange(sidecar.port, "POST", "/status503/v1/chat/completions", body=chat_body(),
                      headers=headers)
    assert failed.status == 503
    # Nothing was shown, so a client retry must generate (not replay a failure).
    ok = open_stream(sidecar.port, "POST", "/status503/v1/chat/completions", body=chat_body(),
                     headers=headers)
    assert ok.status == 200 and text_of(ok.events) == expected_text(5)
    assert len(upstream.requests_with("fail-1")) == 2


def test_with_grace_a_quick_reconnect_continues_the_same_generation(
        resumable: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    # The grace (0.5 s) is shorter than the answer (~1.5 s): only the attach keeps it alive.
    sidecar = resumable(resume_grace_s=0.5)
    part = start_stream(sidecar, tokens=150, delay_s=0.01, stop_after=6,
                        headers={"x-request-id": "grace-1"})
    rest = resume(sidecar.port, part.stream_id, part.ids[-1])
    assert rest.status == 200 and rest.clean_end
    assert seqs(part) + seqs(rest) == list(range(1, 155))  # role, 150 tokens, finish, usage, [DONE]
    assert text_of(part.events) + text_of(rest.events) == expected_text(150)
    assert len(upstream.requests) and len(upstream.requests_with("grace-1")) == 1
    # The generation ran to its end for the reader: nothing was aborted.
    assert upstream.requests_with("grace-1")[0].finished_at is not None
    assert sidecar.record("grace-1").end_reason is EndReason.DETACHED


def test_without_a_reconnect_the_grace_ends_in_an_abort_and_a_resume_says_so(
        resumable: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = resumable(resume_grace_s=0.3)
    part = start_stream(sidecar, tokens=1000, delay_s=0.01, stop_after=3,
                        headers={"x-request-id": "grace-2"})
    left_at = time.monotonic()
    connection = upstream.connection_of("grace-2")
    assert connection.closed.wait(5) if hasattr(connection.closed, "wait") else True
    wait_for(lambda: connection.peer_closed_at is not None, timeout_s=5)
    assert connection.peer_closed_at is not None
    held_s = connection.peer_closed_at - left_at
    assert 0.25 <= held_s < 2.0, held_s
    record = sidecar.record("grace-2")
    assert record.end_reason is EndReason.CLIENT_GONE
    # A late reconnect gets what was generated, then an in-band error: never a clean end.
    late = resume(sidecar.port, part.stream_id, part.ids[-1])
    assert late.status == 200 and not late.clean_end
    assert json.loads(late.data_events[-1].data or "")["error"]["code"] == "cancelled"
    assert seqs(late) == list(range(4, 4 + len(late.ids)))


def test_random_disconnect_points_always_give_the_uninterrupted_text(
        resumable: Callable[..., RunningSidecar]) -> None:
    sidecar = resumable(resume_grace_s=5.0)
    rng = random.Random(1234)
    tokens = 30
    total_events = tokens + 4  # role, tokens, finish, usage, [DONE]
    for run in range(25):
        response = start_stream(sidecar, tokens=tokens, delay_s=0.002,
                                stop_after=rng.randint(1, total_events - 1),
                                headers={"x-request-id": f"random-{run}"})
        stream_id = response.stream_id
        # Several drops in a row on the reconnects too.
        received = resume_through_drops(sidecar.port, response, rng)
        ids = [e.id for e in received]
        assert ids == [f"{stream_id}.{n}" for n in range(1, total_events + 1)], (run, ids)
        assert text_of(received) == expected_text(tokens)
        assert received[-1].data == "[DONE]"


def test_the_per_stream_cap_makes_a_resume_past_it_fail_in_band(
        resumable: Callable[..., RunningSidecar]) -> None:
    sidecar = resumable(resume_max_bytes=1500)
    full = start_stream(sidecar, tokens=40)
    assert full.clean_end and text_of(full.events) == expected_text(40)  # the live client is unaffected
    late = resume(sidecar.port, full.stream_id, full.ids[2])
    assert late.status == 200 and not late.clean_end
    error = json.loads(late.data_events[-1].data or "")["error"]
    assert error["code"] == "resume_unavailable"
    assert 3 < len(late.ids) < 40


def test_a_plain_json_answer_leaves_nothing_in_the_store(
        resumable: Callable[..., RunningSidecar], loop_thread: Any) -> None:
    sidecar = resumable()
    answer = exchange(sidecar.port, "POST", PATH, body=chat_body(stream=False))
    assert answer.status == 200 and "x-tokenwire-stream-id" not in answer.headers
    store = sidecar.sidecar.context.replay_store  # type: ignore[union-attr]
    wait_for(lambda: loop_thread.call(lambda: len(store)) == 0)
