"""WireStream: one table of cases per rule of the state machine; time injected, never slept."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenwire.middleware import (
    AbortUpstream,
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    ErrorCode,
    FailureKind,
    Finished,
    LocalProtocolError,
    PauseUpstream,
    ResumeUpstream,
    RetryBudget,
    RetryUpstream,
    SlowClientPolicy,
    SocketPaused,
    SocketResumed,
    SSEEvent,
    SSEParser,
    StopRequested,
    StreamState,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
    encode,
)
from tokenwire.middleware.core.retry import may_repeat
from tokenwire.middleware.core.stream import HEARTBEAT

from .wire_harness import (
    PROXY_DEFAULTS,
    SSE_HEADERS,
    Driver,
    chunk,
    event,
    parse_all,
    proxy_config,
    texts,
    tool_args,
)

DONE = "[DONE]"


def header_dict(commit: CommitHeaders) -> dict[bytes, bytes]:
    return dict(commit.headers)


def error_of(data: str | None) -> dict[str, Any]:
    assert data is not None
    obj = json.loads(data)
    assert set(obj) == {"error"} and set(obj["error"]) == {"message", "type", "code", "tokenwire"}, obj
    assert obj["error"]["tokenwire"]["code"] == obj["error"]["code"], obj
    # Every error carries its stable number beside its name, as errors.ERROR_TABLE lists it.
    assert obj["error"]["tokenwire"]["number"] == ErrorCode(obj["error"]["code"]).number, obj
    return obj["error"]  # type: ignore[no-any-return]


# ------------------------------------------------------------------ header commit


def test_commit_when_first_event_arrives_then_sse_headers_committed_at_once() -> None:
    d = Driver(proxy_config(commit_deadline_s=2.0))
    d.send(UpstreamHeaders(200, (*SSE_HEADERS, (b"x-request-id", b"abc"), (b"content-length", b"9"),
                                 (b"connection", b"keep-alive"))), at=0.1)
    assert d.of(CommitHeaders) == []
    d.send(event(chunk("hi")), at=0.3)
    commit = d.commit
    headers = header_dict(commit)
    assert commit.status == 200 and commit.streaming
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache, no-transform"
    assert headers[b"x-accel-buffering"] == b"no"
    assert headers[b"x-request-id"] == b"abc"
    assert b"content-length" not in headers and b"connection" not in headers
    assert d.stream.state is StreamState.STREAMING
    assert texts(parse_all(d.written)) == "hi"


@pytest.mark.parametrize("deadline_s", [0.5, 2.0])
@pytest.mark.parametrize("headers_first", [True, False], ids=["upstream_answered", "upstream_silent"])
def test_commit_when_no_event_by_deadline_then_committed_at_deadline(
        deadline_s: float, headers_first: bool) -> None:
    d = Driver(proxy_config(commit_deadline_s=deadline_s))
    if headers_first:
        d.sse_headers(at=0.1)
    assert d.stream.next_deadline() == pytest.approx(deadline_s)
    d.send(Tick(), at=deadline_s - 0.001)
    assert d.of(CommitHeaders) == []
    d.send(Tick(), at=deadline_s)
    assert d.commit.status == 200 and d.commit.streaming
    assert d.stream.state is StreamState.COMMITTED
    assert d.written == b""


def test_commit_when_request_not_streamed_then_no_deadline_until_upstream_answers() -> None:
    d = Driver(proxy_config(commit_deadline_s=1.0), expect_stream=False)
    d.send(Tick(), at=5.0)
    assert d.of(CommitHeaders) == []
    d.sse_headers(at=6.0)
    d.send(Tick(), at=7.0)
    assert d.commit.status == 200


# ------------------------------------------------------------------ retries before the first byte


def fail_connect(d: Driver) -> None:
    d.send(UpstreamFailed(FailureKind.CONNECT, "refused"))


def fail_status(status: int) -> Any:
    def go(d: Driver) -> None:
        d.send(UpstreamHeaders(status, ((b"content-type", b"application/json"),)))
    return go


def fail_eof(d: Driver) -> None:
    d.sse_headers()
    d.send(UpstreamEnded())


def fail_protocol(d: Driver) -> None:
    d.sse_headers()
    d.send(UpstreamFailed(FailureKind.PROTOCOL, "connection reset"))


FAILURES = {
    "connect": (fail_connect, False),
    "status_502": (fail_status(502), True),
    "status_503": (fail_status(503), True),
    "status_504": (fail_status(504), True),
    "eof_before_event": (fail_eof, False),
    "protocol_before_event": (fail_protocol, False),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_retry_when_upstream_fails_before_first_byte_then_retried_with_backoff(name: str) -> None:
    fail, upstream_left_open = FAILURES[name]
    config = proxy_config(retry_attempts=3, retry_backoff_s=0.1, retry_backoff_max_s=0.3,
                        commit_deadline_s=100)
    d = Driver(config)
    expected_delays = [0.1, 0.2, 0.3]  # doubled, then capped
    for attempt, delay in enumerate(expected_delays, start=1):
        start = d.now
        before = len(d.actions)
        fail(d)
        new = d.actions[before:]
        assert [a for a in new if isinstance(a, RetryUpstream)] == []
        aborts = [a for a in new if isinstance(a, AbortUpstream)]
        # A connection still open (a 502 body, an error event) is closed, never reused.
        assert len(aborts) == (1 if upstream_left_open else 0)
        assert d.stream.next_deadline() == pytest.approx(start + delay)
        d.send(Tick(), at=start + delay - 0.001)
        assert d.of(RetryUpstream)[attempt - 1:] == []
        d.send(Tick(), at=start + delay)
        assert d.of(RetryUpstream)[-1] == RetryUpstream(attempt=attempt)
    assert d.of(CommitHeaders) == []
    assert d.stream.state is StreamState.WAITING
    # The retried attempt succeeds: nothing of the failed ones reaches the client.
    d.sse_headers()
    d.send(event(chunk("ok")))
    d.send(event(DONE))
    d.send(UpstreamEnded())
    assert d.commit.status == 200
    assert [e.data for e in parse_all(d.written)] == [chunk("ok"), DONE]
    record = d.finished.record
    assert (record.retries, record.end_reason) == (3, EndReason.COMPLETE)


@pytest.mark.parametrize(("retry_after", "delay_s"), [
    (b"1", 1.0),        # longer than the backoff: waited
    (b"0", 0.1),        # shorter: the backoff
    (b" 3 ", 3.0),
    (b"Wed, 21 Oct 2026 07:28:00 GMT", 0.1),  # an HTTP-date is not read: the backoff
    (b"soon", 0.1),
    (b"9" * 400, 0.1),  # no float that large: garbage, not a wait (and no crash of the core)
])
def test_retry_when_503_says_retry_after_then_the_retry_waits_at_least_that(
        retry_after: bytes, delay_s: float) -> None:
    """The engine's own word on when to come back: an SDK reading it directly
    waits it, so a proxy retrying sooner only adds load where it was refused."""
    d = Driver(proxy_config(retry_attempts=2, retry_backoff_s=0.1, commit_deadline_s=100))
    start = d.now
    d.send(UpstreamHeaders(503, ((b"content-type", b"application/json"), (b"retry-after", retry_after))))
    assert d.stream.next_deadline() == pytest.approx(start + delay_s)
    d.send(Tick(), at=start + delay_s - 0.001)
    assert d.of(RetryUpstream) == []
    d.send(Tick(), at=start + delay_s)
    assert d.of(RetryUpstream) == [RetryUpstream(attempt=1)]


def test_retry_when_retry_after_exceeds_the_bound_then_the_client_gets_the_answer() -> None:
    """Longer than ``retry_after_max_s``: no retry, the 503 and its Retry-After
    go to the client, whose own retry then waits (a held request would not)."""
    d = Driver(proxy_config(retry_attempts=2, retry_backoff_s=0.1, retry_after_max_s=5))
    d.send(UpstreamHeaders(503, ((b"content-type", b"application/json"), (b"retry-after", b"30"))))
    d.send(UpstreamData(b'{"detail":"busy"}'))
    d.send(UpstreamEnded())
    assert d.of(RetryUpstream) == []
    assert d.commit.status == 503 and header_dict(d.commit)[b"retry-after"] == b"30"
    assert d.written == b'{"detail":"busy"}'


def test_retry_when_retry_after_ignored_by_config_then_the_backoff() -> None:
    d = Driver(proxy_config(retry_attempts=2, retry_backoff_s=0.1, retry_after_max_s=0))
    start = d.now
    d.send(UpstreamHeaders(503, ((b"content-type", b"application/json"), (b"retry-after", b"30"))))
    assert d.stream.next_deadline() == pytest.approx(start + 0.1)


EXHAUSTED = {
    # name: (status, retry-after, error code or None for the upstream's own body)
    "connect": (502, b"1", "upstream_unavailable"),
    "status_502": (502, None, None),
    "status_503": (503, None, None),
    "eof_before_event": (502, None, "upstream_failed"),
}


@pytest.mark.parametrize("name", list(EXHAUSTED))
def test_retry_when_attempts_exhausted_then_real_status_with_json_body(name: str) -> None:
    fail = FAILURES[name][0]
    status, retry_after, code = EXHAUSTED[name]
    d = Driver(proxy_config(retry_attempts=1, retry_backoff_s=0.1))
    fail(d)
    d.send(Tick(), at=d.now + 0.1)
    assert len(d.of(RetryUpstream)) == 1
    fail(d)
    if code is None:  # the upstream's own error answer is passed through unchanged
        d.send(UpstreamData(b'{"detail":"busy"}'))
        d.send(UpstreamEnded())
    commit = d.commit
    assert commit.status == status and not commit.streaming
    assert header_dict(commit).get(b"retry-after") == retry_after
    # Retried here already: the OpenAI SDKs must not multiply the attempts.
    assert header_dict(commit)[b"x-should-retry"] == b"false"
    if code is not None:
        assert error_of(d.written.decode())["code"] == code
        assert header_dict(commit)[b"content-length"] == str(len(d.written)).encode()
    else:
        assert d.written == b'{"detail":"busy"}'
    assert len(d.of(Finished)) == 1
    assert d.finished.record.status == status


def test_retry_when_not_retried_then_client_may_retry() -> None:
    d = Driver(proxy_config(retry_attempts=0))
    fail_status(503)(d)
    d.send(UpstreamData(b'{"detail":"busy"}'))
    d.send(UpstreamEnded())
    assert d.commit.status == 503 and b"x-should-retry" not in header_dict(d.commit)


@pytest.mark.parametrize(("payload", "status"), [
    # vLLM / SGLang / our engine: the HTTP status as the code
    ({"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}}, 400),
    ({"error": {"message": "no such model", "type": "NotFoundError", "code": "404"}}, 404),
    ({"object": "error", "message": "m", "error": {"message": "x", "code": None}, "status": 422}, 422),
    # OpenAI: a string code, the type says whose fault
    ({"error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                "code": "context_length_exceeded"}}, 400),
    ({"error": "Input validation error: max_new_tokens", "error_type": "validation"}, 400),  # TGI
    ({"error": {"message": "overloaded", "type": "server_error", "code": "busy"}}, 502),
    ({"error": {"message": "engine crashed", "type": "server_error", "code": 500}}, 500),
], ids=["vllm_400", "string_404", "top_level_status", "openai_invalid_request", "tgi_validation",
        "server_error", "numeric_500"])
def test_error_event_first_then_engines_status_and_body_never_retried(
        payload: dict[str, Any], status: int) -> None:
    d = Driver(proxy_config(retry_attempts=3))
    d.sse_headers()
    d.send(event(json.dumps(payload)))
    assert d.of(RetryUpstream) == [] and d.stream.next_deadline() is None
    commit = d.commit
    assert commit.status == status and not commit.streaming
    headers = header_dict(commit)
    assert headers[b"content-type"] == b"application/json"
    # Straight from the engine the SDK would have raised without retrying.
    assert headers[b"x-should-retry"] == b"false"
    body = json.loads(d.written)
    if isinstance(payload["error"], dict):
        # Forwarded as it came; tokenwire's own code beside the engine's fields.
        assert body == {**payload, "error": {**payload["error"], **OURS}}
    else:
        assert body["error"]["message"] == payload["error"]
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_ERROR)]
    record = d.finished.record
    assert (record.end_reason, record.status, record.retries) == (EndReason.UPSTREAM_ERROR, status, 0)


def test_retry_when_upstream_headers_timeout_then_504_after_abort() -> None:
    d = Driver(proxy_config(retry_attempts=0, upstream_headers_timeout_s=5.0, commit_deadline_s=10.0))
    assert d.stream.next_deadline() == 5.0
    d.send(Tick(), at=5.0)
    assert d.of(AbortUpstream)[0] == AbortUpstream(EndReason.UPSTREAM_TIMEOUT)
    assert d.commit.status == 504
    assert d.finished.record.end_reason is EndReason.UPSTREAM_TIMEOUT


@pytest.mark.parametrize("name", ["connect", "eof_before_event", "protocol_before_event", "status_502"])
def test_retry_when_committed_by_deadline_then_never_retried_but_in_band_error(name: str) -> None:
    d = Driver(proxy_config(commit_deadline_s=1.0, retry_attempts=5))
    d.send(Tick(), at=1.0)
    assert d.commit.streaming
    FAILURES[name][0](d)
    if name.startswith("status_"):
        d.send(UpstreamEnded())  # the error answer's (empty) body is read for its message
    d.send(Tick(), at=10.0)
    assert d.of(RetryUpstream) == []
    events = parse_all(d.written)
    assert error_of(events[-1].data)["code"] in ("upstream_unavailable", "upstream_failed")
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"error":{"message":"The server is overloaded","type":"server_error","code":"overloaded"}}',
     {"message": "The server is overloaded", "type": "server_error", "code": "overloaded",
      "tokenwire": {"code": "upstream_failed", "number": "E7307"}}),
    (b"<html>\n  Service Unavailable\n</html>",
     {"message": "upstream answered 503: <html> Service Unavailable </html>", "type": "upstream_error",
      "code": "upstream_failed", "tokenwire": {"code": "upstream_failed", "number": "E7307"}}),
], ids=["error_object", "text"])
def test_error_status_after_the_commit_then_its_body_is_the_in_band_error(
        body: bytes, expected: dict[str, Any]) -> None:
    """Retries that outlast commit_deadline_s: the upstream's last answer, an
    error status, can only travel in-band, and its body says what went wrong."""
    d = Driver(proxy_config(commit_deadline_s=1.0, retry_attempts=0))
    d.send(Tick(), at=1.0)
    d.send(UpstreamHeaders(503, ((b"content-type", b"application/json"),)), at=1.5)
    d.send(UpstreamData(body[:10]), at=1.6)
    assert not d.stream.finished  # waits for the rest of the body
    d.send(UpstreamData(body[10:]), at=1.7)
    d.send(UpstreamEnded(), at=1.8)
    events = parse_all(d.written)
    assert json.loads(events[-1].data or "") == {"error": expected}
    assert d.of(CloseClient) == [CloseClient(abrupt=True)] and d.of(AbortUpstream) == []
    assert d.finished.record.end_reason is EndReason.UPSTREAM_ERROR


def test_retry_when_after_first_event_then_never_retried() -> None:
    d = Driver(proxy_config(retry_attempts=5))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(UpstreamFailed(FailureKind.PROTOCOL, "reset"))
    d.send(Tick(), at=60.0)
    assert d.of(RetryUpstream) == []
    assert error_of(parse_all(d.written)[-1].data)["code"] == "upstream_failed"


def test_retry_budget_when_outage_then_shared_budget_refuses_most_retries() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, now=0.0, capacity=2.0)
    config = proxy_config(retry_attempts=2, retry_backoff_s=0.0)
    drivers = []
    for _ in range(30):  # requests arrive one after another, all during the outage
        d = Driver(config, retry_budget=budget)
        drivers.append(d)
        for _ in range(config.retry_attempts + 1):
            d.send(UpstreamFailed(FailureKind.CONNECT, "down"))
        assert d.stream.finished
    retries = sum(len(d.of(RetryUpstream)) for d in drivers)
    # 2 tokens to start with + 0.1 per request; each retry takes one. Without the
    # budget the 30 streams would have retried 60 times.
    assert retries == budget.granted <= 2.0 + 0.1 * 30
    assert retries >= 4
    assert sum(d.finished.record.refused_retries for d in drivers) == budget.refused >= 25
    assert all(d.commit.status == 502 for d in drivers)


def test_retry_budget_when_quiet_then_floor_refills() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=1.0, now=0.0, capacity=1.0)
    config = proxy_config(retry_attempts=1, retry_backoff_s=0.0)
    first = Driver(config, retry_budget=budget)
    first.send(UpstreamFailed(FailureKind.CONNECT, "down"))
    second = Driver(config, retry_budget=budget)
    second.send(UpstreamFailed(FailureKind.CONNECT, "down"))
    third = Driver(config, retry_budget=budget, now=1.0)
    third.send(UpstreamFailed(FailureKind.CONNECT, "down"))
    assert [len(d.of(RetryUpstream)) for d in (first, second, third)] == [1, 0, 1]


# ------------------------------------------------------------------ requests that may not be repeated

# Which failures still retry a request that may not reach an upstream twice
# (a POST without Idempotency-Key): only those proving nothing was processed.
UNREPEATABLE_RETRIED = {
    "connect": True,  # no connection: nothing was sent
    "status_503": True,  # the upstream refused to take it on
    "status_502": False,
    "status_504": False,
    "eof_before_event": False,  # the engine may be generating still
    "protocol_before_event": False,
}


@pytest.mark.parametrize("name", list(UNREPEATABLE_RETRIED))
def test_retry_when_request_may_not_be_repeated_then_only_unprocessed_failures_retried(name: str) -> None:
    config = proxy_config(retry_attempts=3, retry_backoff_s=0.1, commit_deadline_s=100)
    d = Driver(config, may_repeat=False)
    FAILURES[name][0](d)
    d.send(Tick(), at=1.0)
    retried = UNREPEATABLE_RETRIED[name]
    assert len(d.of(RetryUpstream)) == (1 if retried else 0)
    if not retried:
        # Sent once: the client gets the failure, nothing goes upstream again.
        if name.startswith("status_"):
            d.send(UpstreamEnded())
        assert d.commit.status in (502, 503, 504)
        assert d.finished.record.retries == 0


def test_retry_when_upstream_times_out_on_unrepeatable_request_then_not_sent_again() -> None:
    d = Driver(proxy_config(retry_attempts=3, upstream_headers_timeout_s=5.0, commit_deadline_s=100),
               may_repeat=False)
    d.send(Tick(), at=5.0)
    assert d.of(RetryUpstream) == []
    assert d.commit.status == 504


@pytest.mark.parametrize(("method", "headers", "expected"), [
    (b"GET", (), True), (b"HEAD", (), True), (b"PUT", (), True), (b"DELETE", (), True),
    (b"OPTIONS", (), True), (b"get", (), True),
    (b"POST", (), False), (b"PATCH", (), False),
    (b"POST", ((b"idempotency-key", b"k1"),), True),
    (b"POST", ((b"idempotency-key", b"  "),), False),
])
def test_may_repeat_when_method_or_idempotency_key_then_rfc9110_idempotence(
        method: bytes, headers: tuple[tuple[bytes, bytes], ...], expected: bool) -> None:
    assert may_repeat(method, headers) is expected


# ------------------------------------------------------------------ a hung upstream


def test_upstream_idle_when_upstream_stops_after_first_event_then_in_band_timeout_and_abort() -> None:
    d = committed(proxy_config(upstream_idle_timeout_s=30.0, heartbeat_s=10.0), at=1.0)
    assert d.stream.next_deadline() == pytest.approx(11.0)  # the heartbeat comes first
    for at in (11.0, 21.0):
        d.send(Tick(), at=at)
    assert d.writes.count(HEARTBEAT) == 2 and d.of(AbortUpstream) == []
    assert d.stream.next_deadline() == pytest.approx(31.0)
    d.send(Tick(), at=30.999)
    assert d.of(AbortUpstream) == []
    d.send(Tick(), at=31.0)
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_TIMEOUT)]
    assert error_of(parse_all(d.written)[-1].data)["code"] == "upstream_timeout"
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    record = d.finished.record
    assert record.end_reason is EndReason.UPSTREAM_TIMEOUT and record.error_code == "upstream_timeout"


def test_upstream_idle_when_each_byte_comes_in_time_then_never_timed_out() -> None:
    d = committed(proxy_config(upstream_idle_timeout_s=5.0, heartbeat_s=0), at=0.0)
    for i in range(1, 20):
        d.send(UpstreamData(f"data: {chunk(str(i))}\n\n".encode()), at=4.0 * i)
        d.send(Tick(), at=4.0 * i + 3.9)
    assert d.of(AbortUpstream) == [] and not d.stream.finished


def test_upstream_idle_when_bytes_take_the_keeps_up_path_then_they_count_too() -> None:
    d = committed(proxy_config(upstream_idle_timeout_s=5.0, heartbeat_s=0), at=0.0)
    d.send(UpstreamData(f"data: {chunk('a')}\n\n".encode()), at=1.0)  # now STREAMING
    for i in range(1, 20):
        out = d.stream.forward_read(f"data: {chunk(str(i))}\n\n".encode(), 1.0 + 4.0 * i)
        assert out is not None  # the one-call path took it
        d.send(Tick(), at=1.0 + 4.0 * i + 3.9)
    assert d.of(AbortUpstream) == [] and not d.stream.finished
    d.send(Tick(), at=1.0 + 4.0 * 19 + 5.0)
    assert d.finished.record.end_reason is EndReason.UPSTREAM_TIMEOUT


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["read", "read", "read", "tick", "pause", "resume"]),
                          st.sampled_from([0.0, 0.1, 0.4, 0.9, 1.0, 2.5])), max_size=60))
def test_property_keeps_up_path_never_takes_a_read_once_a_timer_is_due(ops: list[tuple[str, float]]) -> None:
    # forward_read checks a bound on next_deadline() kept from the last input
    # (only later deadlines can follow on its own path): whatever the
    # interleaving, a read it takes must be one no timer was due before.
    config = proxy_config(heartbeat_s=1.0, upstream_idle_timeout_s=2.0, write_deadline_s=1.5)
    stream = WireStream(config, now=0.0, request_id="bound")
    stream.handle(UpstreamHeaders(200, SSE_HEADERS), 0.0)
    now = 0.0
    taken = 0
    for op, step_s in ops:
        now += step_s
        if stream.finished:
            break
        if op == "read":
            due = stream.next_deadline()
            data = f"data: {chunk('t')}\n\n".encode()
            out = stream.forward_read(data, now)
            if out is not None:
                assert due is None or now < due, (due, now)
                assert out == data
                taken += 1
                continue
            stream.handle(UpstreamData(data), now)
            if stream.data_to_send(now):
                stream.handle(WriteCompleted(), now)
            continue
        event = Tick() if op == "tick" else SocketPaused() if op == "pause" else SocketResumed()
        if any(isinstance(action, AbortUpstream) for action in stream.handle(event, now)):
            break  # the upstream is gone: no more reads come
    assert taken <= sum(op == "read" for op, _ in ops)


def test_upstream_idle_when_core_paused_the_upstream_then_silence_not_counted() -> None:
    config = proxy_config(upstream_idle_timeout_s=5.0, heartbeat_s=0,
                        slow_client_policy=SlowClientPolicy.BLOCK, max_pending_bytes=4096,
                        write_deadline_s=1000.0)
    d = Driver(config, auto_complete=False)
    d.sse_headers(at=0.0)
    for _ in range(40):
        d.send(event(chunk("x" * 100)), at=1.0)
        if d.of(PauseUpstream):
            break  # the driver stops reading
    assert d.of(PauseUpstream)
    d.send(Tick(), at=100.0)  # the client took its time; the upstream waited for us
    assert d.of(AbortUpstream) == []
    while d.in_flight:
        d.complete()
    assert d.of(ResumeUpstream)
    d.send(Tick(), at=104.9)
    assert d.of(AbortUpstream) == []
    d.send(Tick(), at=105.0)
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_TIMEOUT)]


def test_upstream_idle_when_passthrough_body_hangs_then_abrupt_close_and_abort() -> None:
    d = Driver(proxy_config(upstream_idle_timeout_s=5.0), expect_stream=False)
    d.send(UpstreamHeaders(200, ((b"content-type", b"application/json"),)), at=0.0)
    d.send(UpstreamData(b'{"a":'), at=1.0)
    d.send(Tick(), at=6.0)
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_TIMEOUT)]
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.written == b'{"a":'


def test_upstream_idle_when_upstream_never_answers_then_headers_timeout_not_idle() -> None:
    d = Driver(proxy_config(upstream_idle_timeout_s=1.0, upstream_headers_timeout_s=50.0,
                          commit_deadline_s=100.0, retry_attempts=0))
    assert d.stream.next_deadline() == 50.0
    d.send(Tick(), at=50.0)
    assert d.commit.status == 504


@pytest.mark.parametrize("committed_first", [True, False], ids=["streaming", "waiting"])
def test_max_stream_duration_when_reached_then_ended_with_timeout_whatever_the_upstream_does(
        committed_first: bool) -> None:
    config = proxy_config(max_stream_duration_s=60.0, heartbeat_s=0, commit_deadline_s=100.0,
                        upstream_headers_timeout_s=1000.0)
    d = committed(config) if committed_first else Driver(config)
    for at in range(1, 60) if committed_first else ():
        d.send(event(chunk("t")), at=float(at))  # a lively upstream, just a long one
    assert d.stream.next_deadline() == pytest.approx(60.0)
    d.send(Tick(), at=60.0)
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_TIMEOUT)]
    if committed_first:
        assert error_of(parse_all(d.written)[-1].data)["code"] == "upstream_timeout"
    else:
        assert d.commit.status == 504
    assert d.finished.record.end_reason is EndReason.UPSTREAM_TIMEOUT


def test_max_stream_duration_when_off_then_no_deadline_from_it() -> None:
    d = committed(proxy_config(heartbeat_s=0, upstream_idle_timeout_s=0))
    assert PROXY_DEFAULTS.max_stream_duration_s == 0
    assert d.stream.next_deadline() is None


# ------------------------------------------------------------------ passthrough


def test_passthrough_when_upstream_answers_json_then_bytes_unchanged_and_clean_close() -> None:
    d = Driver(expect_stream=False)
    d.send(UpstreamHeaders(200, ((b"content-type", b"application/json"), (b"content-length", b"12"),
                                 (b"transfer-encoding", b"chunked"))))
    assert d.commit == CommitHeaders(200, ((b"content-type", b"application/json"),
                                           (b"content-length", b"12")), streaming=False)
    d.send(UpstreamData(b'{"a":'))
    d.send(UpstreamData(b'"data: x"}'))
    d.send(UpstreamEnded())
    assert d.written == b'{"a":"data: x"}'
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    assert d.finished.record.end_reason is EndReason.COMPLETE


def test_passthrough_when_socket_paused_over_half_the_cap_then_upstream_paused_then_resumed() -> None:
    d = Driver(proxy_config(max_pending_bytes=1000), expect_stream=False)
    d.send(UpstreamHeaders(400, ((b"content-type", b"application/json"),)))
    d.send(SocketPaused())
    d.send(UpstreamData(b"x" * 400))
    assert d.of(PauseUpstream) == []
    d.send(UpstreamData(b"y" * 100))
    assert d.of(PauseUpstream) == [PauseUpstream()]
    d.send(SocketResumed())
    assert d.written == b"x" * 400 + b"y" * 100
    assert d.of(ResumeUpstream) == [ResumeUpstream()]


def test_passthrough_when_client_stops_reading_past_cap_then_slow_client() -> None:
    d = Driver(proxy_config(max_pending_bytes=1000), expect_stream=False)
    d.send(UpstreamHeaders(200, ((b"content-type", b"application/json"),)))
    d.send(SocketPaused())
    d.send(UpstreamData(b"x" * 1001))
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    assert d.finished.record.error_code is ErrorCode.BACKPRESSURE_EXCEEDED


def test_passthrough_when_upstream_breaks_then_abrupt_close_without_injected_bytes() -> None:
    d = Driver(expect_stream=False)
    d.send(UpstreamHeaders(200, ((b"content-type", b"application/json"),)))
    d.send(UpstreamData(b'{"partial'))
    d.send(UpstreamFailed(FailureKind.PROTOCOL, "reset"))
    assert d.written == b'{"partial'
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]


# ------------------------------------------------------------------ heartbeats


def committed(config: WireConfig, at: float = 0.0) -> Driver:
    d = Driver(config)
    d.sse_headers(at=at)
    d.send(event(chunk("a")), at=at)
    return d


@pytest.mark.parametrize("heartbeat_s", [1.0, 15.0])
def test_heartbeat_when_silent_for_heartbeat_s_then_keepalive_written(heartbeat_s: float) -> None:
    d = committed(proxy_config(heartbeat_s=heartbeat_s), at=2.0)
    assert d.stream.next_deadline() == pytest.approx(2.0 + heartbeat_s)
    d.send(Tick(), at=2.0 + heartbeat_s - 0.01)
    assert d.writes[-1] != HEARTBEAT
    d.send(Tick(), at=2.0 + heartbeat_s)
    assert d.writes[-1] == HEARTBEAT
    # The timer restarts at each write.
    d.send(Tick(), at=2.0 + 2 * heartbeat_s - 0.01)
    assert d.writes.count(HEARTBEAT) == 1
    d.send(Tick(), at=2.0 + 2 * heartbeat_s)
    assert d.writes.count(HEARTBEAT) == 2
    assert d.stream.record(d.now).heartbeats == 2


def test_heartbeat_when_before_first_event_then_keepalive_after_commit() -> None:
    d = Driver(proxy_config(commit_deadline_s=2.0, heartbeat_s=5.0))
    d.sse_headers()
    d.send(Tick(), at=2.0)
    assert d.writes == []
    assert d.stream.next_deadline() == 7.0
    d.send(Tick(), at=7.0)
    assert d.writes == [HEARTBEAT]
    assert [e.comment for e in parse_all(d.written)] == [" keepalive"]


def test_heartbeat_when_content_written_then_timer_restarts() -> None:
    d = committed(proxy_config(heartbeat_s=5.0))
    d.send(event(chunk("b")), at=4.0)
    d.send(Tick(), at=8.0)
    assert HEARTBEAT not in d.writes
    d.send(Tick(), at=9.0)
    assert d.writes[-1] == HEARTBEAT


@pytest.mark.parametrize("stall", ["paused", "write_in_flight"])
def test_heartbeat_when_data_pending_then_none(stall: str) -> None:
    d = committed(proxy_config(heartbeat_s=1.0, write_deadline_s=30.0))
    if stall == "paused":
        d.send(SocketPaused(), at=0.5)
    else:
        d.auto_complete = False
    d.send(event(chunk("b")), at=0.5)
    d.send(event(chunk("c")), at=0.6)
    for t in (2.0, 5.0, 20.0):
        d.send(Tick(), at=t)
    assert HEARTBEAT not in d.writes
    assert d.stream.record(d.now).heartbeats == 0


def test_heartbeat_when_disabled_then_never() -> None:
    d = committed(proxy_config(heartbeat_s=0.0, upstream_idle_timeout_s=0))
    assert d.stream.next_deadline() is None
    d.send(Tick(), at=1000.0)
    assert HEARTBEAT not in d.writes


def test_heartbeat_when_upstream_sends_comments_then_not_forwarded_but_own_heartbeats() -> None:
    d = committed(proxy_config(heartbeat_s=10.0))
    d.send(UpstreamData(b": ping\n\n: ping\n\n"), at=3.0)
    assert all(e.comment is None for e in parse_all(d.written))
    assert d.stream.upstream_comments == 2


# ------------------------------------------------------------------ coalescing through the stream


def test_coalesce_when_socket_paused_then_text_deltas_merged_and_barriers_kept() -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk(role="assistant", text="")))
    d.send(SocketPaused())
    for piece in ["Hel", "lo", ", \"wor", "ld\"\n", "é🙂"]:
        d.send(event(chunk(piece)))
    d.send(event(chunk(extra_delta={"tool_calls": [{"index": 0, "id": "t"}]})))
    d.send(event(chunk("!")))
    d.send(event(chunk(finish="stop")))
    d.send(event(DONE))
    d.send(SocketResumed())
    d.send(UpstreamEnded())
    events = parse_all(d.written)
    assert texts(events) == 'Hello, "world"\né🙂!'
    assert len(d.writes) == 2  # the role chunk, then everything pending in one write
    assert [json.loads(e.data)["choices"][0]["delta"] if e.data != DONE else DONE
            for e in events] == [
        {"role": "assistant", "content": ""}, {"content": 'Hello, "world"\né🙂'},
        {"tool_calls": [{"index": 0, "id": "t"}]}, {"content": "!"}, {}, DONE]
    record = d.finished.record
    assert (record.events_in, record.events_out, record.coalesced_events) == (10, 6, 4)


def test_coalesce_when_write_outstanding_then_events_queue_and_merge() -> None:
    d = Driver(auto_complete=False)
    d.sse_headers()
    d.send(event(chunk("a")))
    assert len(d.writes) == 1
    d.send(event(chunk("b")))
    d.send(event(chunk("c")))
    assert len(d.writes) == 1 and d.stream.backpressured
    d.complete()
    assert len(d.writes) == 2
    assert [texts([e]) for e in parse_all(d.writes[1])] == ["bc"]


def test_coalesce_window_when_coalesce_ms_set_then_writes_batched_for_window() -> None:
    d = Driver(proxy_config(coalesce_ms=20.0))
    d.sse_headers(at=0.0)
    d.send(event(chunk("a")), at=0.0)
    assert d.writes == []
    assert d.stream.next_deadline() == pytest.approx(0.02)
    d.send(event(chunk("b")), at=0.01)
    d.send(Tick(), at=0.02)
    assert [texts(parse_all(w)) for w in d.writes] == ["ab"]


# ------------------------------------------------------------------ slow-client policies


def test_drop_when_socket_paused_then_newest_per_event_type_kept_and_done_never_dropped() -> None:
    # A state stream of named events is no OpenAI stream: generic, ended by the
    # operator's marker.
    d = Driver(proxy_config(slow_client_policy=SlowClientPolicy.DROP, terminal_marker=DONE,
                            droppable_event_types=("progress", "status")))
    d.sse_headers()
    d.send(event("p0", event="progress"))
    d.send(SocketPaused())
    for i in range(1, 6):
        d.send(event(f"p{i}", event="progress"))
        d.send(event(f"s{i}", event="status"))
    d.send(event(DONE))
    d.send(SocketResumed())
    told = ("tokenwire.dropped", '{"dropped":4}')
    assert [(e.event, e.data) for e in parse_all(d.written)] == [
        ("progress", "p0"), told, ("progress", "p5"), told, ("status", "s5"), (None, DONE)]
    record = d.finished.record
    assert record.dropped_events == 8 and record.end_reason is EndReason.COMPLETE


def tool_calls(events: list[SSEEvent]) -> list[dict[str, Any]]:
    """Every tool-call delta among ``events``, in order."""
    return [call for e in events if e.data and e.data.startswith("{")
            for choice in json.loads(e.data).get("choices", [])
            for call in choice.get("delta", {}).get("tool_calls") or []]


def test_drop_when_answer_text_and_tool_calls_then_nothing_lost_and_text_merged() -> None:
    d = Driver(proxy_config(slow_client_policy=SlowClientPolicy.DROP, droppable_event_types=("progress",)))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(SocketPaused())
    for piece in ("b", "c", "d"):
        d.send(event(chunk(piece)))
    for fragment in ('{"x"', ': 1}'):
        d.send(event(tool_args(fragment)))
    d.send(event(chunk(finish="tool_calls")))
    d.send(event(DONE))
    d.send(SocketResumed())
    events = parse_all(d.written)
    assert texts(events) == "abcd"
    arguments = [call["function"]["arguments"] for call in tool_calls(events)]
    assert arguments == ['{"x": 1}']
    assert d.finished.record.dropped_events == 0 and d.finished.record.coalesced_events == 3


def test_slow_reader_when_one_tool_call_of_6000_fragments_then_exact_arguments_not_cut() -> None:
    """An agent writing a file: a large tool call merges like text instead of
    filling the pending buffer (it used to end in backpressure_exceeded)."""
    d = Driver()
    d.sse_headers()
    first = chunk(extra_delta={"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                               "function": {"name": "write_file", "arguments": ""}}]})
    d.send(event(first))
    d.send(SocketPaused())
    fragments = [f'line {i} "quoted" é\n' for i in range(6000)]
    # Unmerged, these events alone would be over the pending cap.
    unmerged_bytes = sum(len(f"data: {tool_args(f)}\n\n".encode()) for f in fragments)
    assert unmerged_bytes > PROXY_DEFAULTS.max_pending_bytes
    for fragment in fragments:
        d.send(event(tool_args(fragment)))
    d.send(event(chunk(finish="tool_calls")))
    d.send(event(DONE))
    d.send(SocketResumed())
    calls = tool_calls(parse_all(d.written))
    assert calls[0]["function"]["name"] == "write_file"
    assert "".join(c["function"]["arguments"] for c in calls) == "".join(fragments)
    record = d.finished.record
    assert record.end_reason is EndReason.COMPLETE and record.coalesced_events == 5999


def test_drop_when_upstream_error_while_paused_then_error_kept() -> None:
    d = Driver(proxy_config(slow_client_policy="drop"))  # type: ignore[arg-type]
    d.sse_headers()
    d.send(event("p0", event="progress"))
    d.send(SocketPaused())
    d.send(event("p1", event="progress"))
    d.send(UpstreamFailed(FailureKind.PROTOCOL, "reset"))
    d.send(SocketResumed())
    events = parse_all(d.written)
    assert [e.data for e in events[:2]] == ["p0", "p1"]
    assert error_of(events[-1].data)["code"] == "upstream_failed"


def test_block_when_pending_over_half_the_cap_then_upstream_paused_until_drained() -> None:
    d = Driver(proxy_config(slow_client_policy=SlowClientPolicy.BLOCK, max_pending_bytes=1000))
    d.sse_headers()
    d.send(event(chunk("start")))
    d.send(SocketPaused())
    sent = 0
    while not d.of(PauseUpstream):
        d.send(event(chunk(role="assistant")))  # barriers: nothing merges
        sent += 1
        assert sent < 100, "no PauseUpstream"
    assert d.stream.pending_bytes >= 500 and sent > 1
    assert d.of(ResumeUpstream) == []
    d.send(SocketResumed())
    assert d.of(ResumeUpstream) == [ResumeUpstream()]
    assert len(parse_all(d.written)) == sent + 1


@pytest.mark.parametrize("policy", [SlowClientPolicy.COALESCE, SlowClientPolicy.BLOCK])
def test_cap_when_pending_exceeds_max_pending_bytes_then_slow_client_reset(policy: SlowClientPolicy) -> None:
    d = Driver(proxy_config(max_pending_bytes=2000, slow_client_policy=policy))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(SocketPaused())
    for _ in range(100):
        assert d.stream.pending_bytes <= 2000
        d.send(event(chunk(role="assistant")))
        if d.stream.finished:
            break
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.SLOW_CLIENT)]
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    record = d.finished.record
    assert (record.end_reason, record.error_code) == (EndReason.SLOW_CLIENT,
                                                      ErrorCode.BACKPRESSURE_EXCEEDED)
    assert record.pending_high_water_bytes > 2000 >= d.stream.pending_bytes


@pytest.mark.parametrize("terminal", ["done", "upstream_error_event", "upstream_failed"])
def test_cap_when_terminal_event_would_exceed_cap_then_slow_client_too(terminal: str) -> None:
    d = Driver(proxy_config(max_pending_bytes=1000))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(SocketPaused())
    d.send(event("x" * (990 - len(b"event: e\ndata: \n\n")), event="e"))
    assert d.stream.pending_bytes == 990  # room left for less than any terminal event
    d.send({"done": event(DONE), "upstream_error_event": event('{"error":"boom"}'),
            "upstream_failed": UpstreamFailed(FailureKind.PROTOCOL, "reset")}[terminal])
    assert d.stream.pending_bytes <= 1000
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    expected = EndReason.SLOW_CLIENT if terminal == "done" else EndReason.UPSTREAM_ERROR
    assert d.finished.record.end_reason is expected  # a failing stream keeps its root cause


@pytest.mark.parametrize("stall", ["paused", "write_in_flight", "paused_nothing_pending"])
# write_in_flight: one write the client never takes, nothing queued behind it.
def test_write_deadline_when_no_progress_for_write_deadline_s_then_slow_client_send_timeout(
        stall: str) -> None:
    d = committed(proxy_config(write_deadline_s=30.0, heartbeat_s=5.0), at=1.0)
    if stall == "write_in_flight":
        d.auto_complete = False
    if stall != "write_in_flight":
        d.send(SocketPaused(), at=2.0)
    if stall != "paused_nothing_pending":
        d.send(event(chunk("b")), at=2.0)
    # Progress is the socket taking bytes: the last completed write, or the
    # start of the write that never completes.
    progress_at = 2.0 if stall == "write_in_flight" else 1.0
    d.send(Tick(), at=progress_at + 29.9)
    assert not d.stream.finished
    assert d.stream.next_deadline() == pytest.approx(progress_at + 30.0)
    d.send(Tick(), at=progress_at + 30.0)
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.SLOW_CLIENT)]
    assert d.finished.record.error_code is ErrorCode.SEND_TIMEOUT


def test_write_deadline_when_last_write_never_taken_then_stream_still_ends() -> None:
    d = Driver(proxy_config(write_deadline_s=30.0), auto_complete=False)
    d.sse_headers()
    d.send(event(chunk("a")), at=1.0)
    d.send(event(DONE), at=1.0)
    d.send(UpstreamEnded(), at=1.0)
    assert not d.stream.finished  # the write holding [DONE] is still outstanding
    assert d.stream.next_deadline() == pytest.approx(31.0)
    d.send(Tick(), at=31.0)
    assert d.of(CloseClient) == [CloseClient(abrupt=True, reset=True)]
    assert d.finished.record.end_reason is EndReason.SLOW_CLIENT


def test_write_deadline_when_socket_resumes_in_time_then_no_timeout() -> None:
    d = committed(proxy_config(write_deadline_s=30.0))
    d.send(SocketPaused(), at=1.0)
    d.send(event(chunk("b")), at=1.0)
    d.send(SocketResumed(), at=29.0)
    d.send(Tick(), at=40.0)
    assert not d.stream.finished
    assert texts(parse_all(d.written)) == "ab"


# ------------------------------------------------------------------ client gone


@pytest.mark.parametrize("phase", ["waiting_prefill", "waiting_after_headers", "streaming",
                                   "paused_with_pending", "done_not_flushed"])
def test_client_gone_then_upstream_aborted_at_once_and_finished(phase: str) -> None:
    d = Driver()
    if phase != "waiting_prefill":
        d.sse_headers()
    if phase in ("streaming", "paused_with_pending", "done_not_flushed"):
        d.send(event(chunk("a")))
    if phase in ("paused_with_pending", "done_not_flushed"):
        d.send(SocketPaused())
        d.send(event(chunk("b")))
    if phase == "done_not_flushed":
        d.send(event(DONE))
    actions = d.send(ClientGone(), at=1.0)
    assert AbortUpstream(EndReason.CLIENT_GONE) in actions
    assert not any(isinstance(a, CloseClient) for a in actions)
    record = d.finished.record
    assert (record.end_reason, record.error_code) == (EndReason.CLIENT_GONE, ErrorCode.CANCELLED)
    assert d.stream.state is StreamState.ABORTED
    assert d.stream.data_to_send(2.0) == b""
    assert d.stream.handle(UpstreamData(b"data: x\n\n"), 2.0) == []


def test_client_gone_when_upstream_already_ended_then_no_abort() -> None:
    d = Driver(auto_complete=False)
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(event(DONE))
    d.send(UpstreamEnded())
    actions = d.send(ClientGone())
    assert not any(isinstance(a, AbortUpstream) for a in actions)
    assert d.finished.record.end_reason is EndReason.CLIENT_GONE


# ------------------------------------------------------------------ terminal signal


def test_terminal_when_done_marker_then_finish_plus_done_and_clean_close() -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(event(chunk(finish="stop")))
    d.send(event(DONE))
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    assert parse_all(d.written)[-1].data == DONE
    assert d.stream.state is StreamState.DONE
    assert d.of(AbortUpstream) == []
    d.send(UpstreamEnded())
    assert len(d.of(Finished)) == 1


@pytest.mark.parametrize(("failure", "code"), [
    (UpstreamFailed(FailureKind.PROTOCOL, "reset"), "upstream_failed"),
    (UpstreamFailed(FailureKind.TIMEOUT, "read"), "upstream_timeout"),
    (UpstreamFailed(FailureKind.INVALID_STREAM, "bad"), "invalid_stream"),
    (UpstreamFailed(FailureKind.CONNECT, "gone"), "upstream_unavailable"),
    (UpstreamData(b"data: " + b"x" * 200), "invalid_stream"),  # line over max_line_bytes
    (UpstreamEnded(), "upstream_failed"),  # EOF without [DONE]
], ids=["protocol", "timeout", "invalid_stream", "connect", "line_too_long", "eof_without_done"])
def test_terminal_when_upstream_fails_after_commit_then_in_band_error_and_abrupt_close(failure: Any,
                                                                             code: str) -> None:
    d = Driver(proxy_config(max_line_bytes=100))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(failure)
    events = parse_all(d.written)
    assert texts(events) == "a"
    assert error_of(events[-1].data)["code"] == code
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.finished.record.end_reason in (EndReason.UPSTREAM_ERROR, EndReason.UPSTREAM_TIMEOUT)


def test_terminal_when_eof_mid_event_then_truncation_reported_in_band() -> None:
    d = Driver()
    d.sse_headers()
    d.send(UpstreamData(("data: " + chunk("a") + "\n\ndata: {\"trunc").encode()))
    d.send(UpstreamEnded())
    message = error_of(parse_all(d.written)[-1].data)["message"]
    assert "truncated" in message


def test_terminal_when_no_terminal_marker_configured_then_clean_eof_completes() -> None:
    d = Driver(proxy_config(terminal_marker=None))
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(UpstreamEnded())
    assert d.of(CloseClient) == [CloseClient(abrupt=False)]
    assert d.finished.record.end_reason is EndReason.COMPLETE


OURS = {"tokenwire": {"code": "upstream_failed", "number": "E7307"}}


@pytest.mark.parametrize(("payload", "expected"), [
    # An object is forwarded as it came (code, param, object kept), ours beside it.
    ({"error": {"message": "context too long", "type": "invalid_request_error", "code": "ctx",
                "param": None}, "object": "error"},
     {"error": {"message": "context too long", "type": "invalid_request_error", "code": "ctx",
                "param": None, **OURS}, "object": "error"}),
    ({"error": {"message": "boom", "type": "x", "code": 500}},
     {"error": {"message": "boom", "type": "x", "code": 500, **OURS}}),
    ({"error": {"message": "boom", "code": None}}, {"error": {"message": "boom", "code": None, **OURS}}),
    # A bare string gets the object shape the OpenAI SDKs need to raise at all.
    ({"error": "Input validation error", "error_type": "validation"},  # TGI
     {"error": {"message": "Input validation error", "type": "validation", "code": "upstream_failed",
                **OURS}}),
    ({"error": "plain"},
     {"error": {"message": "plain", "type": "upstream_error", "code": "upstream_failed", **OURS}}),
], ids=["openai", "openai_numeric_code", "null_code", "tgi", "bare_string"])
def test_upstream_error_event_when_mid_stream_then_forwarded_with_our_code_beside(
        payload: dict[str, Any], expected: dict[str, Any]) -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(event(json.dumps(payload)))
    assert json.loads(parse_all(d.written)[-1].data or "") == expected
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_ERROR)]


def test_upstream_error_event_when_chunk_mentions_error_in_text_then_not_an_error() -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk('the "error" key')))
    d.send(event(DONE))
    assert texts(parse_all(d.written)) == 'the "error" key'
    assert d.finished.record.end_reason is EndReason.COMPLETE


# ------------------------------------------------------------------ operator stop


@pytest.mark.parametrize(("reason", "code", "retry_after"), [
    (EndReason.SHUTDOWN, "shutdown", b"1"), (EndReason.CANCELLED, "cancelled", None)])
def test_stop_when_before_commit_then_real_status(reason: EndReason, code: str,
                                              retry_after: bytes | None) -> None:
    d = Driver()
    d.send(StopRequested(reason))
    assert d.commit.status == 503
    assert header_dict(d.commit).get(b"retry-after") == retry_after
    assert error_of(d.written.decode())["code"] == code
    assert d.of(AbortUpstream) == [AbortUpstream(reason)]
    assert d.finished.record.end_reason is reason


@pytest.mark.parametrize(("reason", "code"), [(EndReason.SHUTDOWN, "shutdown"),
                                              (EndReason.CANCELLED, "cancelled")])
def test_stop_when_after_commit_then_in_band_error_and_abrupt_close(reason: EndReason, code: str) -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(StopRequested(reason))
    assert error_of(parse_all(d.written)[-1].data)["code"] == code
    assert d.of(CloseClient) == [CloseClient(abrupt=True)]
    assert d.finished.record.end_reason is reason


def test_stop_when_already_done_then_ignored() -> None:
    d = Driver(auto_complete=False)
    d.sse_headers()
    d.send(event(DONE))
    assert d.send(StopRequested(EndReason.SHUTDOWN)) == []
    d.complete()
    assert d.finished.record.end_reason is EndReason.COMPLETE


# ------------------------------------------------------------------ compressed SSE


def test_compressed_when_before_commit_then_refused_with_502() -> None:
    d = Driver(proxy_config(retry_attempts=3))
    d.send(UpstreamHeaders(200, (*SSE_HEADERS, (b"content-encoding", b"gzip"))))
    assert d.commit.status == 502
    assert error_of(d.written.decode())["code"] == "invalid_stream"
    assert d.of(RetryUpstream) == []
    assert d.of(AbortUpstream) == [AbortUpstream(EndReason.UPSTREAM_ERROR)]


def test_compressed_when_after_deadline_commit_then_in_band_error() -> None:
    d = Driver(proxy_config(commit_deadline_s=1.0))
    d.send(Tick(), at=1.0)
    d.send(UpstreamHeaders(200, (*SSE_HEADERS, (b"content-encoding", b"br"))))
    assert error_of(parse_all(d.written)[-1].data)["code"] == "invalid_stream"


@pytest.mark.parametrize("encoding", [b"identity", b""])
def test_compressed_when_identity_then_accepted(encoding: bytes) -> None:
    d = Driver()
    d.send(UpstreamHeaders(200, (*SSE_HEADERS, (b"content-encoding", encoding))))
    d.send(event(chunk("a")))
    assert d.commit.status == 200


# ------------------------------------------------------------------ driver errors


def fresh() -> WireStream:
    return WireStream(PROXY_DEFAULTS, now=0.0, request_id="r")


@pytest.mark.parametrize("inputs", [
    [WriteCompleted()],
    [UpstreamData(b"data: x\n\n")],
    [event("x")],
    [UpstreamEnded()],
    [UpstreamHeaders(200, SSE_HEADERS), UpstreamHeaders(200, SSE_HEADERS)],
    [UpstreamHeaders(400, ((b"content-type", b"application/json"),)), event("x")],
], ids=["write_completed_without_write", "data_before_headers", "event_before_headers",
        "ended_before_headers", "headers_twice", "event_on_passthrough"])
def test_local_protocol_error_when_input_not_allowed_in_state(inputs: list[Any]) -> None:
    stream = fresh()
    for item in inputs[:-1]:
        stream.handle(item, 0.0)
    with pytest.raises(LocalProtocolError):
        stream.handle(inputs[-1], 0.0)


def test_handle_when_not_an_input_then_type_error() -> None:
    with pytest.raises(TypeError):
        fresh().handle("data: x", 0.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------ accounting


def test_record_when_complete_stream_then_counts_everything() -> None:
    d = Driver(proxy_config(heartbeat_s=5.0), now=100.0, auto_complete=False)
    d.sse_headers(at=100.5)
    d.send(event(chunk(role="assistant", text="")), at=101.0)  # first byte: ttfb 1.0
    d.send(event(chunk("a")), at=101.1)  # queues behind the write in flight
    d.send(event(chunk("b")), at=101.2)  # merges
    d.complete()
    d.complete()
    d.send(Tick(), at=106.2)  # heartbeat
    d.complete()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    d.send(event(chunk(finish="stop")), at=107.0)
    d.complete()
    d.send(event(chunk(usage=usage, extra={"choices": []})), at=107.1)
    d.complete()
    d.send(event(DONE), at=107.2)
    d.complete()
    d.send(UpstreamEnded(), at=107.3)
    record = d.finished.record
    assert record.request_id == "req-1" and record.status == 200
    assert record.end_reason is EndReason.COMPLETE and record.error_code is None
    assert record.ttfb_s == pytest.approx(1.0)
    assert record.duration_s == pytest.approx(7.2)
    assert (record.events_in, record.events_out, record.coalesced_events) == (6, 5, 1)
    assert (record.heartbeats, record.retries, record.dropped_events) == (1, 0, 0)
    assert record.bytes_out == len(d.written)
    assert record.usage == usage
    # The role-only chunk is the first byte, not the first token: "a" (merged
    # with "b") is, and the gaps run from it: to the finish chunk, the usage, [DONE].
    assert record.ttft_s == pytest.approx(1.2)
    assert record.max_event_gap_s == pytest.approx(107.0 - 101.2)
    assert sum(record.event_gap_buckets) == 3
    assert record.event_gap_sum_s == pytest.approx(107.2 - 101.2)
    # a+b (merged: one event out), the finish chunk and the usage chunk; [DONE] is no token.
    assert record.content_events == 3
    assert record.tokens_out == (2, "usage")
    assert json.loads(json.dumps(record.to_json()))["end_reason"] == "complete"


def test_finished_is_emitted_exactly_once_and_nothing_after() -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(DONE))
    d.send(UpstreamEnded())
    for item in (ClientGone(), Tick(), UpstreamFailed(FailureKind.PROTOCOL, "x"), SocketPaused(),
                 StopRequested(EndReason.SHUTDOWN)):
        assert d.send(item) == []
    assert len(d.of(Finished)) == 1
    assert d.stream.finished and d.stream.next_deadline() is None


# ------------------------------------------------------------------ properties over random interleavings

TEXT = st.text(st.sampled_from([*'ab "\\\n/é数🙂\t\x01', "\u2028"]), max_size=5)
PIECE_KINDS = ["content", "content", "content", "reasoning", "role", "choice1", "usage", "named"]

EVENTS_OP = st.tuples(st.just("events"), st.lists(st.tuples(st.sampled_from(PIECE_KINDS), TEXT),
                                                   min_size=1, max_size=6), st.integers(0, 2**16))
FLOW_OPS = st.one_of(
    EVENTS_OP, EVENTS_OP, EVENTS_OP, EVENTS_OP,
    st.tuples(st.just("headers"), st.sampled_from(["sse", "sse", "sse", "sse", "502", "503", "json"])),
    st.tuples(st.just("pause")),
    st.tuples(st.just("resume")),
    st.tuples(st.just("complete_write")),
    st.tuples(st.just("complete_write")),
    st.tuples(st.just("complete_write")),
    st.tuples(st.just("tick"), st.sampled_from([0.001, 0.01, 0.01, 0.1, 0.4, 1.0, 2.5, 7.0])),
)
# Ops that (usually) end a stream: rarer, so that most runs stream for a while first.
ENDING_OPS = st.one_of(
    st.tuples(st.just("error_event")),
    st.tuples(st.just("end"), st.booleans()),
    st.tuples(st.just("fail"), st.sampled_from(list(FailureKind))),
    st.tuples(st.just("client_gone")),
    st.tuples(st.just("stop"), st.sampled_from([EndReason.SHUTDOWN, EndReason.CANCELLED])),
)


@st.composite
def op_sequences(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    ops = draw(st.lists(FLOW_OPS, min_size=5, max_size=60))
    # The upstream usually answers early, so that most runs stream for a while.
    ops.insert(draw(st.integers(0, 3)), ("headers", draw(st.sampled_from(["sse"] * 6 + ["502", "json"]))))
    if draw(st.booleans()):
        ops.insert(draw(st.integers(0, len(ops))), ("tick_deadline",))
    for ending in draw(st.lists(ENDING_OPS, max_size=3)):
        ops.insert(draw(st.integers(0, len(ops))), ending)
    return ops


CONFIGS = st.builds(
    proxy_config,
    heartbeat_s=st.sampled_from([0.0, 1.0, 5.0]),
    commit_deadline_s=st.sampled_from([0.5, 2.0]),
    write_deadline_s=st.sampled_from([3.0, 30.0, 30.0]),
    upstream_headers_timeout_s=st.sampled_from([4.0, 300.0]),
    max_pending_bytes=st.sampled_from([1500, 4000, 1 << 20]),
    slow_client_policy=st.sampled_from(list(SlowClientPolicy)),
    coalesce_ms=st.sampled_from([0.0, 0.0, 20.0]),
    retry_attempts=st.sampled_from([0, 1, 3]),
    retry_backoff_s=st.sampled_from([0.0, 0.1]),
    max_line_bytes=st.just(1 << 16),
    # Named: a run whose first event is a named one is generic (not an OpenAI
    # stream), and the operator's marker ends it as it ends a chat stream.
    terminal_marker=st.just("[DONE]"),
)


class FakeDriver:
    """Obeys the driver contract: executes actions, calls data_to_send after each
    handle, reports WriteCompleted later, only feeds an upstream attempt that is
    open (and not paused), and checks the invariants after every step."""

    def __init__(self, config: WireConfig) -> None:
        self.config = config
        self.now = 0.0
        self.stream = WireStream(config, now=0.0, request_id="p", upstream="u")
        self.upstream = "connecting"  # | sse | passthrough | closed
        self.upstream_paused = False
        self.socket_paused = False
        self.in_flight = False
        self.client_closed = False
        self.client_went = False
        self.aborts = 0
        self.commits: list[CommitHeaders] = []
        self.closes: list[CloseClient] = []
        self.finished: list[Finished] = []
        self.writes: list[bytes] = []
        self.last_write_at: float | None = None
        self.expected_text = {"content": "", "reasoning_content": ""}
        self.attempt_text = {"content": "", "reasoning_content": ""}

    # -- the contract

    def handle(self, item: Any) -> None:
        stream = self.stream
        heartbeats_before = stream.heartbeats
        actions = stream.handle(item, self.now)
        for action in actions:
            self.execute(action)
        # (2) bounded memory
        assert stream.pending_bytes <= self.config.max_pending_bytes
        # (5) a heartbeat only after heartbeat_s of silence, and only into an empty buffer
        if stream.heartbeats > heartbeats_before:
            assert stream.pending_bytes == len(HEARTBEAT)
            assert self.last_write_at is not None
            assert self.now >= self.last_write_at + self.config.heartbeat_s
        if not self.in_flight and not self.client_closed:
            data = stream.data_to_send(self.now)
            if data:
                self.writes.append(data)
                self.in_flight = True
                self.last_write_at = self.now

    def execute(self, action: Any) -> None:
        if isinstance(action, CommitHeaders):
            assert not self.commits and not self.finished
            self.commits.append(action)
            self.last_write_at = self.now
            if not action.streaming and self.upstream == "sse_headers_pending":
                self.upstream = "passthrough"
        elif isinstance(action, RetryUpstream):
            # (4) never a retry after the first downstream byte
            assert not self.commits and not self.writes
            assert action.attempt >= 1
            self.upstream = "connecting"
            self.upstream_paused = False
            self.attempt_text = {"content": "", "reasoning_content": ""}
        elif isinstance(action, AbortUpstream):
            self.upstream = "closed"
            self.aborts += 1
        elif isinstance(action, PauseUpstream):
            assert not self.upstream_paused
            self.upstream_paused = True
        elif isinstance(action, ResumeUpstream):
            assert self.upstream_paused
            self.upstream_paused = False
        elif isinstance(action, CloseClient):
            assert not self.closes
            self.closes.append(action)
            self.client_closed = True
        elif isinstance(action, Finished):
            self.finished.append(action)
        else:  # pragma: no cover
            raise AssertionError(action)

    # -- the world

    def upstream_events(self, pieces: list[tuple[str, str]], seed: int) -> None:
        events = []
        for kind, text in pieces:
            if kind == "content":
                events.append(SSEEvent(chunk(text)))
            elif kind == "reasoning":
                events.append(SSEEvent(chunk(text, field="reasoning_content")))
            elif kind == "role":
                events.append(SSEEvent(chunk(role="assistant", text="")))
            elif kind == "choice1":
                events.append(SSEEvent(chunk(text, index=1)))
            elif kind == "usage":
                events.append(SSEEvent(chunk(usage={"total_tokens": 1}, extra={"choices": []})))
            else:
                events.append(SSEEvent(text.replace("\n", " ") or "x", event="progress"))
        accepting = self.stream.state not in (StreamState.DONE, StreamState.ABORTED)
        rng = random.Random(seed)
        if rng.random() < 0.5:
            for e in events:
                self.handle(UpstreamEvent(e))
        else:
            wire = b"".join(encode(e) for e in events)
            cuts = sorted(rng.sample(range(len(wire) + 1), min(3, len(wire))))
            for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
                if self.upstream != "sse":
                    break
                self.handle(UpstreamData(wire[a:b]))
        if accepting:
            for kind, text in pieces:
                if kind in ("content", "choice1"):
                    self.attempt_text["content"] += text
                elif kind == "reasoning":
                    self.attempt_text["reasoning_content"] += text

    def step(self, op: tuple[Any, ...]) -> None:
        name = op[0]
        if self.finished:
            return
        if name == "headers" and self.upstream == "connecting":
            kind = op[1]
            if kind == "sse":
                self.upstream = "sse"
                self.handle(UpstreamHeaders(200, SSE_HEADERS))
            else:
                status = {"502": 502, "503": 503, "json": 400}[kind]
                self.upstream = "sse_headers_pending"
                self.handle(UpstreamHeaders(status, ((b"content-type", b"application/json"),)))
                if self.upstream == "sse_headers_pending":
                    # Committed already: the core reads the error answer's body
                    # for its message (the upstream sends it, then ends); else
                    # the attempt was dropped for a retry or the end.
                    late = self.stream._attempt.late_error_body is not None and not self.finished
                    self.upstream = "passthrough" if late else "closed"
        elif name == "events" and self.upstream == "sse" and not self.upstream_paused:
            self.upstream_events(op[1], op[2])
        elif name == "events" and self.upstream == "passthrough" and not self.upstream_paused:
            self.handle(UpstreamData(b'{"detail":"x"}' * len(op[1])))
        elif name == "error_event" and self.upstream == "sse" and not self.upstream_paused:
            self.handle(event('{"error":{"message":"m","type":"t","code":"c"}}'))
        elif name == "end" and self.upstream in ("sse", "passthrough") and not self.upstream_paused:
            if op[1] and self.upstream == "sse":
                self.handle(event(DONE))
            if self.upstream in ("sse", "passthrough"):
                self.upstream = "closed"
                self.handle(UpstreamEnded())
        elif name == "fail" and self.upstream in ("connecting", "sse", "passthrough"):
            self.upstream = "closed"
            self.handle(UpstreamFailed(op[1], "boom"))
        elif name == "pause" and not self.socket_paused and not self.client_closed:
            self.socket_paused = True
            self.handle(SocketPaused())
        elif name == "resume" and self.socket_paused and not self.client_closed:
            self.socket_paused = False
            self.handle(SocketResumed())
        elif name == "complete_write" and self.in_flight:
            self.in_flight = False
            self.handle(WriteCompleted())
        elif name == "tick":
            self.tick(self.now + op[1])
        elif name == "tick_deadline":
            deadline = self.stream.next_deadline()
            self.tick(max(self.now, deadline if deadline is not None else self.now + 1.0))
        elif name == "client_gone" and not self.client_closed:
            self.client_went = True
            self.client_closed = True
            # (6) the core's answer ahead of the input is the input's answer: a
            # driver cuts the upstream on it and hands ClientGone over later.
            predicted = self.stream.departure_aborts_upstream()
            aborts_before = self.aborts
            self.handle(ClientGone())
            assert (self.aborts > aborts_before) is predicted
        elif name == "stop":
            self.handle(StopRequested(op[1]))

    def tick(self, at: float) -> None:
        self.now = at
        stream = self.stream
        heartbeats_before = stream.heartbeats
        # (5) liveness: silent for heartbeat_s with nothing pending means a heartbeat now.
        due = (self.config.heartbeat_s > 0 and self.last_write_at is not None
               and self.now >= self.last_write_at + self.config.heartbeat_s
               and stream.state in (StreamState.COMMITTED, StreamState.STREAMING)
               and self.commits and self.commits[0].streaming
               and not self.socket_paused and not self.in_flight and stream.pending_bytes == 0
               and stream._attempt.retry_at is None)
        self.handle(Tick())
        if due and stream.state in (StreamState.COMMITTED, StreamState.STREAMING):
            assert stream.heartbeats == heartbeats_before + 1

    def drain(self) -> None:
        """Let the world settle: the client reads, the upstream finishes, time passes."""
        for _ in range(500):
            if self.finished:
                return
            if self.in_flight and not self.client_closed:
                self.step(("complete_write",))
            elif self.socket_paused and not self.client_closed:
                self.step(("resume",))
            elif self.upstream == "connecting" and self.stream._attempt.retry_at is None:
                self.step(("headers", "sse"))
            elif self.upstream in ("sse", "passthrough") and not self.upstream_paused:
                self.step(("end", True))
            else:
                deadline = self.stream.next_deadline()
                assert deadline is not None, "stuck: nothing to wait for"
                self.tick(max(self.now, deadline))
        raise AssertionError("the stream never finished")


def check_run(config: WireConfig, ops: list[tuple[Any, ...]]) -> FakeDriver:
    driver = FakeDriver(config)
    for op in ops:
        driver.step(op)
        if driver.stream.state not in (StreamState.DONE, StreamState.ABORTED):
            driver.expected_text = dict(driver.attempt_text)
    driver.drain()
    for _ in range(3):  # nothing happens after Finished
        driver.handle(Tick())
    stream = driver.stream
    # (3) exactly one Finished, a terminal state, a terminal signal
    assert len(driver.finished) == 1
    assert stream.state in (StreamState.DONE, StreamState.ABORTED)
    record = driver.finished[0].record
    assert record.end_reason is stream.end_reason or stream.end_reason is None
    assert record.bytes_out == sum(len(w) for w in driver.writes)
    commit = driver.commits[0] if driver.commits else None
    close = driver.closes[0] if driver.closes else None
    events = []
    if commit is not None and commit.streaming:
        parser = SSEParser()
        events = [e for e in parser.feed(b"".join(driver.writes)) if e.comment is None]
        parser.close()
        assert parser.discarded_bytes == 0
    if record.end_reason is EndReason.COMPLETE:
        assert close == CloseClient(abrupt=False)
        assert commit is not None
        if commit.streaming:
            assert events[-1].data == DONE
            if config.slow_client_policy is not SlowClientPolicy.DROP:
                # (1) the client read exactly what the upstream generated
                assert texts(events) == driver.expected_text["content"]
                assert texts(events, "reasoning_content") == driver.expected_text["reasoning_content"]
    elif driver.client_went or record.end_reason in (EndReason.CLIENT_GONE, EndReason.SLOW_CLIENT) \
            or (close is not None and close.reset):
        # The client is gone or stopped reading: it is reset (a stream already
        # failing keeps its root cause as end reason), or was already gone.
        assert (close is None and driver.client_went) or (close is not None and close.reset)
    else:
        assert commit is not None
        if not commit.streaming and commit.status >= 400 and close == CloseClient(abrupt=False):
            pass  # a real error status before the first byte
        elif commit.streaming:
            assert close == CloseClient(abrupt=True)
            assert "error" in json.loads(events[-1].data or "{}")
        else:  # a passthrough body cut short
            assert close == CloseClient(abrupt=True)
    return driver


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(CONFIGS, op_sequences())
def test_properties_over_random_interleavings(config: WireConfig, ops: list[tuple[Any, ...]]) -> None:
    check_run(config, ops)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([SlowClientPolicy.COALESCE, SlowClientPolicy.BLOCK]),
       st.lists(st.one_of(
           st.tuples(st.just("events"), st.lists(st.tuples(st.sampled_from(PIECE_KINDS[:4]), TEXT),
                                                 min_size=1, max_size=6), st.integers(0, 2**16)),
           st.tuples(st.just("pause")), st.tuples(st.just("resume")),
           st.tuples(st.just("complete_write")), st.tuples(st.just("tick"), st.just(0.01))),
           max_size=60))
def test_property_text_received_equals_upstream_text_whatever_pausing_and_coalescing(
        policy: SlowClientPolicy, ops: list[tuple[Any, ...]]) -> None:
    config = proxy_config(slow_client_policy=policy)
    driver = check_run(config, [("headers", "sse"), *ops, ("end", True)])
    assert driver.finished[0].record.end_reason is EndReason.COMPLETE
    assert driver.expected_text["content"] or not any(o[0] == "events" for o in ops) or True


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([0.0, 0.5]), st.lists(st.one_of(
    st.tuples(st.just("events"), st.lists(st.tuples(st.just("content"), TEXT), min_size=1, max_size=2),
              st.integers(0, 2**16)),
    st.tuples(st.just("pause")), st.tuples(st.just("resume")), st.tuples(st.just("complete_write")),
    st.tuples(st.just("tick"), st.sampled_from([0.3, 0.6, 1.0, 1.5])), st.tuples(st.just("tick_deadline")),
), max_size=40))
def test_property_heartbeat_after_heartbeat_s_of_silence_never_while_data_pending(
        events_first_at: float, ops: list[tuple[Any, ...]]) -> None:
    config = proxy_config(heartbeat_s=1.0, commit_deadline_s=0.5, write_deadline_s=1000.0)
    driver = check_run(config, [("headers", "sse"), ("tick", events_first_at), *ops, ("end", True)])
    record = driver.finished[0].record
    assert record.heartbeats == sum(w.count(HEARTBEAT) for w in driver.writes)
