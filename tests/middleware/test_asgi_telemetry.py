"""The middleware's telemetry under real servers: one record line per stream
with its fields, as the server leaves logging, and its Prometheus metrics
scraped over HTTP, live while a stream runs.

The served app is the README's Telemetry example (read from README.md), its
routes placeholder filled here; each server is a real process
(``python -m uvicorn module:app``), and its output is what is checked.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.core.config import ConfigError
from tokenwire.middleware.process.logs import (
    DefaultHandler,
    FieldsInMessage,
    JsonFormatter,
    install_default_handler,
)
from tokenwire.middleware.process.prometheus import MiddlewareMetrics

from .asgi_apps import chat_chunk, open_request, running_server

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0  # fastapi's import on a busy two-core machine
WAIT_S = 60.0
WORDS = ("alpha", " beta", " gamma", " delta")
COMPLETION_TOKENS = 4
LABELS = {"upstream": "app", "status_class": "2xx", "http_version": "1.1"}

ROUTES = '''
import asyncio as _asyncio

from fastapi import Request as _Request
from fastapi.responses import StreamingResponse as _Streaming

_released = _asyncio.Event()


@{app}.post("/v1/chat/completions")
async def _chat(request: _Request) -> _Streaming:
    hold = request.headers.get("x-hold") == "1"

    async def events():
        for word in {words!r}:
            yield ('data: {{"choices":[{{"index":0,"delta":{{"content":"%s"}}}}]}}\\n\\n' % word).encode()
        if hold:
            await _released.wait()
        yield (b'data: {{"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{tokens},'
               b'"total_tokens":7}}}}\\n\\n')
        yield b"data: [DONE]\\n\\n"
    return _Streaming(events(), media_type="text/event-stream")


@{app}.post("/release")
async def _release() -> dict[str, bool]:
    _released.set()
    return {{"released": True}}
'''


def readme_example() -> str:
    """The README's middleware telemetry example (the block with ``metrics_path``)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    found = [block for block in blocks if "metrics_path=" in block and "TokenWireMiddleware(" in block]
    assert len(found) == 1, "README.md: one python block with TokenWireMiddleware(..., metrics_path=...)"
    return str(found[0])


def app_source(*, extra: str = "", prelude: str = "") -> str:
    """The README example with this file's routes, and ``extra`` keyword arguments."""
    source = readme_example()
    name = re.findall(r"^(\w+) = FastAPI\(\)", source, re.M)[-1]
    routes = ROUTES.format(app=name, words=WORDS, tokens=COMPLETION_TOKENS)
    source = source.replace("# ... your streaming routes ...", routes)
    if extra:
        source, count = re.subn(r"TokenWireMiddleware\((\w+), ", rf"TokenWireMiddleware(\1, {extra}, ",
                                source)
        assert count == 1
    return prelude + source


# ---------------------------------------------------------------- a server process


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    base: str
    lines: list[str] = field(default_factory=list)
    """Every line the process wrote, stdout and stderr, as read so far."""
    _arrived: queue.Queue[str] = field(default_factory=queue.Queue)

    def wait_line(self, predicate: Callable[[str], bool], timeout_s: float = WAIT_S) -> str:
        """The first line (already read or to come) that ``predicate`` accepts."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if predicate(line):
                    return line
            seen = len(self.lines)
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.process.poll() is None, \
                f"no such line in {timeout_s} s:\n" + "".join(self.lines)[-4000:]
            with suppress(queue.Empty):
                self._arrived.get(timeout=min(remaining, 1.0))


def _drain(pipe: Any, served: Served) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace")
        served.lines.append(line)
        served._arrived.put(line)


SERVERS = {
    "uvicorn": (["-m", "uvicorn", "{module}:app", "--host", "127.0.0.1", "--port", "0"],
                r"Uvicorn running on http://127\.0\.0\.1:(\d+)"),
    "hypercorn": (["-m", "hypercorn", "{module}:app", "--bind", "127.0.0.1:0"],
                  r"Running on http://127\.0\.0\.1:(\d+)"),
}


@contextmanager
def serve(server: str, source: str, tmp_path: Path) -> Iterator[Served]:
    """``source`` as a module, served by ``server`` in a process of its own, as
    a reader would start it; yields once it listens, stops it with SIGTERM."""
    module = "telemetry_app"
    (tmp_path / f"{module}.py").write_text(source)
    argv, ready = SERVERS[server]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENWIRE_", "OTEL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen([sys.executable, *(a.format(module=module) for a in argv)], cwd=tmp_path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    served = Served(process, "")
    drains = [threading.Thread(target=_drain, args=(pipe, served), daemon=True)
              for pipe in (process.stdout, process.stderr)]
    for drain in drains:
        drain.start()
    try:
        line = served.wait_line(lambda text: re.search(ready, text) is not None, START_TIMEOUT_S)
        port = re.search(ready, line).group(1)  # type: ignore[union-attr]
        served.base = f"http://127.0.0.1:{port}"
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for drain in drains:
            drain.join(10)
            assert not drain.is_alive(), "the server's output did not end"


def record_lines(served: Served) -> list[str]:
    return [line for line in served.lines if "stream ended" in line]


def json_line(line: str) -> dict[str, Any]:
    """A JSON log line's object ({} for any other line)."""
    try:
        found = json.loads(line)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def json_record(line: str) -> dict[str, Any] | None:
    try:
        found = json.loads(line)
    except ValueError:
        return None
    return found if isinstance(found, dict) and found.get("msg") == "stream ended" else None


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and labels.items() <= found.labels.items():
                return float(found.value)
    return None


def promtool_check(text: str) -> None:
    """``promtool check metrics`` has nothing to say (as for the sidecar's /metrics)."""
    import shutil

    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool missing: run scripts/system-deps.sh prometheus"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def chat_body() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello"}], "stream": True}


# ---------------------------------------------------------------- under real servers


@pytest.mark.slow
@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_readme_example_when_a_stream_runs_then_counted_live_then_one_record_line_and_its_metrics(
        server: str, tmp_path: Path) -> None:
    with serve(server, app_source(), tmp_path) as served, httpx.Client(timeout=WAIT_S) as client:
        metrics_url = served.base + "/metrics"
        with client.stream("POST", served.base + "/v1/chat/completions", json=chat_body(),
                           headers={"x-hold": "1", "x-request-id": "bill-1"}) as response:
            assert response.status_code == 200
            body = b""
            chunks = response.iter_bytes()
            while b"delta" not in body:  # every word was sent; the app now waits for /release
                body += next(chunks)
            live = client.get(metrics_url).text
            assert sample(live, "tokenwire_active_streams") == 1
            assert sample(live, "tokenwire_time_to_first_token_seconds_count", **LABELS) == 1
            assert (sample(live, "tokenwire_bytes_out_total", **LABELS) or 0) >= len(body)
            assert (sample(live, "tokenwire_content_events_total", **LABELS) or 0) >= 1
            assert sample(live, "tokenwire_streams_ended_total", **LABELS) is None
            assert not record_lines(served)
            assert client.post(served.base + "/release").json() == {"released": True}
            for chunk in chunks:
                body += chunk
        assert body.endswith(b"data: [DONE]\n\n")
        line = served.wait_line(lambda text: json_record(text) is not None)
        record = json_record(line)
        assert record is not None
        assert record["logger"] == "tokenwire.middleware" and record["level"] == "info"
        assert record["request_id"] == "bill-1" and record["status"] == 200
        assert record["end_reason"] == "complete" and record["error_code"] is None
        assert (record["tokens_out"], record["tokens_source"]) == (COMPLETION_TOKENS, "usage")
        assert record["usage"]["completion_tokens"] == COMPLETION_TOKENS
        assert record["bytes_out"] == len(body) and record["ttft_s"] is not None
        text = client.get(metrics_url).text
        assert sample(text, "tokenwire_streams_ended_total", reason="complete", **LABELS) == 1
        assert sample(text, "tokenwire_stream_duration_seconds_count", reason="complete", **LABELS) == 1
        assert sample(text, "tokenwire_tokens_out_total", upstream="app", source="usage") == COMPLETION_TOKENS
        assert sample(text, "tokenwire_active_streams") == 0
        # Its end replaced its live figures: nothing counted twice, nothing went down.
        assert sample(text, "tokenwire_time_to_first_token_seconds_count", **LABELS) == 1
        assert sample(text, "tokenwire_bytes_out_total", **LABELS) == record["bytes_out"]
        assert sample(text, "tokenwire_content_events_total", **LABELS) == record["content_events"]
        assert sample(text, "tokenwire_events_out_total", **LABELS) == record["events_out"]
        assert sample(text, "tokenwire_build_info", program="middleware") == 1
        promtool_check(text)
    # One line for the one stream: none for /metrics or /release, none twice.
    assert len(record_lines(served)) == 1, record_lines(served)
    # The server bound its own socket: the middleware capped its send buffer at
    # the first request, and said so once (tests/middleware/test_asgi_send_buffer.py).
    capped = [found for found in map(json_line, served.lines) if found.get("msg") == "send buffer capped"]
    assert len(capped) == 1 and capped[0]["listeners"] >= 1, served.lines
    assert not [line for line in served.lines if "backpressure cannot be seen" in line]


@pytest.mark.slow
def test_text_format_under_uvicorn_then_key_value_pairs_after_the_message(tmp_path: Path) -> None:
    with serve("uvicorn", app_source(extra='log_format="text"'), tmp_path) as served:
        response = httpx.post(served.base + "/v1/chat/completions", json=chat_body(),
                              headers={"x-request-id": "text-1"}, timeout=WAIT_S)
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        line = served.wait_line(lambda text: "stream ended" in text)
    assert re.match(r"^\d{4}-\d\d-\d\dT[\d:.]+Z INFO tokenwire\.middleware: stream ended ", line), line
    for pair in ('request_id="text-1"', "status=200", 'end_reason="complete"',
                 f"tokens_out={COMPLETION_TOKENS}", 'tokens_source="usage"',
                 f"bytes_out={len(response.content)}"):
        assert f" {pair}" in line, (pair, line)
    assert len(record_lines(served)) == 1


@pytest.mark.slow
def test_basic_config_when_the_app_configures_logging_then_its_handler_writes_the_fields_once(
        tmp_path: Path) -> None:
    """The issue's case: ``logging.basicConfig`` printed ``INFO:tokenwire.middleware:stream
    ended`` without a field. The app's handler writes the line, with the fields;
    the middleware adds no handler of its own (no line twice)."""
    prelude = "import logging\nlogging.basicConfig(level=logging.INFO)\n"
    with serve("uvicorn", app_source(prelude=prelude), tmp_path) as served:
        response = httpx.post(served.base + "/v1/chat/completions", json=chat_body(),
                              headers={"x-request-id": "basic-1"}, timeout=WAIT_S)
        assert response.status_code == 200
        served.wait_line(lambda text: "stream ended" in text)
    # The process has ended and all it wrote was read: the one line, in the app's format.
    (line,) = record_lines(served)
    assert line.startswith('INFO:tokenwire.middleware:stream ended request_id="basic-1" '), line
    assert "status=200" in line and f"tokens_out={COMPLETION_TOKENS}" in line


@pytest.mark.slow
def test_log_format_off_under_uvicorn_then_no_record_line(tmp_path: Path) -> None:
    with serve("uvicorn", app_source(extra='log_format="off"'), tmp_path) as served:
        response = httpx.post(served.base + "/v1/chat/completions", json=chat_body(), timeout=WAIT_S)
        assert response.status_code == 200
        # Counted when the core finished the stream, in the call that would have logged it.
        wait_for(lambda: sample(httpx.get(served.base + "/metrics", timeout=WAIT_S).text,
                                "tokenwire_streams_ended_total", reason="complete", **LABELS) == 1,
                 "the stream's end was never counted")
    assert not record_lines(served), record_lines(served)  # all the process wrote was read


# ---------------------------------------------------------------- in process


def free_logger(name: str) -> logging.Logger:
    """A logger outside logging's tree (no root above it): what the middleware's is
    under a server that configured only its own loggers."""
    return logging.Logger(name)


def test_default_handler_when_nothing_handles_the_logger_then_it_writes_until_logging_is_configured() -> None:
    log = free_logger("tokenwire.middleware")
    out = io.StringIO()
    handler = install_default_handler(log, "json", out)
    assert isinstance(handler, DefaultHandler) and log.level == logging.INFO
    assert install_default_handler(log, "text", out) is None  # once: the format follows the call
    log.info("stream ended", extra={"fields": {"request_id": "r-1", "status": 200}})
    (line,) = out.getvalue().splitlines()
    assert line.split(" INFO tokenwire.middleware: ")[1] == 'stream ended request_id="r-1" status=200'
    # The program configures logging later: its handler writes, the default one stands aside.
    theirs = io.StringIO()
    configured = logging.StreamHandler(theirs)
    configured.setFormatter(JsonFormatter())
    log.addHandler(configured)
    log.info("stream ended", extra={"fields": {"request_id": "r-2"}})
    assert len(out.getvalue().splitlines()) == 1
    assert json.loads(theirs.getvalue())["request_id"] == "r-2"


def test_default_handler_when_logging_is_configured_then_not_installed() -> None:
    parent = free_logger("tokenwire")
    parent.addHandler(logging.NullHandler())
    log = free_logger("tokenwire.middleware")
    log.parent = parent
    assert install_default_handler(log, "json") is None
    assert log.handlers == [] and log.level == logging.NOTSET


def test_fields_in_message_when_a_plain_formatter_then_the_fields_are_in_the_message() -> None:
    log = free_logger("tokenwire.middleware")
    log.setLevel(logging.INFO)
    log.addFilter(FieldsInMessage())
    plain, ours = io.StringIO(), io.StringIO()
    for stream, formatter in ((plain, logging.Formatter(logging.BASIC_FORMAT)), (ours, JsonFormatter())):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.info("stream ended", extra={"fields": {"request_id": "r-3", "ttft_s": 0.5, "error_code": None}})
    log.warning("plain %s", "args")
    assert plain.getvalue().splitlines() == [
        'INFO:tokenwire.middleware:stream ended request_id="r-3" ttft_s=0.5',
        "WARNING:tokenwire.middleware:plain args"]
    first = json.loads(ours.getvalue().splitlines()[0])
    assert first["msg"] == "stream ended" and first["request_id"] == "r-3" and first["error_code"] is None


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_metrics_when_the_client_leaves_mid_stream_then_ended_as_client_gone_on_its_own_registry() -> None:
    registry = CollectorRegistry()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(2):
            await send({"type": "http.response.body", "body": f"data: {chat_chunk(f't{i} ')}\n\n".encode(),
                        "more_body": True})
        await asyncio.Event().wait()  # the client leaves first: the middleware cancels this

    middleware = TokenWireMiddleware(app, metrics=registry)
    again = TokenWireMiddleware(app, metrics=registry)  # one registry, one set of metrics
    assert middleware.metrics is again.metrics is MiddlewareMetrics.on(registry)

    def scrape() -> str:
        return generate_latest(registry).decode()

    with running_server(middleware, "uvicorn-h11") as port:
        sock = open_request(port, "/v1/chat/completions", method="POST")
        try:
            sock.settimeout(WAIT_S)
            received = b""
            while b"t1 " not in received:
                received += sock.recv(65536)
            wait_for(lambda: sample(scrape(), "tokenwire_active_streams") == 1, "not active")
        finally:
            sock.close()
        wait_for(lambda: sample(scrape(), "tokenwire_streams_ended_total", reason="client_gone",
                                **LABELS) == 1, "the departure was not counted")
        wait_for(lambda: sample(scrape(), "tokenwire_active_streams") == 0, "still active")
    text = scrape()
    assert sample(text, "tokenwire_stream_errors_total", number="E7301", code="cancelled") == 1
    assert sample(text, "tokenwire_time_to_first_token_seconds_count", **LABELS) == 1
    assert sample(text, "tokenwire_streams_ended_total", reason="complete", **LABELS) is None


@pytest.mark.slow
def test_metrics_path_when_served_then_the_middleware_answers_it_and_counts_no_stream() -> None:
    registry = CollectorRegistry()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("the app must not see /metrics")

    with running_server(TokenWireMiddleware(app, metrics=registry, metrics_path="/metrics"),
                        "uvicorn-h11") as port:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert sample(response.text, "tokenwire_active_streams") == 0
    assert sample(response.text, "tokenwire_streams_ended_total") is None
    promtool_check(response.text)


def test_settings_when_wrong_then_refused() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None: ...

    with pytest.raises(ConfigError, match="log_format"):
        TokenWireMiddleware(app, log_format="xml")
    with pytest.raises(ConfigError, match="metrics_path"):
        TokenWireMiddleware(app, metrics_path="/metrics")
