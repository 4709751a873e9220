"""Balancing benchmark: the policies side by side over four fake engine pods, one run.

Method (figures in docs/perf/balance.md):

* Four ``testbed/fake_engine.py`` processes (real sockets, a slot-limited
  queue per pod, prefill then paced tokens) behind one ``tokenwire sidecar``
  process per policy, the policies one after the other in the same run,
  against the same pods, with the same arrival schedule (open loop, Poisson,
  seeded): a slow policy does not get a lighter load.
* The load client is this process (asyncio, one connection per request,
  ``Connection: close``); TTFT = request sent to the first content event
  read, on one clock.
* ``speeds``: one pod 3x slower than the others (``--slowdown 3``); offered
  load above what round robin's share lets the slow pod serve. p50/p99/mean
  TTFT under ``round-robin``, ``least-outstanding`` and ``queue-aware``.
* ``prefix``: pods whose prefill drops from ``--prefill-s`` to
  ``--cached-prefill-s`` when the same system prompt was seen on that pod
  lately (an LRU of a few prompts per pod); 16 system prompts of 2,000
  tokens' worth (8,000 bytes) each, one chosen at random per request. Mean
  TTFT of ``prefix-affinity`` against ``least-outstanding``.
* ``kill``: ``least-outstanding`` with active health checks; one pod is
  SIGKILLed mid-run. For each request sent after the kill: the wait for its
  response head and for its first token. Which requests were cut (an
  in-band error), and whether any cut request reached another pod
  afterwards (each request carries a unique ``user`` tag that the pods
  record): that would be a retry after the first byte.

Usage: ``python bench/balance_bench.py [--quick]``; writes ``bench/results/balance.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed.fake_pods import FakePod, running_pods
from testbed.targets import sidecar

PATH = "/v1/chat/completions"


@contextlib.contextmanager
def balancer(pods: list[FakePod], *args: str) -> Iterator[int]:
    """One ``tokenwire sidecar`` in front of ``pods`` with ``args``; its port."""
    with sidecar(0, [pod.url for pod in pods], admin=False, flags=("--drain-s", "0", *args)) as side:
        yield side.port


@dataclass
class Result:
    sent_at: float
    head_s: float | None = None
    ttft_s: float | None = None
    status: int = 0
    complete: bool = False
    error: bool = False
    pod: str = ""
    tag: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


async def one_request(port: int, body: bytes, sent_at: float, tag: str) -> Result:
    result = Result(sent_at, tag=tag)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return result
    writer.write(b"POST %b HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (PATH.encode(), len(body), body))
    data = b""
    try:
        while True:
            chunk = await reader.read(65536)
            now = time.monotonic()
            if not chunk:
                break
            data += chunk
            if result.head_s is None and b"\r\n\r\n" in data:
                result.head_s = now - sent_at
                result.status = int(data.split(b" ", 2)[1])
            if result.ttft_s is None and b'"content"' in data:
                result.ttft_s = now - sent_at
    except ConnectionError:
        pass
    finally:
        writer.close()
    result.complete = b"data: [DONE]" in data
    result.error = b'"error"' in data
    marker = data.find(b'"pod": "')
    if marker >= 0:
        result.pod = data[marker + 8:data.index(b'"', marker + 8)].decode()
    return result


async def open_loop(port: int, schedule: list[tuple[float, bytes, str]]) -> list[Result]:
    """Send each (offset, body, tag) at its offset from now, whatever came back before."""
    start = time.monotonic()
    tasks = []
    for offset, body, tag in schedule:
        delay_s = start + offset - time.monotonic()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one_request(port, body, time.monotonic(), tag)))
    return list(await asyncio.gather(*tasks))


def arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return times
        times.append(t)


def chat(system: str, user: str, max_tokens: int, tag: str) -> bytes:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return json.dumps({"model": "fake", "stream": True, "max_tokens": max_tokens, "user": tag,
                       "messages": messages}).encode()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"n": len(ordered), "p50_ms": round(1000 * statistics.median(ordered), 1),
            "p99_ms": round(1000 * p99, 1), "mean_ms": round(1000 * statistics.fmean(ordered), 1),
            "max_ms": round(1000 * ordered[-1], 1)}


def wait_idle(all_pods: list[FakePod], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(p.stats()["running"] == 0 and p.stats()["waiting"] == 0 for p in all_pods):
            return
        time.sleep(0.2)


def scenario_speeds(quick: bool) -> dict[str, Any]:
    duration_s = 8.0 if quick else 20.0
    common = ["--concurrency", "4", "--prefill-s", "0.05", "--token-s", "0.01", "--tokens", "20"]
    out: dict[str, Any] = {"duration_s": duration_s,
                           "pods": "3 x (4 slots, 50 ms prefill, 20 tokens at 10 ms) + 1 the same x3 slower "
                                   "(capacity: 16/s per fast pod, 5.3/s for the slow one)"}
    with running_pods([common, common, common, [*common, "--slowdown", "3"]]) as four:
        for rate in (16.0, 24.0):
            schedule = [(t, chat("", f"q{i}", 20, f"s{i}"), f"s{i}")
                        for i, t in enumerate(arrivals(rate, duration_s, 1))]
            level: dict[str, Any] = {"requests": len(schedule)}
            for policy in ("round-robin", "least-outstanding", "queue-aware"):
                extra = ["--load-poll-s", "0.25"] if policy == "queue-aware" else []
                with balancer(four, "--balance", policy, *extra) as port:
                    results = asyncio.run(open_loop(port, schedule))
                wait_idle(four)
                ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
                slow_share = sum(1 for r in results if r.pod == "pod3") / max(1, len(results))
                level[policy] = {"ttft": summary(ttfts), "complete": sum(r.complete for r in results),
                                 "slow_pod_share": round(slow_share, 3)}
            base = level["round-robin"]["ttft"]["p99_ms"]
            for policy in ("least-outstanding", "queue-aware"):
                level[policy]["p99_vs_round_robin"] = round(level[policy]["ttft"]["p99_ms"] / base, 3)
            out[f"offered_{rate:g}_per_s"] = level
    return out


def scenario_prefix(quick: bool) -> dict[str, Any]:
    duration_s, rate = (8.0, 16.0) if quick else (20.0, 16.0)
    prompts = [f"System prompt {k}: you are assistant number {k}. " + ("Follow the house rules. " * 330)
               for k in range(16)]  # 2,000 tokens' worth (~8,000 bytes) each
    rng = random.Random(2)
    schedule = [(t, chat(rng.choice(prompts), f"user question {i}", 8, f"p{i}"), f"p{i}")
                for i, t in enumerate(arrivals(rate, duration_s, 3))]
    args = ["--concurrency", "8", "--prefill-s", "0.2", "--cached-prefill-s", "0.02", "--token-s", "0.01",
            "--tokens", "8", "--cache-prefixes", "6", "--prefix-bytes", "8000"]
    out: dict[str, Any] = {"offered_per_s": rate, "duration_s": duration_s, "requests": len(schedule),
                           "pods": "4 x (8 slots, prefill 200 ms, 20 ms when cached, LRU of 6 prompts)",
                           "rounds": []}
    # Each round has fresh pods on fresh ports: the hash of the 16 prompts over
    # the pods' addresses (how evenly they share the prompts) differs per round.
    for _ in range(1 if quick else 3):
        round_result: dict[str, Any] = {}
        for policy in ("least-outstanding", "prefix-affinity"):
            # Fresh pods per policy: neither run inherits the other's warm caches.
            with running_pods([args] * 4) as four, balancer(four, "--balance", policy) as port:
                results = asyncio.run(open_loop(port, schedule))
                hits = sum(p.stats()["cache_hits"] for p in four)
            ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
            round_result[policy] = {"ttft": summary(ttfts), "complete": sum(r.complete for r in results),
                                    "cache_hit_share": round(hits / max(1, len(results)), 3)}
        round_result["mean_vs_least_outstanding"] = round(
            round_result["prefix-affinity"]["ttft"]["mean_ms"]
            / round_result["least-outstanding"]["ttft"]["mean_ms"], 3)
        out["rounds"].append(round_result)
    out["mean_vs_least_outstanding"] = [r["mean_vs_least_outstanding"] for r in out["rounds"]]
    return out


def scenario_kill(quick: bool) -> dict[str, Any]:
    duration_s, rate, kill_at_s = (8.0, 12.0, 3.0) if quick else (16.0, 12.0, 6.0)
    health_interval_s, connect_timeout_s = 1.0, 1.0
    args = ["--concurrency", "8", "--prefill-s", "0.05", "--token-s", "0.05", "--tokens", "30"]
    schedule = [(t, chat("", f"k{i}", 30, f"k{i}"), f"k{i}")
                for i, t in enumerate(arrivals(rate, duration_s, 4))]
    with running_pods([args] * 4) as four, balancer(
            four, "--health-path", "/health", "--health-interval-s", str(health_interval_s),
            "--health-timeout-s", "0.5", "--upstream-connect-timeout-s", str(connect_timeout_s)) as port:
        victim = four[1]

        async def run() -> tuple[list[Result], float]:
            load = asyncio.create_task(open_loop(port, schedule))
            await asyncio.sleep(kill_at_s)
            victim.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            return await load, killed_at

        results, killed_at = asyncio.run(run())
        survivors = [p for p in four if p is not victim]
        seen_after = {tag for p in survivors for tag in p.stats()["users"]}
    after = [r for r in results if r.sent_at >= killed_at]
    cut = [r for r in results if r.pod == victim.name and r.error]
    firsts = [r.ttft_s for r in after if r.ttft_s is not None]
    bound_s = health_interval_s + connect_timeout_s
    return {
        "offered_per_s": rate, "duration_s": duration_s, "kill_at_s": kill_at_s,
        "health_interval_s": health_interval_s, "connect_timeout_s": connect_timeout_s,
        "requests": len(results), "after_kill": len(after),
        "after_kill_complete": sum(r.complete for r in after),
        "after_kill_on_victim": sum(1 for r in after if r.pod == victim.name),
        # The sidecar sends its head with the first event: the wait for the head is the TTFT.
        "after_kill_ttft": summary(firsts),
        "after_kill_over_bound": sum(1 for w in firsts if w > bound_s) + (len(after) - len(firsts)),
        "cut_streams_in_band_error": len(cut),
        "cut_streams_retried_after_first_byte": sum(1 for r in cut if r.tag in seen_after),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument("--only", choices=("speeds", "prefix", "kill"), action="append")
    args = parser.parse_args()
    chosen = args.only or ["speeds", "prefix", "kill"]
    results: dict[str, Any] = {"quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    scenarios = {"speeds": scenario_speeds, "prefix": scenario_prefix, "kill": scenario_kill}
    for name in chosen:
        results[name] = scenarios[name](args.quick)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    out = Path(__file__).resolve().parent / "results" / "balance.json"
    out.parent.mkdir(exist_ok=True)
    if args.only and out.exists():
        # Part of the scenarios: the others keep their last figures.
        results = {**json.loads(out.read_text()), **results}
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
