"""The Responses and Messages dialects over real uvicorn, with the real openai and anthropic SDKs.

The tiny test model says `` the`` forever when greedy, so it never ends an answer
by itself. The server here gives it three more stop tokens (``.``, a newline,
``,``), which greedy decoding never picks: greedy requests still run to their
length limit (or until they are aborted), and a sampled one (temperature 1)
ends with one of them within a few tokens, which is how a test gets a
``completed`` / ``end_turn`` answer from a real model. (The anthropic SDK sends no
``temperature``: a Messages request without one gets the model's default, greedy.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import openai
import pytest
from tokenwire.engine.backend import RequestOutput, RequestRejected
from tokenwire.engine.dialect import AnswerContext
from tokenwire.engine.messages_api import MessagesDialect, parse_messages_request
from tokenwire.engine.request_fields import ProtocolError
from tokenwire.engine.responses_api import ResponsesDialect, parse_responses_request
from tokenwire.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from conftest import RunningServer
    from tokenwire.engine.loader import LoadedModel

PROMPT = "Tell me about the sea."
LONG = 4000
"""max tokens of a request that is left or aborted long before its end."""


@pytest.fixture(scope="module")
def server(tiny_f32: LoadedModel, serve_engine: Any) -> Iterator[RunningServer]:
    from tokenwire.engine.api import build_app
    from tokenwire.engine.config import EngineConfig

    tokenizer = tiny_f32.tokenizer
    stops = {tokenizer(text).input_ids[-1] for text in (".", "\n", ",")}
    loaded = dataclasses.replace(tiny_f32, eos_token_ids=tiny_f32.eos_token_ids | stops)
    config = EngineConfig(max_running=32, kv_budget_tokens=4096, max_prefill_tokens_per_step=64)
    with serve_engine(build_app(loaded, config)) as running:
        yield running


def _openai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _anthropic(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def _finished(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, Any] | None:
    for record in caplog.records:
        if record.name == "tokenwire.engine.requests":
            fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
            if fields["request_id"] == request_id:
                return fields
    return None


# -- the Responses API ---------------------------------------------------------------

_OPENING = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
_CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_stream_matches_the_whole_answer(server: RunningServer) -> None:
    client = _openai(server)
    request: dict[str, Any] = {"model": "tiny", "input": PROMPT, "max_output_tokens": 12,
                               "temperature": 0}
    whole = client.responses.create(**request)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].type == "message" and whole.output[0].id.startswith("msg_")
    assert whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    assert whole.usage.input_tokens_details.cached_tokens == 0
    assert whole.usage.output_tokens_details.reasoning_tokens == 0

    events = list(client.responses.create(**request, stream=True))
    types = [event.type for event in events]
    assert types[:4] == _OPENING
    assert types[-4:] == [*_CLOSING, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    item_id = events[2].item.id  # type: ignore[union-attr]
    assert item_id.startswith("msg_") and item_id != whole.output[0].id  # one id per request
    assert all(d.item_id == item_id and d.logprobs == [] for d in deltas)
    assert "".join(d.delta for d in deltas) == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage == whole.usage
    created = events[0].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.output == [] and created.usage is None


def test_responses_stream_helper_gets_the_final_response(server: RunningServer) -> None:
    """Sampled, so it ends on a stop token: ``get_final_response`` needs ``response.completed``."""
    client = _openai(server)
    with client.responses.stream(
        model="tiny", instructions="Answer briefly.", max_output_tokens=400, temperature=1.0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(deltas)
    assert final.instructions == "Answer briefly." and final.model == "tiny"
    assert final.usage is not None and final.usage.output_tokens >= 1
    assert final.output[0].status == "completed"  # type: ignore[union-attr]


def test_responses_wire_format(server: RunningServer) -> None:
    """Named events whose name is their data's type, and no ``[DONE]``."""
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert "[DONE]" not in text
    frames = [frame for frame in text.split("\n\n") if frame.strip() and not frame.startswith(":")]
    for frame in frames:
        name, data = frame.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert frames[-1].startswith("event: response.incomplete\n")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "1", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": None}, "input"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),  # the scheduler's check
    ],
)
def test_responses_refusals_name_the_field(server: RunningServer, extra: dict[str, Any],
                                           param: str) -> None:
    body = {"model": "tiny", "input": "Hi", **extra}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_responses_refusals_reach_the_sdk(server: RunningServer) -> None:
    client = _openai(server)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="Hi")
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input="Hi", top_p=0)
    assert raised.value.param == "top_p"


# -- the Messages API -----------------------------------------------------------------


def test_messages_stream_matches_the_whole_message(server: RunningServer) -> None:
    client = _anthropic(server)
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 10, "system": "Be brief.",
                               "messages": [{"role": "user", "content": PROMPT}]}
    whole = client.messages.create(**request)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 10 and whole.usage.input_tokens > 0
    assert whole.content[0].type == "text" and whole.content[0].text

    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 10)


def test_messages_raw_stream_events(server: RunningServer) -> None:
    """Sampled, so it ends on a stop token: ``end_turn``."""
    client = _anthropic(server)
    events = list(client.messages.create(
        model="tiny", max_tokens=400, stream=True, extra_body={"temperature": 1.0},
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    ))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta"}
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    assert start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens > 0 and start.message.usage.output_tokens == 0
    assert delta.delta.stop_reason == "end_turn" and delta.delta.stop_sequence is None
    assert delta.usage.output_tokens >= 1


def test_messages_stop_sequences(server: RunningServer) -> None:
    message = _anthropic(server).messages.create(
        model="tiny", max_tokens=50, stop_sequences=["the the"],
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "the the")
    assert "the the" not in message.content[0].text  # type: ignore[union-attr]


def test_messages_continue_a_last_assistant_turn(server: RunningServer) -> None:
    """A prefill: the prompt ends inside the assistant's turn (the tiny template's
    spelling), not with a new turn after it."""
    message = _anthropic(server).messages.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Once upon"}])
    tokenizer = server.app.state.engine.loaded.tokenizer
    prompt = "<|user|>\nHi<|end|>\n<|assistant|>\nOnce upon"
    assert message.usage.input_tokens == len(tokenizer(prompt).input_ids)


def test_messages_without_max_tokens_is_a_400(server: RunningServer) -> None:
    client = _anthropic(server)
    with pytest.raises(anthropic.BadRequestError) as raised:
        # The SDK itself insists on max_tokens; a raw post through it does not.
        client.post("/v1/messages", cast_to=anthropic.types.Message,
                    body={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert raised.value.status_code == 400
    assert raised.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required (the most tokens to generate)"}}


@pytest.mark.parametrize(
    ("extra", "status", "kind", "named"),
    [
        ({"model": "claude-9"}, 404, "not_found_error", "claude-9"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
         "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "messages[0].content[0]"),
        ({"tools": [{"name": "f", "input_schema": {}}]}, 400, "invalid_request_error", "tools"),
        ({"max_tokens": 100_000}, 400, "invalid_request_error", "maximum context length"),
    ],
)
def test_messages_errors_are_anthropic_shaped(server: RunningServer, extra: dict[str, Any],
                                              status: int, kind: str, named: str) -> None:
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], **extra}
    response = httpx.post(f"{server.base_url}/v1/messages", json=body)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert named in error["error"]["message"]


def test_messages_refusal_statuses() -> None:
    dialect = MessagesDialect()
    full = RequestRejected("queue full", http_status=503, overloaded=True)
    assert dialect.refusal(full) == (529, {"type": "error", "error": {
        "type": "overloaded_error", "message": "queue full"}})
    assert dialect.refusal(RequestRejected("down", http_status=503))[0] == 500
    assert dialect.refusal(ProtocolError("bad", param="x"))[1]["error"]["type"] == "invalid_request_error"


# -- leaving and aborting, both dialects --------------------------------------------------


def _first_text_then_leave(server: RunningServer, dialect: str, request_id: str) -> None:
    """Stream a long greedy answer as ``request_id``, read its first text, and leave."""
    backend = server.app.state.engine.backend
    headers = {"X-Request-Id": request_id}
    if dialect == "responses":
        stream = _openai(server).responses.create(
            model="tiny", input=PROMPT, max_output_tokens=LONG, temperature=0, stream=True,
            extra_headers=headers)
        next(event for event in stream if event.type == "response.output_text.delta")
        _wait_until(lambda: request_id in backend.batch_row_ids)
        stream.close()
    else:
        with _anthropic(server).messages.stream(
            model="tiny", max_tokens=LONG, extra_headers=headers,
            messages=[{"role": "user", "content": PROMPT}],
        ) as messages:
            assert next(iter(messages.text_stream))
            _wait_until(lambda: request_id in backend.batch_row_ids)


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_a_client_that_leaves_aborts_the_generation(
    server: RunningServer, caplog: pytest.LogCaptureFixture, dialect: str,
) -> None:
    caplog.set_level(logging.INFO, logger="tokenwire.engine.requests")
    request_id = f"leaver-{dialect}"
    _first_text_then_leave(server, dialect, request_id)
    backend = server.app.state.engine.backend
    _wait_until(lambda: request_id not in backend.batch_row_ids)
    _wait_until(lambda: _finished(caplog, request_id) is not None)
    record = _finished(caplog, request_id)
    assert record is not None and record["endpoint"] == dialect
    assert record["finish_reason"] == "abort"
    assert record["abort_reason"] in ("client_disconnect", "client_gone")
    assert 0 < int(record["completion_tokens"]) < LONG


def _abort(server: RunningServer, request_id: str) -> None:
    assert httpx.post(f"{server.base_url}/v1/abort/{request_id}").status_code == 200


def test_an_aborted_response_ends_with_response_failed(server: RunningServer) -> None:
    stream = _openai(server).responses.create(
        model="tiny", input=PROMPT, max_output_tokens=LONG, temperature=0, stream=True,
        extra_headers={"X-Request-Id": "abort-responses"})
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == len(_OPENING) + 1:
            _abort(server, "abort-responses")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "cancelled"
    assert failed.response.error is not None and failed.response.error.code == "cancelled"
    assert failed.response.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_an_aborted_message_stream_raises_the_error_event(server: RunningServer) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised, _anthropic(server).messages.stream(
        model="tiny", max_tokens=LONG, extra_headers={"X-Request-Id": "abort-messages"},
        messages=[{"role": "user", "content": PROMPT}],
    ) as stream:
        texts = iter(stream.text_stream)
        assert next(texts)
        _abort(server, "abort-messages")
        for _ in texts:
            pass
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error" and "aborted" in body["error"]["message"]


def test_a_generation_that_fails_mid_stream_in_each_dialect() -> None:
    """The engine's failure (not an abort) after the first byte, and in a whole answer."""
    context = AnswerContext(request_id="r1", model="tiny", created=0, prompt_tokens=3,
                            params=SamplingParams(max_tokens=5))
    final = RequestOutput(request_id="r1", text="", token_ids=(), prompt_tokens=3, completion_tokens=1,
                          finished=True, finish_reason="error", error="the step failed")
    responses = ResponsesDialect().answer(parse_responses_request({"input": "Hi"}), context)
    assert responses.opening()
    *_, last = responses.failure("x", final)
    name, data = last.strip().split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == "event: response.failed" and event["sequence_number"] == len(_OPENING) + 1
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"]["code"] == "server_error"
    assert event["response"]["error"]["message"] == "the step failed"
    assert event["response"]["output"][0]["content"][0]["text"] == "x"
    assert responses.error_body(final)[0] == 500

    messages = MessagesDialect().answer(
        parse_messages_request({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}),
        context)
    error = {"type": "error", "error": {"type": "api_error", "message": "the step failed"}}
    wire = json.dumps(error, separators=(",", ":"))
    assert messages.failure("", final) == [f"event: error\ndata: {wire}\n\n"]
    assert messages.error_body(final) == (500, error)
