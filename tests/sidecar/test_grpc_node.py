"""@grpc/grpc-js (Node) through the sidecar's gRPC: one node process runs the cases
(tests/compat/clients/node/grpc_cases.mjs, installed by scripts/node-deps.sh)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningSidecar
from upstreams import FakeUpstream, expected_text

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests/compat/clients/node"
PROTO = ROOT / "tokenwire/v1/streaming.proto"
OK, CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE = 0, 1, 4, 14

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    shutil.which("node") is None or not (NODE_DIR / "node_modules/@grpc/grpc-js").is_dir(),
    reason="node and @grpc/grpc-js (scripts/node-deps.sh) are needed")]


def _run(target: str, cases: list[dict[str, Any]]) -> dict[str, Any]:
    result = subprocess.run(["node", str(NODE_DIR / "grpc_cases.mjs"), str(PROTO)], cwd=NODE_DIR,
                            input=json.dumps({"target": target, "cases": cases}), capture_output=True,
                            text=True, timeout=60, check=True)
    return dict(json.loads(result.stdout))


def _chat(request_id: str, tokens: int, delay_s: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "service": "ChatCompletions",
            "request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "metadata": {"x-request-id": request_id, "x-fake-tokens": str(tokens),
                         "x-fake-delay-s": str(delay_s)}, **extra}


def test_grpcjs_normal_cancel_deadline(start_sidecar: Callable[..., RunningSidecar],
                                     upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    results = _run(f"{sidecar.host}:{sidecar.port}", [
        _chat("node-normal", 12),
        _chat("node-cancel", 500, 0.02, cancel_after=2),
        _chat("node-deadline", 500, 0.02, deadline_ms=400),
        {"id": "node-cmpl", "service": "Completions", "request": {"model": "m", "prompt": "p"},
         "metadata": {"x-request-id": "node-cmpl", "x-fake-tokens": "3"}},
    ])
    normal = results["node-normal"]
    assert normal["code"] == OK
    assert "".join(normal["texts"]) == expected_text(12)
    assert normal["initial"]["x-request-id"] == "node-normal"
    assert results["node-cancel"]["code"] == CANCELLED
    assert results["node-deadline"]["code"] == DEADLINE_EXCEEDED
    assert results["node-cmpl"]["code"] == OK
    for request_id in ("node-cancel", "node-deadline"):
        assert upstream.connection_of(request_id).closed.wait(5)


def test_grpcjs_upstream_death_unavailable_with_the_code(start_sidecar: Callable[..., RunningSidecar],
                                                     upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(upstreams=f"{upstream.url}/die")
    result = _run(f"{sidecar.host}:{sidecar.port}", [_chat("node-die", 10)])["node-die"]
    assert result["code"] == UNAVAILABLE
    assert result["texts"]
    assert result["trailing"]["tokenwire-error-code"] == "upstream_failed"


def test_grpcjs_resume(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    target = f"{sidecar.host}:{sidecar.port}"
    first = _run(target, [_chat("node-resume", 30, 0.02, cancel_after=3)])["node-resume"]
    assert first["code"] == CANCELLED
    stream_id = first["initial"]["x-tokenwire-stream-id"]
    ids = first["event_ids"]
    assert ids[:3] == [f"{stream_id}.1", f"{stream_id}.2", f"{stream_id}.3"]
    again = _chat("node-resume-2", 30)
    again["metadata"] = {"last-event-id": ids[-1], "x-request-id": "node-resume-2"}
    rest = _run(target, [again])["node-resume-2"]
    assert rest["code"] == OK
    assert "".join(first["texts"] + rest["texts"]) == expected_text(30)
