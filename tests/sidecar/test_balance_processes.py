"""Balancing with real processes: four fake engine pods (``testbed/fake_engine.py``,
controllable queues and speeds) behind one ``tokenwire sidecar`` process.

Which pod served a stream is read from the stream itself (every chunk names
its pod), from the pods' own counters and from the sidecar's admin port.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clients import RawResponse, exchange, wait_for
from processes import SidecarProcess, spawn

from testbed.fake_pods import FakePod, spawn_pod  # testbed/fake_pods.py

pytestmark = pytest.mark.slow

PATH = "/v1/chat/completions"


def body(system: str = "", user: str = "hi", max_tokens: int | None = None) -> bytes:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    payload: dict[str, Any] = {"model": "fake", "stream": True, "messages": messages}
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    return json.dumps(payload).encode()


def pod_of(response: RawResponse) -> str | None:
    for data in response.datas():
        if data.startswith("{"):
            pod = json.loads(data).get("pod")
            if pod:
                return str(pod)
    return None


def admin(sidecar: SidecarProcess, method: str, path: str) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{sidecar.admin_port}{path}", method=method,
                                     data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def states(sidecar: SidecarProcess) -> dict[str, str]:
    return {entry["address"]: entry["state"] for entry in admin(sidecar, "GET", "/upstreams")["upstreams"]}


def parallel(count: int, make: Callable[[int], RawResponse]) -> list[RawResponse]:
    results: list[RawResponse | None] = [None] * count

    def run(i: int) -> None:
        results[i] = make(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(result is not None for result in results)
    return [result for result in results if result is not None]


@pytest.fixture
def pods() -> Iterator[Callable[..., list[FakePod]]]:
    started: list[FakePod] = []

    def start(count: int, *args: str) -> list[FakePod]:
        new = [spawn_pod(f"pod{len(started) + i}", *args) for i in range(count)]
        started.extend(new)
        return new

    yield start
    for pod in started:
        pod.stop()


@pytest.fixture
def sidecars() -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(upstreams: list[str], *args: str) -> SidecarProcess:
        flags = [part for upstream in upstreams for part in ("--upstream", upstream)]
        process = spawn([*flags, "--drain-s", "0", *args])
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def test_least_outstanding_gives_the_slow_pod_fewer_streams(pods, sidecars) -> None:
    fast = pods(3, "--token-s", "0.01", "--tokens", "10")
    slow = pods(1, "--token-s", "0.04", "--tokens", "10")[0]
    sidecar = sidecars([pod.url for pod in [*fast, slow]])
    served: Counter[str] = Counter()

    def client(i: int) -> RawResponse:
        last = RawResponse()
        for _ in range(6):
            last = exchange(sidecar.port, "POST", PATH, body=body())
            assert last.status == 200 and last.clean_end
            served[pod_of(last) or "?"] += 1
        return last

    parallel(12, client)
    assert sum(served.values()) == 72
    assert served[slow.name] < min(served[pod.name] for pod in fast), served
    picks = admin(sidecar, "GET", "/upstreams")
    assert picks["policy"] == "least-outstanding"
    assert sum(entry["requests"] for entry in picks["upstreams"]) == 72


def test_round_robin_takes_turns_by_weight(pods, sidecars) -> None:
    a, b, c, d = pods(4)
    sidecar = sidecars([f"{a.url} weight=2", b.url, c.url, d.url], "--balance", "round-robin")
    order = [pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(50)]
    assert Counter(order) == {a.name: 20, b.name: 10, c.name: 10, d.name: 10}
    # Smooth: every five turns in a row hold the heavy pod's two, and one of each other's.
    assert all(Counter(order[i:i + 5]) == {a.name: 2, b.name: 1, c.name: 1, d.name: 1} for i in range(46))


def test_queue_aware_avoids_the_pod_whose_engine_queue_is_deep(pods, sidecars) -> None:
    busy, *others = pods(4, "--concurrency", "1", "--token-s", "0.02", "--tokens", "3")
    sidecar = sidecars([pod.url for pod in [busy, *others]], "--balance", "queue-aware",
                       "--load-poll-s", "0.05")
    # Load the busy pod behind the sidecar's back: only its /metrics tells.
    backlog = threading.Thread(target=parallel, args=(
        6, lambda i: exchange(busy.port, "POST", PATH, body=body(max_tokens=150))))
    backlog.start()
    wait_for(lambda: busy.stats()["waiting"] >= 4, timeout_s=10)
    wait_for(lambda: any(entry["load"] and entry["load"]["waiting"] >= 4
                         for entry in admin(sidecar, "GET", "/upstreams")["upstreams"]), timeout_s=10)
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(12))
    assert busy.name not in served, served
    assert busy.stats()["received"] == 6  # only the backlog
    entries = {entry["address"]: entry for entry in admin(sidecar, "GET", "/upstreams")["upstreams"]}
    assert entries[busy.url]["load"]["waiting"] >= 1
    assert any(entry["picks"].get("queue-aware") for entry in entries.values())
    backlog.join(60)


def test_prefix_affinity_sends_a_repeated_system_prompt_to_one_pod(pods, sidecars) -> None:
    four = pods(4)
    sidecar = sidecars([pod.url for pod in four], "--balance", "prefix-affinity",
                       "--prefix-affinity-tokens", "256")
    system = "You are a careful assistant. " * 60  # ~1,700 bytes: the key is its first 1,024
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body(system, f"question {i}")))
                     for i in range(16))
    assert len(served) == 1 and sum(served.values()) == 16, served
    # Different system prompts spread over the set (a consistent hash, not one pod for all).
    spread = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body(f"Prompt number {i}. " * 80)))
                     for i in range(24))
    assert len(spread) >= 3, spread


def test_a_killed_pod_ends_its_streams_in_band_and_new_ones_go_elsewhere(
        pods, sidecars, tmp_path: Path) -> None:
    four = pods(4, "--token-s", "0.05", "--tokens", "60")
    log = tmp_path / "records.jsonl"
    sidecar = sidecars([pod.url for pod in four], "--health-path", "/health", "--health-interval-s", "0.2",
                       "--health-timeout-s", "0.5", "--log-file", str(log))
    results = [RawResponse()] * 8
    threads = []
    for i in range(8):
        def run(i: int = i) -> None:
            results[i] = exchange(sidecar.port, "POST", PATH, body=body(),
                                  headers={"X-Request-Id": f"kill-{i}"}, timeout_s=30)
        threads.append(threading.Thread(target=run))
        threads[-1].start()
    wait_for(lambda: sum(1 for s in admin(sidecar, "GET", "/streams") if s["state"] == "streaming") == 8,
             timeout_s=10)
    streams = admin(sidecar, "GET", "/streams")
    victim_url = Counter(s["upstream"] for s in streams).most_common(1)[0][0]
    victim = next(pod for pod in four if pod.url == victim_url)
    victim.kill()
    for thread in threads:
        thread.join(30)
    on_victim = [r for r in results if pod_of(r) == victim.name]
    assert on_victim
    for response in results:
        assert response.status == 200
        if response in on_victim:
            assert not response.clean_end
            assert json.loads(response.datas()[-1])["error"]["code"] == "upstream_failed"
        else:
            assert response.clean_end and response.datas()[-1] == "[DONE]"
    # New streams go elsewhere, the first ones too (a refused connection is retried on another pod).
    after = [exchange(sidecar.port, "POST", PATH, body=body(max_tokens=2),
                      headers={"X-Request-Id": f"after-{i}"}) for i in range(8)]
    assert all(r.status == 200 and r.clean_end for r in after)
    assert victim.name not in {pod_of(r) for r in after}
    wait_for(lambda: states(sidecar)[victim.url] in ("unhealthy", "ejected"), timeout_s=10)
    sidecar.stop()
    records = {record["request_id"]: record for record in map(json.loads, log.read_text().splitlines())}
    killed = [records[f"kill-{i}"] for i in range(8) if results[i] in on_victim]
    assert all(record["retries"] == 0 and record["upstream"] == victim.url for record in killed)
    assert all(records[f"after-{i}"]["upstream"] != victim.url for i in range(8))


def test_a_pod_slow_to_answer_health_checks_is_taken_out_and_put_back(pods, sidecars) -> None:
    four = pods(4)
    slow = four[2]
    sidecar = sidecars([pod.url for pod in four], "--health-path", "/health", "--health-interval-s", "0.1",
                       "--health-timeout-s", "0.2", "--health-unhealthy-threshold", "2",
                       "--health-healthy-threshold", "2", "--balance", "round-robin")
    slow.control(health_delay_s=1.0)
    wait_for(lambda: states(sidecar)[slow.url] == "unhealthy", timeout_s=10)
    before = slow.stats()["received"]
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(9))
    assert slow.name not in served and sum(served.values()) == 9
    assert slow.stats()["received"] == before
    slow.control(health_delay_s=0.0)
    wait_for(lambda: states(sidecar)[slow.url] == "up", timeout_s=10)
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(8))
    assert served[slow.name] == 2


def test_a_pod_added_to_the_address_file_gets_streams(pods, sidecars, tmp_path: Path) -> None:
    a, b, c = pods(3)
    listing = tmp_path / "upstreams"
    listing.write_text(f"# the pods\n{a.url}\n{b.url}\n")
    sidecar = sidecars([f"file:{listing}"], "--upstream-refresh-s", "0.1", "--balance", "round-robin")
    assert set(states(sidecar)) == {a.url, b.url}
    listing.write_text(f"{a.url}\n{b.url}\n{c.url}  weight=2\n")
    wait_for(lambda: c.url in states(sidecar), timeout_s=10)
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(8))
    assert served == {a.name: 2, b.name: 2, c.name: 4}
    # Removed from the file: no new streams, then gone from the set.
    listing.write_text(f"{b.url}\n{c.url} weight=2\n")
    wait_for(lambda: a.url not in states(sidecar), timeout_s=10)
    assert a.name not in {pod_of(exchange(sidecar.port, "POST", PATH, body=body())) for _ in range(6)}


def test_sighup_rereads_the_address_file(pods, sidecars, tmp_path: Path) -> None:
    a, b = pods(2)
    listing = tmp_path / "upstreams"
    listing.write_text(f"{a.url}\n")
    sidecar = sidecars([f"file:{listing}"], "--upstream-refresh-s", "3600")
    listing.write_text(f"{a.url}\n{b.url}\n")
    time.sleep(0.3)
    assert set(states(sidecar)) == {a.url}  # no refresh for an hour: only the signal reads it
    sidecar.signal(signal.SIGHUP)
    wait_for(lambda: set(states(sidecar)) == {a.url, b.url}, timeout_s=10)


def test_all_pods_down_is_a_503_with_retry_after_at_once(pods, sidecars) -> None:
    four = pods(4)
    sidecar = sidecars([pod.url for pod in four], "--health-path", "/health", "--health-interval-s", "0.1",
                       "--health-timeout-s", "0.3", "--health-unhealthy-threshold", "1")
    for pod in four:
        pod.control(health_status=503)
    wait_for(lambda: set(states(sidecar).values()) == {"unhealthy"}, timeout_s=10)
    started = time.monotonic()
    response = exchange(sidecar.port, "POST", PATH, body=body())
    elapsed_s = time.monotonic() - started
    assert response.status == 503 and elapsed_s < 1.0
    assert response.headers.get("retry-after") == "1"
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert all(pod.stats()["received"] == 0 for pod in four)


def test_a_full_pod_set_queues_then_serves_in_order(pods, sidecars) -> None:
    a, b = pods(2, "--token-s", "0.05", "--tokens", "8")
    sidecar = sidecars([a.url, b.url], "--max-streams-per-upstream", "1", "--queue-timeout-s", "20")
    results = parallel(6, lambda i: exchange(sidecar.port, "POST", PATH, body=body(), timeout_s=30))
    assert all(r.status == 200 and r.clean_end for r in results)
    assert a.stats()["max_running"] == 1 and b.stats()["max_running"] == 1
    assert a.stats()["completed"] + b.stats()["completed"] == 6


def test_queue_timeout_is_a_503_before_the_commit(pods, sidecars) -> None:
    (a,) = pods(1, "--token-s", "0.1", "--tokens", "30")
    sidecar = sidecars([a.url], "--max-streams-per-upstream", "1", "--queue-timeout-s", "0.3",
                       "--commit-deadline-s", "5")
    holder = threading.Thread(target=exchange, args=(sidecar.port, "POST", PATH), kwargs={"body": body()})
    holder.start()
    wait_for(lambda: a.stats()["running"] == 1, timeout_s=10)
    started = time.monotonic()
    response = exchange(sidecar.port, "POST", PATH, body=body())
    assert response.status == 503 and response.headers.get("retry-after") == "1"
    assert 0.25 < time.monotonic() - started < 3.0
    assert a.stats()["received"] == 1
    holder.join(30)


def test_a_queued_stream_gets_heartbeats_then_an_in_band_error(pods, sidecars) -> None:
    (a,) = pods(1, "--token-s", "0.1", "--tokens", "30")
    sidecar = sidecars([a.url], "--max-streams-per-upstream", "1", "--queue-timeout-s", "1.0",
                       "--commit-deadline-s", "0.1", "--heartbeat-s", "0.1")
    holder = threading.Thread(target=exchange, args=(sidecar.port, "POST", PATH), kwargs={"body": body()})
    holder.start()
    wait_for(lambda: a.stats()["running"] == 1, timeout_s=10)
    response = exchange(sidecar.port, "POST", PATH, body=body())
    assert response.status == 200
    assert response.body.count(b": keepalive\n") >= 3
    error = json.loads(response.datas()[-1])["error"]
    assert error["code"] == "upstream_unavailable"
    holder.join(30)


def test_queue_full_is_a_503_at_once(pods, sidecars) -> None:
    (a,) = pods(1, "--token-s", "0.1", "--tokens", "20")
    sidecar = sidecars([a.url], "--max-streams-per-upstream", "1", "--queue-max", "1",
                       "--queue-timeout-s", "10")
    holder = threading.Thread(target=exchange, args=(sidecar.port, "POST", PATH), kwargs={"body": body()})
    holder.start()
    wait_for(lambda: a.stats()["running"] == 1, timeout_s=10)
    waiter = threading.Thread(target=exchange, args=(sidecar.port, "POST", PATH), kwargs={"body": body()})
    waiter.start()
    wait_for(lambda: admin(sidecar, "GET", "/upstreams")["queue_depth"] == 1, timeout_s=10)
    started = time.monotonic()
    response = exchange(sidecar.port, "POST", PATH, body=body())
    assert response.status == 503 and time.monotonic() - started < 1.0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.admin_port}/metrics", timeout=10).read()
    assert b"tokenwire_upstream_queue_depth 1.0" in metrics
    holder.join(30)
    waiter.join(30)


def test_draining_a_pod_lets_its_stream_finish_and_sends_no_new_ones(pods, sidecars) -> None:
    a, b = pods(2, "--token-s", "0.05", "--tokens", "20")
    sidecar = sidecars([a.url, b.url], "--balance", "round-robin")
    results: list[RawResponse] = []
    first = threading.Thread(target=lambda: results.append(exchange(sidecar.port, "POST", PATH, body=body())))
    first.start()
    wait_for(lambda: a.stats()["running"] == 1, timeout_s=10)  # round robin's first turn: a
    drained = admin(sidecar, "POST", f"/upstreams/127.0.0.1:{a.port}/drain")
    assert drained == {"upstream": a.url, "draining": True}
    assert states(sidecar)[a.url] == "draining"
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body(max_tokens=1))) for _ in range(4))
    assert served == {b.name: 4}
    first.join(30)
    assert results[0].clean_end and pod_of(results[0]) == a.name
    admin(sidecar, "POST", f"/upstreams/{a.url}/undrain")
    assert states(sidecar)[a.url] == "up"


def test_with_workers_each_lists_its_view_and_a_drain_reaches_every_one(pods, sidecars) -> None:
    a, b = pods(2)
    sidecar = sidecars([a.url, b.url], "--workers", "2")
    views = admin(sidecar, "GET", "/upstreams")["workers"]
    assert sorted(view["worker"] for view in views) == [0, 1]
    assert admin(sidecar, "POST", f"/upstreams/{a.url}/drain") == {"upstream": a.url, "draining": True}
    for view in admin(sidecar, "GET", "/upstreams")["workers"]:
        assert {e["address"]: e["state"] for e in view["upstreams"]} == {a.url: "draining", b.url: "up"}
    served = Counter(pod_of(exchange(sidecar.port, "POST", PATH, body=body(max_tokens=1))) for _ in range(8))
    assert served == {b.name: 8}


def test_a_dns_name_lists_every_address_it_resolves_to(pods, sidecars) -> None:
    (a,) = pods(1)
    sidecar = sidecars([f"dns+http://localhost:{a.port}"], "--upstream-refresh-s", "0.2",
                       "--balance", "round-robin")
    listed = states(sidecar)
    assert listed.get(a.url) == "up", listed  # localhost's IPv4 address; its ::1 too where it has one
    served = {pod_of(exchange(sidecar.port, "POST", PATH, body=body(max_tokens=1))) for _ in range(4)}
    assert served == {a.name}


def test_a_resume_on_another_replica_comes_from_the_store_not_from_another_pod(
        pods, sidecars, redis_url: str) -> None:
    from resume_client import open_stream, resume

    four = pods(4, "--token-s", "0.03", "--tokens", "40")
    shared = ["--resume", "--resume-store", redis_url, "--resume-owner-secret", "replicas-share-this",
              "--resume-grace-s", "5"]
    first = sidecars([pod.url for pod in four], *shared)
    second = sidecars([pod.url for pod in four], *shared)
    part = open_stream(first.port, "POST", PATH, body=body(), stop_after=5)
    assert part.status == 200 and len(part.ids) == 5
    rest = resume(second.port, part.stream_id, part.ids[-1])
    assert rest.status == 200 and rest.clean_end
    texts = [json.loads(e.data)["choices"][0]["delta"].get("content", "") for e in part.events + rest.events
             if e.data and e.data.startswith("{")]
    assert "".join(texts) == "".join(f"t{i} " for i in range(40))
    # One generation, on one pod, whichever replica the reader came back through.
    assert sum(pod.stats()["received"] for pod in four) == 1


def test_with_workers_the_per_upstream_limit_holds_for_the_whole_group(pods, sidecars) -> None:
    """``--workers 2 --max-streams-per-upstream 2``: each worker holds its share (1),
    so the pod never sees more than 2 at once over 100 requests (it saw 4 when
    each worker held the whole limit), and every request is answered in full."""
    (a,) = pods(1, "--token-s", "0.01", "--tokens", "5")
    sidecar = sidecars([a.url], "--workers", "2", "--max-streams-per-upstream", "2",
                       "--queue-timeout-s", "60")
    views = admin(sidecar, "GET", "/upstreams")["workers"]
    assert sorted(view["worker"] for view in views) == [0, 1]
    results = parallel(100, lambda i: exchange(sidecar.port, "POST", PATH, body=body(), timeout_s=90))
    assert all(r.status == 200 and r.clean_end for r in results)
    assert a.stats()["max_running"] == 2 and a.stats()["completed"] == 100


def test_a_limit_smaller_than_the_workers_is_refused_at_start_up() -> None:
    from tokenwire.middleware import ConfigError

    from tokenwire.tools.cli import load_sidecar_config

    with pytest.raises(ConfigError) as refused:
        load_sidecar_config(["--upstream", "http://127.0.0.1:1", "--workers", "4",
                             "--max-streams-per-upstream", "2"], {})
    assert refused.value.key == "max_streams_per_upstream"
    assert "fewer than the 4 workers" in str(refused.value)
