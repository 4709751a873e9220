"""``tokenwire up`` as a user runs it: the sidecar's and the engine's time to first
token agree, every log line of both is one JSON object, and no secret reaches a log.

The engine sends its role chunk at once and its first token after the prefill;
the sidecar used to time the role chunk (0.1 s against the engine's 0.8 s).
Now both time the first token, each at its own end of the Unix socket between
them, so on the same request they differ by the hop alone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.targets import child_lines, tokenwire_up

pytestmark = pytest.mark.slow

_REQUESTS = 20
# The target is 5 ms at the median (docs/perf/telemetry.md: ~2 ms on an idle
# machine). What separates the two clocks is two socket hops between processes, and
# on a machine with a run queue of 6 per core each hop can take several ms to be
# scheduled; the bound here holds there too and still fails the old 700 ms by far.
_AGREEMENT_S = 0.025
_SECRETS = ("Bearer sk-SECRET-TOKEN-6f1d2", "session=COOKIE-SECRET-93a1", "PROMPT-SECRET-7c2e")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_sidecar_and_engine_ttft_agree_logs_are_json_and_hold_no_secrets(
        tiny_cache: tuple[Path, Path], tmp_path: Path) -> None:
    cache_dir, model_dir = tiny_cache
    # Debug shows every lifecycle line, which must be as free of secrets as the rest.
    debug = {"TOKENWIRE_LOG_LEVEL": "debug", "TOKENWIRE_ENGINE_LOG_LEVEL": "debug"}
    log_path = tmp_path / "up.log"
    with tokenwire_up(model_dir, cache_dir, log_path, env=debug) as up:
        base = f"http://127.0.0.1:{up.port}/v1"
        headers = {"Authorization": _SECRETS[0], "Cookie": _SECRETS[1]}
        completions: list[str] = []
        with httpx.Client(timeout=60) as client:
            for i in range(_REQUESTS + 1):  # the first one warms both up, and is not counted
                body = {"stream": True, "max_tokens": 8, "temperature": 0,
                        "messages": [{"role": "user", "content": f"{_SECRETS[2]} number {i}"}]}
                text: list[str] = []
                with client.stream("POST", f"{base}/chat/completions", json=body,
                                   headers={**headers, "X-Request-Id": f"ttft-{i}"}) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            text.append(delta.get("content") or "")
                completions.append("".join(text))
    logged = log_path.read_text()
    sidecar_lines = child_lines(logged, "sidecar")
    engine_lines = child_lines(logged, "engine")
    not_json = [line for line in sidecar_lines + engine_lines
                if not line.startswith("{") and not line.startswith("ready ")]
    assert not not_json, not_json  # every line of both is one JSON object (but the ready line)
    sidecar = [json.loads(line) for line in sidecar_lines if not line.startswith("ready ")]
    engine = [json.loads(line) for line in engine_lines]
    for entry in sidecar + engine:
        assert entry["ts"].endswith("Z") and entry["level"] in ("debug", "info", "warning", "error")
    streams: dict[str, dict[str, Any]] = {e["request_id"]: e for e in sidecar if e["msg"] == "stream ended"}
    finished = {e["request_id"]: e for e in engine if e["msg"] == "request finished"}
    lifecycle = {e["msg"] for e in sidecar if e["logger"] == "tokenwire.lifecycle"}
    assert {"accepted", "committed", "first token", "ended"} <= lifecycle
    differences_s: list[float] = []
    for i in range(1, _REQUESTS + 1):
        stream = streams[f"ttft-{i}"]
        assert stream["method"] == "POST" and stream["path"] == "/v1/chat/completions"
        assert stream["client"] == "127.0.0.1" and stream["started_at"].endswith("Z")
        engine_side = finished[stream.get("upstream_request_id", stream["request_id"])]
        differences_s.append(stream["ttft_s"] - engine_side["ttft_s"])
    median_s = statistics.median(differences_s)
    print(f"sidecar TTFT - engine TTFT over {_REQUESTS} requests: median {median_s * 1e3:.2f} ms, "
          f"min {min(differences_s) * 1e3:.2f} ms, max {max(differences_s) * 1e3:.2f} ms")
    assert abs(median_s) <= _AGREEMENT_S, differences_s
    for secret in (*_SECRETS, "sk-SECRET", "COOKIE-SECRET"):
        assert secret not in logged
    for completion in completions:
        if len(completion) >= 8:  # long enough not to be a field name by chance
            assert completion not in logged


_ECHOED_LINES = 5000
# Two children of ``up --verbose`` logging at once, as the engine and the sidecar do.
_TWO_CHATTY_CHILDREN = f"""
import sys
from tokenwire.tools.up import Child
program = "import json\\nfor i in range({_ECHOED_LINES}): print(json.dumps({{'i': i, 'pad': 'x' * 200}}))"
children = [Child(name, [sys.executable, "-c", program], echo=True) for name in ("engine", "sidecar")]
for child in children:
    child.process.wait()
    child.pump.join(30)
"""


def test_up_echo_two_children_logging_at_once_every_echoed_line_is_one_whole_line_of_one_child(
        tmp_path: Path) -> None:
    """``up --verbose`` echoes each child's lines from its own thread into one
    stderr: a line must never be split by the other child's (it was, when the
    echo wrote a line and its newline apart: a sidecar line with an engine
    line stuck to it, "Extra data" to a JSON reader)."""
    log_path = tmp_path / "echo.log"
    with log_path.open("w") as log:
        done = subprocess.run([sys.executable, "-c", _TWO_CHATTY_CHILDREN], stderr=log, timeout=120)
    assert done.returncode == 0
    logged = log_path.read_text()
    for child in ("engine", "sidecar"):
        lines = child_lines(logged, child)
        assert [json.loads(line)["i"] for line in lines] == list(range(_ECHOED_LINES))
    assert len(logged.splitlines()) == 2 * _ECHOED_LINES
