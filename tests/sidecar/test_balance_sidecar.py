"""The balancer inside an in-process sidecar (real sockets, the shared fake upstream)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from clients import chat_body, connect, exchange, read_response, request_bytes, reset, wait_for
from conftest import LoopThread, make_config
from tokenwire.middleware import ConfigError
from tokenwire.sidecar.upstream.pools import UpstreamPools
from upstreams import FakeUpstream


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_abort_url_that_is_a_path_goes_to_the_pod_that_ran_the_stream(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(abort_url="/abort/{request_id}")
    sock = connect(sidecar.port)
    sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                               headers={"x-fake-silence-s": "30", "X-Request-Id": "abort-pod"}))
    assert read_response(sock, head_only=True).status == 200
    upstream_id = upstream.requests_with("abort-pod")[-1].headers["x-request-id"]
    reset(sock)
    wait_for(lambda: any(r.path == f"/abort/{upstream_id}" for r in upstream.requests))


def test_a_refused_pod_is_ejected_and_the_retries_go_to_the_other(
        start_sidecar, upstream: FakeUpstream) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    sidecar = start_sidecar([dead, upstream.url], retry_backoff_s=0.01, outlier_consecutive_failures=2,
                            outlier_base_ejection_s=60.0, balance="round-robin")
    for i in range(6):
        response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                            headers={"X-Request-Id": f"eject-{i}"})
        assert response.status == 200 and response.clean_end
    retries = [sidecar.record(f"eject-{i}").retries for i in range(6)]
    # Round robin sends the first and third to the dead pod (retried on the live one);
    # after its second failure it is ejected and nothing more goes there.
    assert retries == [1, 0, 1, 0, 0, 0]
    assert all(sidecar.record(f"eject-{i}").upstream == upstream.url for i in range(6))
    pools = sidecar.sidecar.context.pools  # type: ignore[union-attr]
    pod = pools.balancer.pod(dead)
    assert pod is not None and pod.ejections == 1 and pod.failures == 2


def test_a_name_that_does_not_resolve_keeps_the_set_empty_and_refuses_at_once(
        loop_thread: LoopThread) -> None:
    async def check() -> tuple[list[str], object]:
        pools = UpstreamPools(make_config("dns+http://no-such-name.invalid:8000"))
        await pools.refresh()
        answer = pools.request("t", body=b"", exclude=frozenset(), on_answer=lambda _: None)
        await pools.aclose()
        return pools.names, answer

    names, answer = loop_thread.run(check())
    assert names == []
    assert type(answer).__name__ == "Refusal"


def test_localhost_resolves_into_the_set(loop_thread: LoopThread) -> None:
    async def check() -> list[str]:
        pools = UpstreamPools(make_config("dns+http://localhost:8000/v1 weight=3"))
        await pools.refresh()
        names = pools.names
        weights = {pod.address: pod.weight for pod in pools.balancer.pods}
        await pools.aclose()
        assert set(weights.values()) == {3}
        return names

    assert "http://127.0.0.1:8000/v1" in loop_thread.run(check())


@pytest.mark.parametrize(("key", "value"), [("balance", "random"), ("load_metrics", "triton"),
                                            ("outlier_max_ejected_share", 1.5), ("health_path", "health"),
                                            ("max_streams_per_upstream", -1), ("queue_timeout_s", 0.0)])
def test_bad_balancing_keys_name_themselves(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        make_config("http://a:1", **{key: value})
    assert caught.value.key == key


def test_pools_built_outside_a_loop_do_nothing_until_started() -> None:
    pools = UpstreamPools(make_config(["http://a:1", "http://b:2 weight=2"]))
    assert pools.names == ["http://a:1", "http://b:2"]
    assert pools.upstreams == []  # pools per pod are made on first use
    asyncio.run(pools.aclose())


def test_metrics_and_the_admin_list_show_each_upstream(start_sidecar, upstream: FakeUpstream) -> None:
    import httpx

    dead = f"http://127.0.0.1:{_closed_port()}"
    sidecar = start_sidecar([upstream.url, dead], balance="round-robin", retry_backoff_s=0.01)
    for i in range(4):
        assert exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                        headers={"X-Request-Id": f"metrics-{i}"}).clean_end
    text = httpx.get(sidecar.admin_url + "/metrics").text
    assert f'tokenwire_upstream_requests_total{{upstream="{upstream.url}"}} 4.0' in text
    assert f'tokenwire_upstream_failures_total{{upstream="{dead}"}} 2.0' in text
    assert f'tokenwire_upstream_open_streams{{upstream="{upstream.url}"}} 0.0' in text
    assert f'tokenwire_upstream_up{{upstream="{dead}"}} 1.0' in text  # 2 failures: not yet ejected
    assert f'tokenwire_upstream_picks_total{{reason="round-robin",upstream="{dead}"}} 2.0' in text
    assert "tokenwire_upstream_queue_depth 0.0" in text
    listed = {e["address"]: e for e in httpx.get(sidecar.admin_url + "/upstreams").json()["upstreams"]}
    assert listed[dead]["failures"] == 2 and listed[upstream.url]["requests"] == 4
    assert listed[upstream.url]["last_pick_reason"] == "round-robin"
    status = httpx.post(sidecar.admin_url + "/upstreams/nowhere:1/drain").status_code
    assert status == 404
