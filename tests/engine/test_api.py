"""The HTTP API over real uvicorn on 127.0.0.1, behind tokenwire's middleware."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from conftest import RunningServer
    from tokenwire.engine.loader import LoadedModel


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def _finished_records(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, object]]:
    records = {}
    for record in caplog.records:
        if record.name == "tokenwire.engine.requests":
            payload = record.fields  # type: ignore[attr-defined]
            records[payload["request_id"]] = payload
    return records


def test_openai_sdk_streams_completions_with_usage(engine_server: RunningServer) -> None:
    stream = _client(engine_server).completions.create(
        model="tiny", prompt="The kitchen is", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish == ["length"]
    assert text
    assert usage is not None and usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_sdk_streams_chat_with_usage(engine_server: RunningServer) -> None:
    stream = _client(engine_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_completion_tokens=16, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert isinstance(text, str)


def test_openai_sdk_non_streaming_and_request_id_echo(engine_server: RunningServer) -> None:
    client = _client(engine_server)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0, extra_headers={"X-Request-Id": "echo-me-1"},
    )
    assert raw.headers["x-request-id"] == "echo-me-1"
    completion = raw.parse()
    assert completion.id == "chatcmpl-echo-me-1"
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and completion.usage.completion_tokens <= 8

    text = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert text.usage is not None and text.usage.prompt_tokens == 3


def test_oversized_request_gets_400_while_others_keep_streaming(
    engine_server: RunningServer,
) -> None:
    client = _client(engine_server)
    results: dict[int, list[str | None]] = {}

    def stream(index: int) -> None:
        chunks = client.completions.create(
            model="tiny", prompt=f"Stream {index} is about", max_tokens=60, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )
        results[index] = [c.choices[0].finish_reason for c in chunks]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    _wait_until(lambda: len(engine_server.app.state.engine.backend.batch_row_ids) >= 1)

    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt="too long", max_tokens=100_000)
    assert "maximum context length" in str(raised.value)

    for thread in threads:
        thread.join(30)
    assert sorted(results) == [0, 1, 2]
    assert all(reasons[-1] == "length" and len(reasons) > 1 for reasons in results.values())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "prompt": "x", "bogus": 1}, "bogus"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n"),
        ({"model": "tiny", "prompt": [10**7]}, "prompt"),
    ],
)
def test_invalid_requests_get_400_naming_the_field(
    engine_server: RunningServer, body: dict[str, object], param: str
) -> None:
    response = httpx.post(f"{engine_server.base_url}/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(engine_server: RunningServer) -> None:
    response = httpx.post(f"{engine_server.base_url}/v1/completions",
                          json={"model": "gpt-9", "prompt": "x"})
    assert response.status_code == 404


def test_client_disconnect_aborts_the_sequence_and_is_billed(
    engine_server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenwire.engine.requests")
    backend = engine_server.app.state.engine.backend
    body = {"model": "tiny", "prompt": "Leaving early", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", f"{engine_server.base_url}/v1/completions", json=body,
        headers={"X-Request-Id": "leaver-1"},
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        _wait_until(lambda: "leaver-1" in backend.batch_row_ids)
    # Leaving the block closed the connection mid-stream.
    _wait_until(lambda: "leaver-1" not in backend.batch_row_ids)
    _wait_until(lambda: "leaver-1" in _finished_records(caplog))
    record = _finished_records(caplog)["leaver-1"]
    assert record["finish_reason"] == "abort"
    assert record["abort_reason"] in ("client_disconnect", "client_gone")
    assert 0 < int(record["completion_tokens"]) < 4000  # type: ignore[call-overload]


def test_abort_endpoint_ends_the_stream_with_an_in_band_error(
    engine_server: RunningServer,
) -> None:
    # The middleware cuts the body after an in-band error (no chunked
    # terminator), so a client that ignores errors still sees a truncation.
    rest = engine_server.abort_mid_stream("abort-me-1", max_tokens=4000, timeout_s=30)
    assert "data: [DONE]" not in rest
    assert json.loads(rest[-1][len("data:"):])["error"]["code"] == "cancelled"
    assert httpx.post(f"{engine_server.base_url}/v1/abort/abort-me-1").status_code == 404


def test_models_health_and_metrics(engine_server: RunningServer) -> None:
    base = engine_server.base_url
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(f"{base}/health").status_code == 200
    httpx.post(f"{base}/v1/completions", json={"prompt": "count me", "max_tokens": 3})
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200
    for name in ("tokenwire_engine_running", "tokenwire_engine_waiting",
                 "tokenwire_engine_kv_tokens_in_use", "tokenwire_engine_step_seconds_bucket",
                 "tokenwire_engine_time_to_first_token_seconds_bucket",
                 "tokenwire_engine_generated_tokens_total"):
        assert name in metrics.text


def test_root_is_still_a_404_but_its_body_points_at_the_api_and_the_playground(
    engine_server: RunningServer,
) -> None:
    base = engine_server.base_url
    for method in ("GET", "POST"):
        root = httpx.request(method, f"{base}/")
        assert root.status_code == 404, method  # no API route: never a 200, nor a 405 for POST
        assert root.headers["content-type"] == "text/plain; charset=utf-8"
        assert "/v1/chat/completions" in root.text and "/v1/models" in root.text
        assert "playground" in root.text and "tokenwire up" in root.text
    head = httpx.head(f"{base}/")
    assert head.status_code == 404 and head.content == b""
    # Every other unknown path is Starlette's bare 404, as before.
    other = httpx.get(f"{base}/nothing-here")
    assert other.status_code == 404 and other.text == "Not Found"


def test_a_request_without_temperature_gets_the_model_default(engine_server: RunningServer) -> None:
    """The tiny model's generation_config.json says do_sample false: greedy unless asked."""
    client = _client(engine_server)
    messages = [{"role": "user", "content": "Tell me about the sea."}]

    def answer(**sampling: float) -> str:
        reply = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=24, **sampling)
        return reply.choices[0].message.content or ""

    greedy = answer(temperature=0)
    assert answer() == greedy and answer() == greedy
    hot = {answer(temperature=2.0, seed=seed) for seed in range(4)}
    assert hot != {greedy}  # and a temperature that is asked for is honoured


def test_health_is_503_once_the_engine_thread_has_stopped(
    tiny_f32: LoadedModel, serve_engine: Any,
) -> None:
    from tokenwire.engine.api import build_app
    from tokenwire.engine.config import EngineConfig

    with serve_engine(build_app(tiny_f32, EngineConfig())) as server:
        assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
        server.app.state.engine.runner.stop()
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "scheduler_down"
