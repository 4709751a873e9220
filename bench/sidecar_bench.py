"""Sidecar benchmark: direct vs tokenwire sidecar vs nginx, side by side, one run.

Method (figures in docs/perf/sidecar-http1.md; ``--resets`` in docs/perf/resets.md):

* One fake upstream process (``sse_load.py upstream``: bare asyncio, paced
  OpenAI chunks, each carrying its send time) serves all three targets:
  ``direct`` (the client talks to it), ``tokenwire`` (the sidecar in front of
  it) and ``nginx`` (``proxy_buffering off``, one worker, upstream keepalive).
* Each scenario runs its load client in its own process, one target after the
  other, in the same run on the same machine, so the ratios are fair even
  though the absolute numbers depend on a shared 2-core box.
* ``throughput``: S streams x E events every I ms; delivered events/s,
  completion, exact text, and the latency from the upstream's send to the
  client's read (p50/p99); "added latency" is a proxy's figure minus direct's;
  the proxy's CPU time (``/proc/PID/stat``) per delivered event.
* ``reset``: a client reads 3 events then resets (RST); the time until the
  upstream sees its connection closed (p50/p99).
* ``hold``: N open, quiet streams; the proxy's RSS growth per stream.
* ``slow``: 4 readers taking 2 KiB per 100 ms through a 4 KiB receive buffer,
  5,000 tokens at 1 ms each: when did the upstream finish, when did the last
  token arrive, is the text exact, and how much did the proxy's RSS grow.

* ``--sweep ROUNDS``: offered 5k/10k/20k events/s against tokenwire with
  ``--workers`` 1 and 2 and nginx with 1 and 2 workers; CPU per event of each
  proxy's whole process tree, added latency p50/p99, delivered/direct, and
  50 clients resetting at once (``sidecar_sweep.json``/``.png``).

* ``--burst ROUNDS``: only the 200 x 100 events/s run (200 streams starting
  within 10 ms), direct, tokenwire and nginx alternating; medians over the
  rounds of delivered vs direct, time to first event and added latency
  (``sidecar_burst.json``).

* ``--resets ROUNDS``: only 50 clients resetting in one burst (each has read
  3 events, then all reset back to back), tokenwire and nginx alternating;
  pooled p50/p99 over the rounds (``sidecar_resets.json``).

``--cpu``, ``--burst``, ``--resets`` and ``--sweep`` take ``--base DIR``: an
older checkout run beside the others, in the same rotation.

Usage: ``python bench/sidecar_bench.py [--quick | --cpu | --burst | --sweep | --resets ROUNDS]``;
writes ``bench/results/sidecar.json`` and ``bench/results/sidecar.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/

from testbed.targets import (
    LOAD,
    PY,
    cpu_seconds,
    free_port,
    nginx,
    nginx_worker_pid,
    process,
    rss_kib,
    sidecar,
    tree_cpu_seconds,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def client(scenario: str, target_port: int, upstream_port: int, *args: str,
           timeout_s: float = 600) -> dict[str, Any]:
    cmd = [PY, LOAD, "client", scenario, "--target", f"127.0.0.1:{target_port}",
           "--upstream-port", str(upstream_port), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    for line in out.splitlines():
        if line.startswith('{"result"'):
            result: dict[str, Any] = json.loads(line)["result"]
            return result
    raise RuntimeError(f"{scenario}: no result in {out[-500:]}")


def hold(target_port: int, upstream_port: int, pid_of: Any, streams: int) -> dict[str, Any]:
    """Open ``streams`` quiet streams and read the proxy's RSS before and while held."""
    before = rss_kib(pid_of())
    cmd = [PY, LOAD, "client", "hold", "--target", f"127.0.0.1:{target_port}",
           "--streams", str(streams), "--hold-s", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    held = 0
    for line in proc.stdout:
        if line.startswith('{"held"'):
            held = json.loads(line)["held"]
            break
    time.sleep(2)
    during = rss_kib(pid_of())
    proc.wait(60)
    return {"streams": streams, "held": held, "rss_before_kib": before, "rss_held_kib": during,
            "kib_per_stream": round((during - before) / max(held, 1), 2)}


# The fake upstream stamps each chunk's send time into ``system_fingerprint``
# (a real engine's is one value per stream). Listed as volatile, it does not
# stop a slow reader's chunks from merging, as a constant fingerprint would not;
# unlisted, no two chunks could merge and the slow-reader scenario would
# measure the stamp, not the sidecar (51 s late, like nginx).
STAMP_FLAGS = ("--volatile-chunk-fields", "obfuscation", "--volatile-chunk-fields", "system_fingerprint")
# The nginx beside the sidecar keeps idle upstream connections for its default
# keepalive_timeout, 60 s (targets.nginx: "keepalive 256"); the sidecar's
# default is 4 s (under uvicorn's 5 s, so an engine never closes one just as a
# request goes out on it). A burst row's rounds are more than 4 s apart, so
# with the default every burst would also open 200 upstream connections that
# nginx's finds open: the same keep-alive for both compares the proxies.
NGINX_KEEPALIVE_FLAGS = ("--upstream-keepalive-s", "60")


def run(quick: bool) -> dict[str, Any]:
    streams, events = (50, 200) if quick else (200, 500)
    hold_streams = 500 if quick else 5000
    upstream_port, sidecar_port, nginx_port = free_port(), free_port(), free_port()
    results: dict[str, Any] = {"machine": {"cores": os.cpu_count()}, "targets": {}}
    with process([PY, LOAD, "upstream", "--port", str(upstream_port)], "upstream"), \
            sidecar(sidecar_port, upstream_port, flags=STAMP_FLAGS) as side, \
            nginx(nginx_port, upstream_port) as ngx:
        targets = {"direct": (upstream_port, None),
                   "tokenwire": (sidecar_port, lambda: side.pid),
                   "nginx": (nginx_port, lambda: nginx_worker_pid(ngx))}
        for name, (port, pid_of) in targets.items():
            row: dict[str, Any] = {}
            print(f"[{name}] throughput {streams}x{events}", flush=True)
            cpu_before = cpu_seconds(pid_of()) if pid_of else 0.0
            row["throughput"] = client("throughput", port, upstream_port, "--streams", str(streams),
                                       "--events", str(events), "--interval-ms", "10")
            if pid_of:
                tokens = max(row["throughput"]["delivered_tokens"], 1)
                row["throughput"]["proxy_cpu_us_per_event"] = round(
                    (cpu_seconds(pid_of()) - cpu_before) / tokens * 1e6, 1)
            print(f"[{name}] reset", flush=True)
            row["reset"] = client("reset", port, upstream_port, "--streams", "100" if quick else "300",
                                  "--concurrency", "20")
            print(f"[{name}] slow readers", flush=True)
            before = rss_kib(pid_of()) if pid_of else None
            row["slow"] = client("slow", port, upstream_port, "--streams", "4", "--events",
                                 "2000" if quick else "5000", "--read-bytes", "2048",
                                 "--read-pause-ms", "100", "--rcvbuf", "4096", timeout_s=900)
            if pid_of:
                row["slow"]["proxy_rss_growth_kib"] = rss_kib(pid_of()) - (before or 0)
                print(f"[{name}] hold {hold_streams}", flush=True)
                row["hold"] = hold(port, upstream_port, pid_of, hold_streams)
            results["targets"][name] = row
    direct = results["targets"]["direct"]["throughput"]
    for name in ("tokenwire", "nginx"):
        tp = results["targets"][name]["throughput"]
        tp["events_per_s_vs_direct"] = round(tp["delivered_events_per_s"]
                                             / direct["delivered_events_per_s"], 4)
        tp["added_latency_p50_ms"] = round(tp["latency"]["p50_ms"] - direct["latency"]["p50_ms"], 3)
        tp["added_latency_p99_ms"] = round(tp["latency"]["p99_ms"] - direct["latency"]["p99_ms"], 3)
    return results


@contextlib.contextmanager
def side_by_side(base_code: str | None, *, flags: tuple[str, ...] = STAMP_FLAGS,
                 direct: bool = False) -> Iterator[tuple[int, dict[str, tuple[int, int | None]]]]:
    """The fake upstream, and beside it tokenwire, nginx (one worker) and, with
    ``base_code``, the sidecar from that directory as ``base``: yields the
    upstream's port and ``{name: (port, pid)}`` in the order they take turns
    (``direct`` first if asked: the upstream itself, no pid)."""
    upstream_port = free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(process([PY, LOAD, "upstream", "--port", str(upstream_port)], "upstream"))
        targets: dict[str, tuple[int, int | None]] = {"direct": (upstream_port, None)} if direct else {}
        side = stack.enter_context(sidecar(free_port(), upstream_port, flags=flags))
        targets["tokenwire"] = (side.port, side.pid)
        nginx_port = free_port()
        ngx = stack.enter_context(nginx(nginx_port, upstream_port))
        targets["nginx"] = (nginx_port, nginx_worker_pid(ngx))
        if base_code is not None:
            base = stack.enter_context(sidecar(free_port(), upstream_port, code=base_code, flags=flags))
            targets["base"] = (base.port, base.pid)
        yield upstream_port, targets


def cpu_per_event(rounds: int, streams: int, events: int, interval_ms: float,
                  base_code: str | None = None) -> dict[str, Any]:
    """Proxy CPU per delivered event, tokenwire and nginx alternating, ``rounds`` each.

    CPU = the proxy process's user + system time (``/proc/PID/stat``) over a
    throughput run; events = tokens the client received (exact text checked).
    ``base_code``: also a ``base`` sidecar run from that directory (the code
    before a change), in the same rotation.
    """
    with side_by_side(base_code) as (upstream_port, targets):
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for round_index in range(rounds + 1):  # round 0 warms up
            for name, (port, pid) in targets.items():
                assert pid is not None
                before = cpu_seconds(pid)
                result = client("throughput", port, upstream_port, "--streams", str(streams),
                                "--events", str(events), "--interval-ms", str(interval_ms))
                used_s = cpu_seconds(pid) - before
                tokens = max(result["delivered_tokens"], 1)
                row = {"us_per_event": round(used_s / tokens * 1e6, 1), "cpu_s": round(used_s, 3),
                       "tokens": result["delivered_tokens"], "exact_text": result["exact_text"],
                       "latency": result["latency"]}
                print(f"[round {round_index}] {name}: {json.dumps(row)}", flush=True)
                if round_index:
                    rows[name].append(row)
    medians = {name: sorted(r["us_per_event"] for r in runs)[len(runs) // 2]
               for name, runs in rows.items()}
    return {"streams": streams, "events": events, "interval_ms": interval_ms, "rounds": rows,
            "median_us_per_event": medians}


def burst_rounds(rounds: int, streams: int = 200, events: int = 500,
                 base_code: str | None = None, parse: bool = False) -> dict[str, Any]:
    """The 200 x 100 events/s target, direct, tokenwire and nginx alternating, ``rounds`` each.

    Every stream starts within one 10 ms interval, so the run also measures a
    burst of new streams: their time to first event (connect, set-up, the
    upstream's first chunk), which counts in delivered vs direct. Per target:
    medians over the rounds of delivered vs direct (same round's direct run),
    first event p50/p99, added latency p50/p99. ``base_code``: also a ``base``
    sidecar run from that directory, in the same rotation. The sidecars keep
    idle upstream connections as long as the nginx beside them (see
    ``NGINX_KEEPALIVE_FLAGS``). ``parse``: the client parses every event as an
    SDK does (``sse_load.py client --parse``).
    """
    flags = STAMP_FLAGS + NGINX_KEEPALIVE_FLAGS
    parsing = ("--parse",) if parse else ()
    with side_by_side(base_code, direct=True, flags=flags) as (upstream_port, targets):
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for round_index in range(rounds + 1):  # round 0 warms up
            direct_rate = 1.0
            for name, (port, _) in targets.items():
                result = client("throughput", port, upstream_port, "--streams", str(streams),
                                "--events", str(events), "--interval-ms", "10", *parsing)
                if name == "direct":
                    direct_rate = result["delivered_events_per_s"]
                row = {"vs_direct": round(result["delivered_events_per_s"] / direct_rate, 4),
                       "exact_text": result["exact_text"], "first_event": result["first_event"],
                       "latency": result["latency"]}
                print(f"[round {round_index}] {name}: {json.dumps(row)}", flush=True)
                if round_index:
                    rows[name].append(row)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {"streams": streams, "events": events, "parse": parse, "rounds": rows,
            "load_average_after": list(os.getloadavg()),
            "medians": {name: {"vs_direct": median([r["vs_direct"] for r in runs]),
                               "first_event_p50_ms": median([r["first_event"]["p50_ms"] for r in runs]),
                               "first_event_p99_ms": median([r["first_event"]["p99_ms"] for r in runs]),
                               "latency_p50_ms": median([r["latency"]["p50_ms"] for r in runs]),
                               "latency_p99_ms": median([r["latency"]["p99_ms"] for r in runs])}
                        for name, runs in rows.items()}}


def resets_at_once(rounds: int, clients: int = 50, code: str | None = None) -> dict[str, Any]:
    """``clients`` clients reset at once, tokenwire and nginx alternating, ``rounds`` each.

    Each round opens ``clients`` streams (10 ms events), lets each read 3
    events, then resets them all back to back (SO_LINGER 0); the upstream
    stamps when it sees each connection close. Per target: p50/p99 of the
    delays pooled over all rounds, and the median of the rounds' own p99s.
    ``code``: run that tokenwire checkout as ``base`` beside them.
    """
    with side_by_side(code, flags=()) as (upstream_port, targets):
        delays: dict[str, list[float]] = {name: [] for name in targets}
        round_p99: dict[str, list[float]] = {name: [] for name in targets}
        for round_index in range(rounds + 1):  # round 0 warms up
            for name, (port, _) in targets.items():
                result = client("reset", port, upstream_port, "--streams", str(clients),
                                "--concurrency", str(clients), "--at-once")
                summary = result["reset_to_upstream_close"]
                print(f"[round {round_index}] {name}: {json.dumps(summary)}", flush=True)
                if round_index:
                    delays[name].extend(result["delays_ms"])
                    round_p99[name].append(summary["p99_ms"])

    def pick(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {"rounds": rounds, "clients": clients, "load_average_after": list(os.getloadavg()),
            "targets": {name: {"p50_ms": pick(values, 0.5), "p99_ms": pick(values, 0.99),
                               "max_ms": pick(values, 1.0), "n": len(values),
                               "median_round_p99_ms": pick(round_p99[name], 0.5)}
                        for name, values in delays.items()}}


SWEEP_RATES = (5_000, 10_000, 20_000)
SWEEP_STREAMS = 200
SWEEP_SECONDS = 4.0


SWEEP_TARGETS = ("direct", "tokenwire-1", "tokenwire-2", "nginx-1", "nginx-2")


def sweep(rounds: int, rates: tuple[int, ...] = SWEEP_RATES,
          names: tuple[str, ...] = SWEEP_TARGETS, base_code: str | None = None) -> dict[str, Any]:
    """Offered load against every target, side by side in one run.

    Targets: direct, tokenwire with ``--workers`` 1 and 2, nginx with 1 and 2
    workers (``reuseport``). For each offered rate (200 streams, each at
    rate/200 events/s for ``SWEEP_SECONDS``), the targets take turns,
    ``rounds`` times; per cell: delivered events/s and its ratio to direct's
    in the same round, latency p50/p99 and the added latency over direct's
    (medians over rounds), and the CPU of the proxy's whole process tree per
    delivered event. Then 50 clients that reset at once, per target: time
    until the upstream sees each connection close. ``base_code``: also run
    ``base-1``, the sidecar from that directory (one worker), for a
    before/after comparison side by side.
    """
    if base_code is not None:
        names = (*names, "base-1")
    upstream_port = free_port()
    ports = {name: free_port() for name in names if name != "direct"}
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process([PY, LOAD, "upstream", "--port", str(upstream_port)], "upstream"))
        pids: dict[str, int | None] = {"direct": None}
        for name, port in ports.items():
            kind, _, workers = name.partition("-")
            if kind == "nginx":
                started = stack.enter_context(nginx(port, upstream_port, int(workers)))
            else:
                started = stack.enter_context(sidecar(port, upstream_port, int(workers),
                                                      base_code if kind == "base" else None,
                                                      flags=STAMP_FLAGS))
            pids[name] = started.pid
        targets = {"direct": upstream_port, **ports}  # direct first: the others' reference
        # Warm-up: every target once at the lowest rate.
        for port in targets.values():
            client("throughput", port, upstream_port, "--streams", "50", "--events", "50",
                   "--interval-ms", "20")
        for rate in rates:
            interval_ms = SWEEP_STREAMS / rate * 1000
            events = int(SWEEP_SECONDS * 1000 / interval_ms)
            for round_index in range(rounds):
                direct_rate = None
                for name, port in targets.items():
                    pid = pids[name]
                    before = tree_cpu_seconds(pid) if pid else 0.0
                    result = client("throughput", port, upstream_port, "--streams", str(SWEEP_STREAMS),
                                    "--events", str(events), "--interval-ms", f"{interval_ms:g}")
                    used_s = tree_cpu_seconds(pid) - before if pid else 0.0
                    tokens = max(result["delivered_tokens"], 1)
                    row = {"delivered_events_per_s": result["delivered_events_per_s"],
                           "complete": result["complete"], "exact_text": result["exact_text"],
                           "latency": result["latency"],
                           "cpu_us_per_event": round(used_s / tokens * 1e6, 2) if pid else None}
                    if name == "direct":
                        direct_rate = result["delivered_events_per_s"]
                    row["vs_direct"] = round(result["delivered_events_per_s"] / (direct_rate or 1), 4)
                    cells.setdefault(str(rate), {}).setdefault(name, []).append(row)
                    print(f"[{rate}/s round {round_index}] {name}: {json.dumps(row)}", flush=True)
        resets: dict[str, Any] = {}
        for name, port in targets.items():
            resets[name] = client("reset", port, upstream_port, "--streams", "50",
                                  "--concurrency", "50")
            print(f"[reset x50] {name}: {json.dumps(resets[name])}", flush=True)

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    summary: dict[str, Any] = {}
    for rate, by_target in cells.items():
        direct_p50 = median([r["latency"]["p50_ms"] for r in by_target["direct"]])
        direct_p99 = median([r["latency"]["p99_ms"] for r in by_target["direct"]])
        for name, rows in by_target.items():
            p50 = median([r["latency"]["p50_ms"] for r in rows])
            p99 = median([r["latency"]["p99_ms"] for r in rows])
            cpu = [r["cpu_us_per_event"] for r in rows if r["cpu_us_per_event"] is not None]
            summary.setdefault(rate, {})[name] = {
                "delivered_events_per_s": median([r["delivered_events_per_s"] for r in rows]),
                "vs_direct": median([r["vs_direct"] for r in rows]),
                "latency_p50_ms": p50, "latency_p99_ms": p99,
                "added_p50_ms": round(p50 - direct_p50, 3), "added_p99_ms": round(p99 - direct_p99, 3),
                "cpu_us_per_event": median(cpu) if cpu else None,
                "complete": min(r["complete"] for r in rows),
                "exact_text": min(r["exact_text"] for r in rows),
            }
    load = os.getloadavg()
    return {"rounds": rounds, "streams": SWEEP_STREAMS, "seconds": SWEEP_SECONDS,
            "load_average_after": [round(x, 2) for x in load], "cells": cells, "summary": summary,
            "reset_50_at_once": {n: r["reset_to_upstream_close"] for n, r in resets.items()}}


def plot_sweep(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    rates = sorted(summary, key=int)
    names = [n for n in summary[rates[0]] if n != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in names:
        xs = [int(r) for r in rates]
        axes[0].plot(xs, [max(summary[r][name]["added_p50_ms"], 0.01) for r in rates], marker="o", label=name)
        axes[1].plot(xs, [max(summary[r][name]["added_p99_ms"], 0.01) for r in rates], marker="o", label=name)
        axes[2].plot(xs, [summary[r][name]["cpu_us_per_event"] for r in rates], marker="o", label=name)
    axes[0].set_title("added latency p50 vs direct (ms)")
    axes[1].set_title("added latency p99 vs direct (ms)")
    axes[2].set_title("proxy CPU per event (us)")
    for axis in axes[:2]:
        axis.set_yscale("log")
    for axis in axes:
        axis.set_xlabel("offered events/s (200 streams)")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["targets"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    p50 = [results["targets"][n]["throughput"]["latency"]["p50_ms"] for n in names]
    p99 = [results["targets"][n]["throughput"]["latency"]["p99_ms"] for n in names]
    xs = range(len(names))
    axes[0].bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    axes[0].bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    axes[0].set_xticks(list(xs), names)
    axes[0].set_title("delivery latency, upstream send -> client read (ms)")
    axes[0].legend()
    reset = [results["targets"][n]["reset"]["reset_to_upstream_close"]["p99_ms"] for n in names]
    axes[1].bar(names, reset)
    axes[1].set_title("client reset -> upstream closed, p99 (ms)")
    slow = [max(s["last_token_after_generation_s"] or 0 for s in results["targets"][n]["slow"]["streams"])
            for n in names]
    axes[2].bar(names, slow)
    axes[2].set_title("slow reader: last token after generation end (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke check")
    parser.add_argument("--cpu", type=int, metavar="ROUNDS", default=0,
                        help="only measure proxy CPU per event (40 streams x 500 events at 5 ms), "
                             "ROUNDS alternating rounds after a warm-up; writes sidecar_cpu.json")
    parser.add_argument("--sweep", type=int, metavar="ROUNDS", default=0,
                        help="offered load 5k/10k/20k events/s against direct, tokenwire --workers 1/2 "
                             "and nginx 1/2 workers, ROUNDS rounds each, plus 50 resets at once; "
                             "writes sidecar_sweep.json and sidecar_sweep.png")
    parser.add_argument("--targets", default=",".join(SWEEP_TARGETS),
                        help="--sweep: which targets (direct must come first)")
    parser.add_argument("--out", default="sidecar_sweep", help="--sweep: results file name")
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="--sweep, --cpu, --burst, --resets: also run the tokenwire package in "
                             "DIR/tokenwire (e.g. `git archive OLD middleware sidecar` unpacked) as base")
    parser.add_argument("--burst", type=int, metavar="ROUNDS", default=0,
                        help="only the 200 x 100 events/s run (200 streams starting at once), direct, "
                             "tokenwire and nginx alternating, ROUNDS rounds after a warm-up (with --base: "
                             "that checkout too); writes sidecar_burst.json")
    parser.add_argument("--parse", action="store_true",
                        help="--burst: the client parses every event as an SDK does (SSE parser, "
                             "json.loads); writes sidecar_burst_parse.json")
    parser.add_argument("--resets", type=int, metavar="ROUNDS", default=0,
                        help="only 50 clients resetting at once, tokenwire and nginx alternating, "
                             "ROUNDS rounds after a warm-up (with --base: that checkout too); "
                             "writes sidecar_resets.json")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.burst:
        burst = burst_rounds(args.burst, base_code=args.base, parse=args.parse)
        name = "sidecar_burst_parse.json" if args.parse else "sidecar_burst.json"
        (RESULTS / name).write_text(json.dumps(burst, indent=2) + "\n")
        print(json.dumps(burst["medians"], indent=2))
        return 0
    if args.resets:
        resets = resets_at_once(args.resets, code=args.base)
        (RESULTS / "sidecar_resets.json").write_text(json.dumps(resets, indent=2) + "\n")
        print(json.dumps(resets, indent=2))
        return 0
    if args.sweep:
        sweep_results = sweep(args.sweep, names=tuple(args.targets.split(",")), base_code=args.base)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(sweep_results, indent=2) + "\n")
        plot_sweep(sweep_results, RESULTS / f"{args.out}.png")
        print(json.dumps(sweep_results["summary"], indent=2))
        print(json.dumps(sweep_results["reset_50_at_once"], indent=2))
        return 0
    if args.cpu:
        cpu = cpu_per_event(args.cpu, 40, 500, 5, base_code=args.base)
        (RESULTS / "sidecar_cpu.json").write_text(json.dumps(cpu, indent=2) + "\n")
        print(json.dumps(cpu, indent=2))
        return 0
    results = run(args.quick)
    results["quick"] = args.quick
    (RESULTS / "sidecar.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "sidecar.png")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
