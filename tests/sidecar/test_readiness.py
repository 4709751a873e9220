"""``/readyz`` tells the truth: its rules sans-IO, and a real sidecar in front of
an address where nothing listens (``process/readiness.py``)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import RunningSidecar, make_config
from tokenwire.middleware import ConfigError
from tokenwire.sidecar.balance import HealthSettings, PodState
from tokenwire.sidecar.process.readiness import Readiness, upstream_reason
from tokenwire.sidecar.settings import build_config
from upstreams import FakeUpstream

SETTINGS = HealthSettings(unhealthy_threshold=2, healthy_threshold=2)


def _pods(*states: dict[str, Any]) -> list[PodState]:
    pods = []
    for index, state in enumerate(states):
        pod = PodState(f"http://10.0.0.{index}:8000")
        for name, value in state.items():
            setattr(pod, name, value)
        pods.append(pod)
    return pods


def _never(address: str) -> bool | None:
    return None


def _code(reason: Any) -> str | None:
    return None if reason is None else str(reason.code)


# ---------------------------------------------------------------- the pod's first pass


def test_a_pod_that_never_passed_goes_in_on_its_first_pass() -> None:
    pod = PodState("http://e:1")
    assert pod.health_result(False, SETTINGS) is False
    assert pod.health_result(False, SETTINGS) is True and not pod.healthy
    # An engine that was loading: one pass puts it in, no flapping to damp yet.
    assert pod.health_result(True, SETTINGS) is True and pod.healthy and pod.health_passed


def test_a_pod_that_fell_out_after_passing_needs_the_healthy_threshold() -> None:
    pod = PodState("http://e:1")
    pod.health_result(True, SETTINGS)
    pod.health_result(False, SETTINGS)
    pod.health_result(False, SETTINGS)
    assert not pod.healthy
    assert pod.health_result(True, SETTINGS) is False and not pod.healthy
    assert pod.health_result(True, SETTINGS) is True and pod.healthy


# ---------------------------------------------------------------- the upstream rule


def test_with_health_checks_a_pod_counts_once_it_passed_and_while_it_is_in() -> None:
    def reason(*states: dict[str, Any]) -> str | None:
        return _code(upstream_reason(_pods(*states), _never, health_path="/health", now=0.0))

    assert reason({}) == "no_healthy_upstream"  # not checked yet: not known to be up
    assert reason({"health_passed": True}) is None
    assert reason({"health_passed": True, "healthy": False}) == "no_healthy_upstream"
    assert reason({"healthy": False}, {"health_passed": True}) is None
    assert reason({"health_passed": True, "draining": True}) == "no_upstream"
    assert reason({"health_passed": True, "removed": True}) == "no_upstream"
    assert reason() == "no_upstream"


def test_without_health_checks_a_pod_counts_unless_its_last_connect_failed() -> None:
    pods = _pods({}, {})
    failed = {pods[0].address: False, pods[1].address: False}

    def reason(connected: dict[str, bool]) -> str | None:
        return _code(upstream_reason(pods, connected.get, health_path="", now=0.0))

    assert reason({}) is None  # nothing tried yet: nothing says it is down
    assert reason(failed) == "upstreams_unreachable"
    assert reason({**failed, pods[1].address: True}) is None
    pods[1].draining = True
    assert reason({pods[1].address: True, pods[0].address: False}) == "upstreams_unreachable"


def test_the_body_names_each_reason_and_draining_alone() -> None:
    reason = upstream_reason([], _never, health_path="", now=0.0)
    assert reason is not None
    assert Readiness().body() == {"status": "ready"} and Readiness().status == 200
    verdict = Readiness((reason,))
    assert verdict.status == 503
    assert verdict.body() == {"status": "not_ready",
                              "reasons": [{"code": "no_upstream", "message": "no upstream is listed"}]}
    assert Readiness((reason,), draining=True).body() == {"status": "draining"}


@pytest.mark.parametrize("key", ["ready_requires_upstream", "ready_requires_store"])
def test_the_relaxing_keys_are_booleans_on_every_layer(key: str) -> None:
    upstream = {"upstream": ["http://a:1"]}
    assert getattr(build_config(flags=upstream), key) is True
    assert getattr(build_config(flags={**upstream, key: "false"}), key) is False
    assert getattr(build_config(flags=upstream, environ={f"TOKENWIRE_{key.upper()}": "false"}), key) is False
    assert getattr(build_config(flags=upstream, file_values={key: False}), key) is False
    with pytest.raises(ConfigError) as refused:
        build_config(flags=upstream, file_values={key: "no"})
    assert refused.value.key == key


# ---------------------------------------------------------------- a real sidecar


def _closed_port() -> str:
    """An address where nothing listens (a port bound and let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _readyz(sidecar: RunningSidecar) -> tuple[int, dict[str, Any]]:
    answer = httpx.get(sidecar.admin_url + "/readyz", timeout=5)
    return answer.status_code, json.loads(answer.content)


def test_readyz_is_503_from_the_start_with_health_checks_and_the_engine_unreachable(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(_closed_port(), health_path="/health", health_interval_s=60.0)
    status, body = _readyz(sidecar)
    assert status == 503 and [r["code"] for r in body["reasons"]] == ["no_healthy_upstream"]
    assert "GET /health" in body["reasons"][0]["message"]
    assert httpx.get(sidecar.admin_url + "/healthz").status_code == 200  # liveness is not readiness


def test_without_health_checks_readyz_is_503_once_a_connect_failed(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(_closed_port(), health_interval_s=60.0)
    # Nothing has tried the pod yet: nothing says it is down (no probe costs a ready sidecar).
    assert _readyz(sidecar) == (200, {"status": "ready"})
    answer = httpx.post(sidecar.url + "/v1/chat/completions", json={"stream": True}, timeout=10)
    assert answer.status_code in (502, 503)
    status, body = _readyz(sidecar)
    assert status == 503 and [r["code"] for r in body["reasons"]] == ["upstreams_unreachable"]


def test_readyz_is_200_at_once_when_the_engine_passes_its_first_check(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    # The first check runs at start-up, not one interval (60 s here) later.
    sidecar = start_sidecar(upstream.url, health_path="/health", health_interval_s=60.0)
    assert _readyz(sidecar) == (200, {"status": "ready"})


def test_ready_requires_upstream_false_answers_200_with_the_engine_unreachable(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    for health_path in ("/health", ""):
        sidecar = start_sidecar(_closed_port(), health_path=health_path, health_interval_s=60.0,
                                ready_requires_upstream=False)
        assert _readyz(sidecar) == (200, {"status": "ready"})


def test_a_memory_store_is_always_reachable(start_sidecar: Callable[..., RunningSidecar],
                                            upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(upstream.url, resume=True)
    assert _readyz(sidecar) == (200, {"status": "ready"})


def test_make_config_keeps_both_readiness_keys_on_by_default() -> None:
    config = make_config("http://a:1")
    assert config.ready_requires_upstream and config.ready_requires_store


def test_grpc_health_says_what_readyz_says(start_sidecar: Callable[..., RunningSidecar],
                                           upstream: FakeUpstream) -> None:
    """Kubernetes' gRPC probes read ``grpc.health.v1``: NOT_SERVING while the only
    engine is unreachable (as ``/readyz``'s 503), SERVING with one that passed."""
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    down = start_sidecar(_closed_port(), health_path="/health", health_interval_s=60.0)
    up = start_sidecar(upstream.url, health_path="/health", health_interval_s=60.0)
    for sidecar, status in ((down, health_pb2.HealthCheckResponse.NOT_SERVING),
                            (up, health_pb2.HealthCheckResponse.SERVING)):
        with grpc.insecure_channel(f"{sidecar.host}:{sidecar.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == status
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="tokenwire.v1.ChatCompletions"),
                               timeout=5)
            assert next(watch).status == status
            watch.cancel()
        assert _readyz(sidecar)[0] == (200 if status == health_pb2.HealthCheckResponse.SERVING else 503)
