"""The balancing core, sans-IO: injected time (``now``) and seeded randomness, no sockets."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from tokenwire.middleware import ConfigError
from tokenwire.sidecar.balance import (
    QUEUED,
    Balancer,
    BalanceSettings,
    HealthSettings,
    LoadSample,
    Pick,
    PodState,
    Refusal,
    RefusalReason,
    SourceKind,
    metric_names,
    parse_address_file,
    parse_load,
    parse_spec,
    prefix_key,
)
from tokenwire.sidecar.balance.policies import LeastOutstanding, PrefixAffinity, QueueAware, RoundRobin

# ---------------------------------------------------------------- members


@pytest.mark.parametrize(("text", "kind", "address", "weight"), [
    ("http://10.0.0.1:8000", SourceKind.STATIC, "http://10.0.0.1:8000", 1),
    ("http://10.0.0.1:8000/ weight=3", SourceKind.STATIC, "http://10.0.0.1:8000", 3),
    ("unix:/run/engine.sock weight=2", SourceKind.STATIC, "unix:/run/engine.sock", 2),
    ("dns+http://engine.ns.svc:8000", SourceKind.DNS, "http://engine.ns.svc:8000", 1),
    ("file:/etc/tokenwire/upstreams", SourceKind.FILE, "/etc/tokenwire/upstreams", 1),
])
def test_upstream_entries_parse(text: str, kind: SourceKind, address: str, weight: int) -> None:
    spec = parse_spec(text)
    assert (spec.kind, spec.address, spec.weight) == (kind, address, weight)


@pytest.mark.parametrize("text", ["https://a:1", "http://", "dns+http://name", "http://a:1 weight=0",
                                  "http://a:1 w=2", "file:", "file:/x weight=2", "a:1"])
def test_bad_upstream_entries_name_the_key(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec(text)
    assert caught.value.key == "upstream"


def test_a_dns_entry_resolves_to_urls_with_the_addresses() -> None:
    spec = parse_spec("dns+http://engine.ns.svc:8000/v1 weight=2")
    assert spec.dns_name == "engine.ns.svc"
    assert spec.resolved("10.1.2.3") == "http://10.1.2.3:8000/v1"
    assert spec.resolved("fd00::1") == "http://[fd00::1]:8000/v1"


def test_address_file_lines_comments_and_errors() -> None:
    specs = parse_address_file("# pods\nhttp://a:1\n\n  http://b:2 weight=4  # the big one\n", "f")
    assert [(s.address, s.weight) for s in specs] == [("http://a:1", 1), ("http://b:2", 4)]
    with pytest.raises(ConfigError, match="f:2"):
        parse_address_file("http://a:1\nnonsense\n", "f")
    with pytest.raises(ConfigError, match="another file"):
        parse_address_file("file:/x\n", "f")


# ---------------------------------------------------------------- load

_VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_waiting_by_reason{reason="x"} 99
"""


def test_load_sums_series_and_takes_the_first_cache_name_present() -> None:
    sample = parse_load(_VLLM, metric_names("vllm"))
    assert sample == LoadSample(waiting=5.0, running=7.0, cache_use=0.25)
    newer = _VLLM.replace("gpu_cache_usage_perc", "kv_cache_usage_perc")
    assert parse_load(newer, metric_names("vllm")) == sample


@pytest.mark.parametrize(("preset", "text", "expected"), [
    ("tokenwire", "tokenwire_engine_waiting 4\ntokenwire_engine_running 2\n", LoadSample(4, 2)),
    ("sglang", 'sglang:num_queue_reqs{m="x"} 1\nsglang:num_running_reqs{m="x"} 8\n'
               'sglang:token_usage{m="x"} 0.5\n', LoadSample(1, 8, 0.5)),
    ("tgi", "tgi_queue_size 6\ntgi_batch_current_size 16\n", LoadSample(6, 16)),
])
def test_load_presets(preset: str, text: str, expected: LoadSample) -> None:
    assert parse_load(text, metric_names(preset)) == expected


def test_load_without_its_figures_is_none_and_names_can_be_overridden() -> None:
    assert parse_load("tokenwire_engine_waiting 1\n", metric_names("tokenwire")) is None
    assert parse_load("garbage\nx{ 1\nnan_metric NaN\n", metric_names("tokenwire")) is None
    names = metric_names("tokenwire", waiting="my_queue", running="my_busy,other_busy")
    assert parse_load("my_queue 2\nother_busy 3\n", names) == LoadSample(2, 3)


# ---------------------------------------------------------------- prefix


def _chat(system: str, user: str, model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": user}]}).encode()


def test_prefix_key_is_the_first_n_tokens_worth_of_the_conversation() -> None:
    system = "s" * 5000
    key = prefix_key(_chat(system, "a"), 100)
    assert key is not None and key == prefix_key(_chat(system, "b"), 100)  # 400 bytes of the system prompt
    assert len(key) == len(b"m\x1e") + 400
    # A short system prompt: the key reaches into the first user message.
    assert prefix_key(_chat("short", "a"), 100) != prefix_key(_chat("short", "b"), 100)
    assert prefix_key(_chat(system, "a", model="other"), 100) != key


def test_prefix_key_of_other_shapes() -> None:
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 50}]}]})
    assert prefix_key(parts.encode(), 5) == b"\x1e" + b"user:" + b"x" * 15
    ids = json.dumps({"model": "m", "prompt": list(range(1000))}).encode()
    assert prefix_key(ids, 3) == b"m\x1eids:0,1,2"
    assert prefix_key(json.dumps({"prompt": "abcdefgh"}).encode(), 1) == b"\x1eabcd"
    for body in (b"", b"not json", b"[1]", b'{"input": "x"}', b'{"messages": []}'):
        assert prefix_key(body, 10) is None


# ---------------------------------------------------------------- policies


def _pods(*loads: int, weights: tuple[int, ...] | None = None) -> list[PodState]:
    return [PodState(f"http://p{i}:1", (weights or (1,) * len(loads))[i], open_streams=load)
            for i, load in enumerate(loads)]


def test_two_choices_never_pick_the_most_loaded_of_two() -> None:
    policy = LeastOutstanding(random.Random(1))
    pods = _pods(5, 0)
    assert all(policy.pick(pods, pods, None, 0.0)[0] is pods[1] for _ in range(50))
    # Among four, the most loaded pod is never picked, the least loaded most often.
    pods = _pods(0, 3, 3, 9)
    picks = Counter(policy.pick(pods, pods, None, 0.0)[0].address for _ in range(600))
    assert pods[3].address not in picks and picks[pods[0].address] == max(picks.values())


def test_two_choices_tie_is_a_coin_toss_and_weights_divide_the_load() -> None:
    policy = LeastOutstanding(random.Random(2))
    pods = _pods(1, 1)
    picks = Counter((pod.address, reason) for pod, reason in (policy.pick(pods, pods, None, 0.0)
                                                              for _ in range(400)))
    assert {reason for _, reason in picks} == {"least-outstanding:tie"}
    assert all(120 < count < 280 for count in picks.values())
    heavy = _pods(3, 2, weights=(4, 1))  # 0.75 per unit of weight against 2
    assert all(policy.pick(heavy, heavy, None, 0.0)[0] is heavy[0] for _ in range(20))


def test_round_robin_is_smooth_and_weighted() -> None:
    policy = RoundRobin()
    pods = _pods(0, 0, 0, weights=(3, 1, 1))
    order = "".join(policy.pick(pods, pods, None, 0.0)[0].address[8] for _ in range(10))
    assert order == "01020" * 2  # three turns in five, never more than two in a row


def test_queue_aware_orders_by_waiting_then_running_counting_its_own_sends() -> None:
    policy = QueueAware(random.Random(3), stale_after_s=3.0)
    pods = _pods(0, 0, 0)
    for pod, (waiting, running) in zip(pods, [(2, 0), (0, 9), (0, 4)], strict=True):
        pod.load, pod.load_at = LoadSample(waiting, running), 10.0
    assert policy.pick(pods, pods, None, 11.0) == (pods[2], "queue-aware")
    pods[2].sent_since_load = 3  # what the last reading cannot know yet
    assert policy.pick(pods, pods, None, 11.0)[0] is pods[1]
    # A stale reading: least outstanding instead.
    pod, reason = policy.pick(pods, pods, None, 20.0)
    assert reason == "queue-aware:no-load-signal"


def test_prefix_affinity_is_a_consistent_hash_with_a_load_fallback() -> None:
    policy = PrefixAffinity(random.Random(4), load_factor=2.0, min_streams=4)
    pods = _pods(0, 0, 0, 0)
    keys = [f"prompt {i}".encode() for i in range(400)]
    owners = {key: policy.owner(key, pods).address for key in keys}
    assert all(100 - 40 < n < 100 + 40 for n in Counter(owners.values()).values())
    # Removing a pod moves only the keys it held.
    gone = pods[1].address
    moved = [key for key in keys if policy.owner(key, [p for p in pods if p.address != gone]).address
             != owners[key]]
    assert moved and all(owners[key] == gone for key in moved)
    key = keys[0]
    owner = next(p for p in pods if p.address == owners[key])
    assert policy.pick(pods, pods, key, 0.0) == (owner, "prefix-affinity")
    owner.open_streams = 3  # 2 x its fair share (3 / 4), but under the floor of 4
    assert policy.pick(pods, pods, key, 0.0) == (owner, "prefix-affinity")
    owner.open_streams = 6  # fair share here: 6 / 4 = 1.5; 6 >= max(4, 2 x 1.5)
    chosen, reason = policy.pick(pods, pods, key, 0.0)
    assert reason == "prefix-affinity:overloaded" and chosen is not owner
    others = [p for p in pods if p is not owner]
    others[0].open_streams = 10
    # Now 16 open: fair share 4, 2 x 4 = 8 > 6: the owner again.
    assert policy.pick(pods, pods, key, 0.0) == (owner, "prefix-affinity")
    others[0].open_streams = 0
    owner.open_streams = 0
    assert policy.pick(others, pods, key, 0.0)[1] == "prefix-affinity:owner-full"
    assert policy.pick(pods, pods, None, 0.0)[1] == "prefix-affinity:no-prefix"


def test_prefix_affinity_weights_give_a_share_of_the_keys() -> None:
    policy = PrefixAffinity(random.Random(5), load_factor=2.0)
    pods = _pods(0, 0, weights=(3, 1))
    owners = Counter(policy.owner(f"k{i}".encode(), pods).address for i in range(2000))
    assert 0.7 < owners[pods[0].address] / 2000 < 0.8


# ---------------------------------------------------------------- pod health


def test_active_checks_take_a_pod_out_and_put_it_back_after_thresholds() -> None:
    settings = HealthSettings(unhealthy_threshold=2, healthy_threshold=3)
    pod = PodState("p")
    assert not pod.health_result(False, settings) and pod.healthy
    assert not pod.health_result(True, settings)  # a success breaks the streak
    assert not pod.health_result(False, settings)
    assert pod.health_result(False, settings) and not pod.healthy and not pod.available(0.0)
    assert not pod.health_result(True, settings) and not pod.health_result(True, settings)
    assert pod.health_result(True, settings) and pod.available(0.0)


def test_ejection_grows_while_failures_continue_and_resets_after_a_success() -> None:
    settings = HealthSettings(outlier_consecutive_failures=2, outlier_base_ejection_s=10.0,
                              outlier_max_ejection_s=25.0)
    pod = PodState("p")
    assert not pod.attempt_failed(0.0, settings, may_eject=True)
    assert pod.attempt_failed(0.0, settings, may_eject=True) and pod.ejected_until == 10.0
    assert not pod.available(9.9) and pod.available(10.0)
    for now, until in ((10.0, 30.0), (30.0, 55.0), (55.0, 80.0)):  # 20 s, then the 25 s cap
        pod.attempt_failed(now, settings, may_eject=True)
        assert pod.attempt_failed(now, settings, may_eject=True) and pod.ejected_until == until
    pod.attempt_succeeded()
    pod.attempt_failed(80.0, settings, may_eject=True)
    assert pod.attempt_failed(80.0, settings, may_eject=True) and pod.ejected_until == 90.0
    assert pod.ejections == 5 and pod.failures == 10


def _balancer(**settings: object) -> Balancer:
    return Balancer(BalanceSettings(**settings), rng=random.Random(7))  # type: ignore[arg-type]


def test_no_more_than_the_share_is_ejected_and_a_single_pod_never_is() -> None:
    health = HealthSettings(outlier_consecutive_failures=1, outlier_max_ejected_share=0.5)
    balancer = _balancer(health=health)
    balancer.set_members({"a": 1, "b": 1, "c": 1, "d": 1})
    assert balancer.attempt_failed("a", 0.0) and balancer.attempt_failed("b", 0.0)
    assert not balancer.attempt_failed("c", 0.0)  # two of four already out
    assert [p.address for p in balancer.pods if p.available(0.0)] == ["c", "d"]
    alone = _balancer(health=health)
    alone.set_members({"a": 1})
    assert not alone.attempt_failed("a", 0.0)
    assert isinstance(alone.request("t", now=0.0), Pick)


# ---------------------------------------------------------------- the balancer


def test_a_retry_goes_to_another_pod_when_there_is_one() -> None:
    balancer = _balancer()
    balancer.set_members({"a": 1, "b": 1, "c": 1})
    for _ in range(30):
        answer = balancer.request("t", exclude=frozenset({"a", "b"}), now=0.0)
        assert isinstance(answer, Pick) and answer.address == "c"
        balancer.release("c")
    single = _balancer()
    single.set_members({"a": 1})
    answer = single.request("t", exclude=frozenset({"a"}), now=0.0)
    assert isinstance(answer, Pick) and answer.address == "a"


def test_no_available_pod_is_refused_at_once() -> None:
    balancer = _balancer(retry_after_s=2)
    assert balancer.request("t", now=0.0) == Refusal(RefusalReason.ALL_DOWN, 2)
    balancer.set_members({"a": 1})
    balancer.drain("a")
    assert balancer.request("t", now=0.0) == Refusal(RefusalReason.ALL_DOWN, 2)


def test_full_pods_queue_first_in_first_out_then_time_out() -> None:
    balancer = _balancer(max_streams_per_upstream=1, queue_max=2, queue_timeout_s=5.0)
    balancer.set_members({"a": 1, "b": 1})
    first, second = balancer.request(1, now=0.0), balancer.request(2, now=0.0)
    assert isinstance(first, Pick) and isinstance(second, Pick) and first.address != second.address
    assert balancer.request(3, now=1.0) is QUEUED and balancer.request(4, now=2.0) is QUEUED
    assert balancer.request(5, now=2.0) == Refusal(RefusalReason.QUEUE_FULL, 1)
    assert balancer.queue_depth == 2 and balancer.next_deadline() == 6.0
    assert balancer.grants(3.0) == []
    balancer.release(first.address)
    assert balancer.grants(3.0) == [(3, Pick(first.address, "least-outstanding:only"))]
    assert balancer.grants(6.9) == [] and balancer.next_deadline() == 7.0
    assert balancer.grants(7.0) == [(4, Refusal(RefusalReason.QUEUE_TIMEOUT, 1))]
    assert balancer.queue_timeouts == 1 and balancer.queue_depth == 0


def test_queued_requests_are_refused_when_the_last_pod_goes() -> None:
    balancer = _balancer(max_streams_per_upstream=1)
    balancer.set_members({"a": 1})
    assert isinstance(balancer.request(1, now=0.0), Pick)
    assert balancer.request(2, now=0.0) is QUEUED and balancer.request(3, now=0.0) is QUEUED
    balancer.cancel(3)
    balancer.health_result("a", False)
    balancer.health_result("a", False)
    assert balancer.grants(1.0) == [(2, Refusal(RefusalReason.ALL_DOWN, 1))]


def test_a_removed_pod_keeps_its_streams_and_goes_when_they_end() -> None:
    balancer = _balancer()
    assert balancer.set_members({"a": 1, "b": 1}) == (["a", "b"], [])
    picks = [balancer.request(i, now=0.0) for i in range(4)]
    on_a = sum(1 for pick in picks if isinstance(pick, Pick) and pick.address == "a")
    assert 0 < on_a < 4
    assert balancer.set_members({"b": 2}) == ([], [])
    assert balancer.pod("a") is not None and balancer.pod("a").state_name(0.0) == "removed"  # type: ignore[union-attr]
    assert all(isinstance(p, Pick) and p.address == "b" for p in (balancer.request(9, now=0.0),))
    for _ in range(on_a - 1):
        assert balancer.release("a") == []
    assert balancer.release("a") == ["a"] and balancer.pod("a") is None
    # Listed again: back, fresh.
    assert balancer.set_members({"a": 1, "b": 2}) == (["a"], [])


def test_describe_reports_each_pod() -> None:
    balancer = _balancer(policy="round-robin")
    balancer.set_members({"a": 1})
    balancer.request(1, now=0.0)
    balancer.load_result("a", LoadSample(1, 2, 0.5), 0.0)
    body = balancer.describe(1.0)
    assert body["policy"] == "round-robin" and body["queue_depth"] == 0
    (entry,) = body["upstreams"]
    assert entry["open_streams"] == 1 and entry["requests"] == 1 and entry["state"] == "up"
    assert entry["load"] == {"waiting": 1, "running": 2, "cache_use": 0.5, "age_s": 1.0}
    assert entry["picks"] == {"round-robin": 1} and entry["last_pick_reason"] == "round-robin"
