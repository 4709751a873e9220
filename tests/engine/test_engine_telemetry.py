"""The engine's telemetry, alone and behind a sidecar: its metrics under promtool,
and one trace from the client through the sidecar into the engine's phases."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel
from tokenwire.middleware import WireConfig
from tokenwire.sidecar import Sidecar, SidecarConfig

_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
_CLIENT_SPAN_ID = "00f067aa0ba902b7"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Traced:
    engine_url: str
    sidecar_url: str
    exporter: InMemorySpanExporter


@pytest.fixture(scope="module")
def traced(tiny_f32: LoadedModel) -> Iterator[Traced]:
    """The engine (as ``tokenwire engine`` wraps it) and a sidecar in front of it, in
    this process, both sending spans to one SDK provider with an in-memory exporter."""
    import uvicorn
    from tokenwire.engine.access_log import AccessLog
    from tokenwire.engine.api import build_app
    from tokenwire.engine.server import _wrap_in_middleware

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = EngineConfig(max_running=8, kv_budget_tokens=4096, max_prefill_tokens_per_step=64)
    app = AccessLog(_wrap_in_middleware(build_app(tiny_f32, config, tracer_provider=provider)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    engine_thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    engine_thread.start()
    deadline_s = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline_s and engine_thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    engine_url = f"http://127.0.0.1:{port}"
    sidecar = Sidecar(SidecarConfig(wire=WireConfig(terminal_marker="[DONE]"), upstream=(engine_url,),
                                    listen="127.0.0.1:0", log_file=""), tracer_provider=provider)
    loop = asyncio.new_event_loop()
    sidecar_thread = threading.Thread(target=loop.run_forever, daemon=True)
    sidecar_thread.start()
    asyncio.run_coroutine_threadsafe(sidecar.start(), loop).result(15)
    host, sidecar_port = sidecar.address
    try:
        yield Traced(engine_url, f"http://{host}:{sidecar_port}", exporter)
    finally:
        asyncio.run_coroutine_threadsafe(sidecar.shutdown(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        sidecar_thread.join(15)
        server.should_exit = True
        engine_thread.join(15)


def _spans_of(exporter: InMemorySpanExporter, trace_id: int, names: set[str],
              timeout_s: float = 10.0) -> dict[str, ReadableSpan]:
    """The finished spans of ``trace_id`` by name, once all of ``names`` have ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = {span.name: span for span in exporter.get_finished_spans()
                 if span.context is not None and span.context.trace_id == trace_id}
        if names <= spans.keys() or time.monotonic() > deadline:
            return spans
        time.sleep(0.01)


def test_trace_spans_client_to_sidecar_to_engine_phases(traced: Traced) -> None:
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "stream": True, "ignore_eos": True}
    headers = {"traceparent": f"00-{_TRACE_ID}-{_CLIENT_SPAN_ID}-01", "X-Request-Id": "traced-1"}
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{traced.sidecar_url}/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    names = {"tokenwire.stream", "engine.request", "engine.queue", "engine.prefill", "engine.decode"}
    spans = _spans_of(traced.exporter, int(_TRACE_ID, 16), names)
    assert names <= spans.keys(), sorted(spans)
    stream, request = spans["tokenwire.stream"], spans["engine.request"]
    # The client's span -> the sidecar's stream -> the engine's request -> its three phases.
    assert stream.parent is not None and stream.parent.span_id == int(_CLIENT_SPAN_ID, 16)
    assert stream.context is not None and request.parent is not None
    assert request.parent.span_id == stream.context.span_id
    assert request.context is not None
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        parent = spans[phase].parent
        assert parent is not None and parent.span_id == request.context.span_id
    queue, prefill, decode = (spans[p] for p in ("engine.queue", "engine.prefill", "engine.decode"))
    assert queue.end_time is not None and prefill.start_time is not None and decode.start_time is not None
    assert queue.end_time <= prefill.start_time + 1_000 and prefill.end_time <= decode.start_time + 1_000
    events = [event.name for event in stream.events]
    assert events[:2] == ["accepted", "committed"] and "first token" in events and events[-1] == "ended"
    attributes: dict[str, Any] = dict(stream.attributes or {})
    assert attributes["tokenwire.end_reason"] == "complete"
    assert attributes["tokenwire.tokens_out"] == 6 or attributes["tokenwire.tokens_source"] == "counted"
    assert dict(request.attributes or {})["gen_ai.usage.output_tokens"] == 6


def test_trace_without_traceparent_then_a_new_trace_still_joins_the_engine(traced: Traced) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{traced.sidecar_url}/v1/completions", json=body,
                                headers={"X-Request-Id": "traced-2"})
    assert response.status_code == 200
    deadline = time.monotonic() + 10
    while True:
        streams = [s for s in traced.exporter.get_finished_spans() if s.name == "tokenwire.stream"
                   and dict(s.attributes or {}).get("tokenwire.request_id") == "traced-2"]
        if streams or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    (stream,) = streams
    assert stream.parent is None and stream.context is not None
    spans = _spans_of(traced.exporter, stream.context.trace_id, {"engine.request"})
    request = spans["engine.request"]
    assert request.parent is not None and request.parent.span_id == stream.context.span_id


@pytest.mark.slow
def test_engine_metrics_comparable_with_the_sidecars_and_pass_promtool(traced: Traced) -> None:
    body = {"model": "tiny", "prompt": "Count", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        assert client.post(f"{traced.engine_url}/v1/completions", json=body).status_code == 200
        text = client.get(f"{traced.engine_url}/metrics").text
    counts = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name.endswith("_count")}
    for name in ("queue_wait", "prefill", "time_to_first_token", "inter_token"):
        assert counts[f"tokenwire_engine_{name}_seconds_count"] >= 1, name
    assert "tokenwire_build_info{" in text and "process_cpu_seconds_total" in text
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool missing: run scripts/system-deps.sh prometheus"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr
