"""The scheduler in a process of its own: served over real uvicorn, its failures and its end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from tokenwire.engine.api import build_app
from tokenwire.engine.backend import BackendStats, RequestOutput
from tokenwire.engine.config import EngineConfig, usable_cpus
from tokenwire.engine.scheduler_process import (
    LaunchedScheduler,
    SchedulerProcessError,
    SchedulerProcessRunner,
    SchedulerSpec,
    _decode,
    _encode,
    _FrameReader,
    _FrameWriter,
    _Step,
    launch_scheduler,
)

pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from conftest import RunningServer

CONFIG = EngineConfig(max_running=32, kv_budget_tokens=4096, max_prefill_tokens_per_step=64,
                      scheduler_process=True)


def _launch(model_dir: Path) -> LaunchedScheduler:
    return launch_scheduler(SchedulerSpec(model_path=str(model_dir), name="tiny", device="cpu",
                                          dtype="float32", threads=1, config=CONFIG,
                                          log_level="warning"), timeout_s=300)


@pytest.fixture(scope="module")
def process_server(tiny_model_dir: Path, serve_engine: Any) -> Iterator[RunningServer]:
    launched = _launch(tiny_model_dir)
    with serve_engine(build_app(launched.front_model(), CONFIG, launched=launched)) as running:
        yield running
    launched.process.join(15)
    assert not launched.process.is_alive(), "the lifespan's end stops the scheduler process"


def _wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def _metric(server: RunningServer, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _completion(base_url: str, prompt: str, max_tokens: int) -> str:
    response = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_the_up_pipes_messages_arrive_whole_however_the_reads_split_them() -> None:
    """A real pipe: a step bigger than the pipe's buffer arrives in pieces, read as they
    come without blocking; the reader hands out only whole messages, in order, every field
    of every output intact, and the writer's end is an EOFError."""
    import threading

    outputs = [RequestOutput(f"cmpl-{i}", "é" * 50, (i, i + 1), 7, i, finished=i % 3 == 0,
                             finish_reason="length" if i % 3 == 0 else None, admitted_s=1.5 * i)
               for i in range(4000)]
    sent = [_Step(_encode(outputs[:1])), _Step(_encode(outputs), 0.01, BackendStats(1, 2, 3, 4, 5)),
            _Step([], 0.02, BackendStats(0, 0, 0, 0, 0))]
    read_fd, write_fd = os.pipe()
    reader, writer = _FrameReader(read_fd), _FrameWriter(write_fd)

    def write_all() -> None:
        for message in sent:
            writer.send(message)
        os.close(write_fd)

    thread = threading.Thread(target=write_all)
    thread.start()
    received: list[object] = []
    reads = 0
    try:
        while len(received) < len(sent):
            assert reader.wait(30)
            received.extend(reader.read())
            reads += 1
        assert received == sent
        assert _decode(received[1].rows) == outputs  # type: ignore[attr-defined]
        assert reads > 2, "the big step came in more than one read"
        thread.join(30)
        assert reader.wait(30)
        with pytest.raises(EOFError):
            reader.read()
    finally:
        thread.join(30)
        os.close(read_fd)


def test_answers_as_the_in_process_engine_does(
    process_server: RunningServer, engine_server: RunningServer
) -> None:
    assert process_server.app.state.engine.backend is None
    for prompt in ("The kitchen is", "Once upon a time"):
        assert _completion(process_server.base_url, prompt, 24) == \
            _completion(engine_server.base_url, prompt, 24)


def test_streams_end_with_done_and_usage(process_server: RunningServer) -> None:
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 12, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{process_server.base_url}/v1/completions", json=body) as response:
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["usage"]["completion_tokens"] == 12
    assert json.loads(data[-3])["choices"][0]["finish_reason"] == "length"


def test_queue_wait_and_prefill_are_measured_across_the_pipe(process_server: RunningServer) -> None:
    """A request's first output carries its admission time up the pipe: without it the
    front's queue-wait and prefill histograms would never see a request."""
    queued = _metric(process_server, "tokenwire_engine_queue_wait_seconds_count")
    prefilled = _metric(process_server, "tokenwire_engine_prefill_seconds_count")
    steps = _metric(process_server, "tokenwire_engine_step_seconds_count")
    assert _completion(process_server.base_url, "The harbour", 6)
    assert _metric(process_server, "tokenwire_engine_queue_wait_seconds_count") == queued + 1
    assert _metric(process_server, "tokenwire_engine_prefill_seconds_count") == prefilled + 1
    # One report per step (time and load travel with the step's outputs).
    assert _metric(process_server, "tokenwire_engine_step_seconds_count") >= steps + 6


def test_refusals_are_http_errors_checked_in_the_front(process_server: RunningServer) -> None:
    response = httpx.post(f"{process_server.base_url}/v1/completions",
                          json={"model": "tiny", "prompt": "x", "max_tokens": 100_000})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def test_a_client_that_leaves_frees_its_row_in_the_scheduler_process(
    process_server: RunningServer,
) -> None:
    aborted_before = _metric(process_server, 'tokenwire_engine_requests_finished_total'
                             '{finish_reason="abort"}')
    body = {"model": "tiny", "prompt": "Leaving early", "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{process_server.base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert _metric(process_server, "tokenwire_engine_running") == 1
    # Leaving the block closed the connection mid-stream: the row goes at the next step,
    # whose load report (one per step, from the scheduler process) says so.
    _wait_until(lambda: _metric(process_server, "tokenwire_engine_running") == 0)
    _wait_until(lambda: _metric(process_server, 'tokenwire_engine_requests_finished_total'
                                '{finish_reason="abort"}') == aborted_before + 1)
    assert httpx.get(f"{process_server.base_url}/health").json()["status"] == "ok"


def test_the_abort_endpoint_ends_the_stream_and_frees_the_row_in_the_scheduler_process(
    process_server: RunningServer,
) -> None:
    rest = process_server.abort_mid_stream("abort-in-process", max_tokens=3000, timeout_s=60)
    assert json.loads(rest[-1][len("data:"):])["error"]["code"] == "cancelled"
    _wait_until(lambda: _metric(process_server, "tokenwire_engine_running") == 0)
    assert httpx.post(f"{process_server.base_url}/v1/abort/abort-in-process").status_code == 404


def test_a_dead_scheduler_process_ends_streams_in_band_and_refuses_new_requests(
    tiny_model_dir: Path, serve_engine: Any,
) -> None:
    launched = _launch(tiny_model_dir)
    with serve_engine(build_app(launched.front_model(), CONFIG, launched=launched)) as server:
        runner = server.app.state.engine.runner
        assert isinstance(runner, SchedulerProcessRunner) and runner.pid is not None
        body = {"model": "tiny", "prompt": "Doomed", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(runner.pid, signal.SIGKILL)
            rest: list[str] = []
            # After an in-band error the middleware cuts the body (a client must
            # not take it for a complete answer), so the read ends in an error.
            with pytest.raises(httpx.RemoteProtocolError):
                rest.extend(line for line in lines if line.startswith("data:"))
        error = json.loads(rest[-1][len("data: "):])["error"]
        assert "scheduler process exited" in error["message"]
        assert "[DONE]" not in "".join(rest)
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.json()["status"] == "scheduler_down"
        refused = httpx.post(f"{server.base_url}/v1/completions",
                             json={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert refused.status_code == 503


def test_a_model_that_fails_to_load_is_reported_with_the_childs_error(
    tiny_model_dir: Path, tmp_path: Path,
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))
    with pytest.raises(SchedulerProcessError) as raised:
        _launch(broken)
    assert "no-such-arch" in str(raised.value)


@pytest.mark.skipif(usable_cpus() < 2, reason="the scheduler process is the default with two CPUs or more")
def test_tokenwire_engine_by_default_runs_a_scheduler_process_drains_on_sigterm_and_takes_it_along(
    tiny_model_dir: Path,
) -> None:
    port = _free_port()
    # No placement flag: what ``tokenwire engine`` does by default.
    engine = subprocess.Popen(
        [sys.executable, "-m", "tokenwire.engine.server", "--model", str(tiny_model_dir),
         "--listen", f"127.0.0.1:{port}", "--device", "cpu",
         "--log-level", "info", "--served-model-name", "tiny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base_url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert engine.poll() is None, engine.stderr.read() if engine.stderr else b""
            try:
                return httpx.get(f"{base_url}/health").status_code == 200
            except httpx.TransportError:
                return False

        _wait_until(healthy, timeout_s=180)
        children = Path(f"/proc/{engine.pid}/task/{engine.pid}/children").read_text().split()
        assert children, "the scheduler process is a child of the server"
        assert _completion(base_url, "The kitchen is", 8)
        body = {"model": "tiny", "prompt": "Draining", "max_tokens": 40, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{base_url}/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert next(lines)
            # A stream under way when SIGTERM arrives is finished, not cut.
            engine.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        # uvicorn shuts down, then re-raises the signal it caught: -15 is a clean exit.
        assert engine.wait(30) in (0, -signal.SIGTERM)
        for child in children:
            _wait_until(lambda: _exited(int(child)), 30)  # noqa: B023 (waited on at once)
        # Both processes log as the server does (JSON lines): no progress bar, no
        # resource-tracker warning from the child.
        assert engine.stderr is not None
        not_json = [line for line in engine.stderr.read().decode().splitlines()
                    if not line.startswith("{")]
        assert not not_json, not_json
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)


def _exited(pid: int) -> bool:
    """Gone, or a zombie (its parent, the server, has exited without reaping it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
