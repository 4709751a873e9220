"""Per-request wire settings through the sidecar, over real sockets: a request's
``Tokenwire-…`` headers change its own stream inside the operator's bounds, a
refused one is a 400 before anything goes upstream, and none reaches the engine."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from clients import chat_body, exchange, wait_for
from conftest import RunningSidecar
from resume_client import open_stream
from tokenwire.middleware import EndReason
from upstreams import FakeUpstream, expected_text

PATH = "/silent/v1/chat/completions"


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
def test_a_heartbeat_asked_for_is_the_streams_own_and_the_header_stays_here(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """3 s of silence: the sidecar's 15 s heartbeat says nothing in it; the
    request's 1 s one does. The record's log line says what was applied."""
    sidecar = start_sidecar()
    quiet = open_stream(sidecar.port, "POST", PATH, body=chat_body(), headers={
        "x-fake-silence-s": "3", "x-request-id": "hb-default"})
    asked = open_stream(sidecar.port, "POST", PATH, body=chat_body(), headers={
        "x-fake-silence-s": "3", "x-request-id": "hb-1", "Tokenwire-Heartbeat-S": "1"})
    assert quiet.clean_end and asked.clean_end
    assert [e.comment for e in quiet.events if e.comment] == []
    assert len([e for e in asked.events if e.comment == " keepalive" or e.comment == "keepalive"]) >= 1
    seen = upstream.requests_with("hb-1")[0].headers
    assert not any(name.startswith("tokenwire-heartbeat") for name in seen), seen
    sidecar.record("hb-1")
    assert sidecar.log.extras["hb-1"]["client_settings"] == "heartbeat_s=1.0"
    assert "client_settings" not in sidecar.log.extras["hb-default"]


def test_a_setting_outside_the_bounds_is_a_400_and_nothing_goes_upstream(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    refused = exchange(sidecar.port, "POST", PATH, body=chat_body(), headers={
        "x-request-id": "hb-bad", "Tokenwire-Heartbeat-S": "0.01"})
    assert refused.status == 400
    error = json.loads(refused.body)["error"]
    assert error["code"] == "bad_request" and "tokenwire-heartbeat-s" in error["message"]
    assert "1..60" in error["message"]
    assert upstream.requests_with("hb-bad") == []


def test_keep_generating_asked_for_when_the_grace_is_zero_completes_the_answer_for_a_resume(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """``tokenwire up``'s default: a client that leaves stops its answer, unless it asked to keep it."""
    sidecar = start_sidecar(resume=True, resume_grace_s=0.0)
    headers = {"x-fake-tokens": "60", "x-fake-delay-s": "0.005"}
    stopped = open_stream(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                          stop_after=3, headers={**headers, "x-request-id": "leave-stop"})
    kept = open_stream(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(), stop_after=3,
                       headers={**headers, "x-request-id": "leave-keep", "Tokenwire-Keep-Generating": "true"})
    assert stopped.stopped and kept.stopped
    assert sidecar.record("leave-stop").end_reason is EndReason.CLIENT_GONE
    assert sidecar.record("leave-keep").end_reason is EndReason.DEPARTED
    assert upstream.requests_with("leave-keep")[0].finished_at is not None  # generated to its end
    wait_for(lambda: upstream.connection_of("leave-stop").peer_closed_at is not None)
    rest = open_stream(sidecar.port, "GET", f"/v1/streams/{kept.stream_id}",
                       headers={"Last-Event-ID": kept.ids[-1]})
    assert rest.status == 200 and rest.clean_end
    text = "".join(json.loads(e.data)["choices"][0]["delta"].get("content") or ""
                   for e in kept.data_events + rest.data_events
                   if e.data and e.data != "[DONE]" and json.loads(e.data).get("choices"))
    assert text == expected_text(60)


def test_openai_python_extra_headers_are_the_way_an_sdk_caller_asks(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    """The client compatibility row: ``extra_headers`` on the OpenAI SDK; a
    refusal is the SDK's ``BadRequestError`` with the sidecar's words."""
    import openai

    sidecar = start_sidecar()
    client = openai.OpenAI(base_url=sidecar.url + "/normal/v1", api_key="sk-x", max_retries=0)
    messages: list[dict[str, str]] = [{"role": "user", "content": "hi"}]
    stream = client.chat.completions.create(model="fake", messages=messages, stream=True,  # type: ignore[arg-type]
                                            extra_headers={"Tokenwire-Write-Deadline-S": "60"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected_text(5)
    try:
        client.chat.completions.create(model="fake", messages=messages, stream=True,  # type: ignore[arg-type]
                                       extra_headers={"Tokenwire-Write-Deadline-S": "1"})
    except openai.BadRequestError as refused:
        assert "tokenwire-write-deadline-s" in str(refused) and "5..120" in str(refused)
    else:
        raise AssertionError("a write deadline below the bound was accepted")
