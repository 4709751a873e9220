"""HTTP/2 benchmark: tokenwire's HTTP/2 path beside its HTTP/1.1 path and nginx
(``http2``, TLS), side by side, one run.

Method (figures in docs/perf/http2-grpc.md, "HTTP/2"):

* One fake upstream (``sse_load.py upstream``: paced OpenAI chunks stamped
  with their send time) behind three targets: ``direct`` (plaintext HTTP/1.1,
  the latency baseline), the tokenwire sidecar (TLS, ALPN h2 and http/1.1),
  nginx (TLS, ``listen ... ssl http2``, ``proxy_buffering off``, one worker,
  upstream keepalive). Each load client is its own process (``h2_load.py``).
* ``throughput``: 200 streams x 500 events every 10 ms (100 events/s each);
  over HTTP/2 on 10 connections, over HTTP/1.1 on 200. Completion, exact text,
  delivered events/s, added latency (p50/p99 minus direct's), proxy CPU per event.
* ``reset``: 200 streams, one at a time, cancelled after 3 events: RST_STREAM
  over HTTP/2, a TCP reset over HTTP/1.1; until the upstream connection closes.
* ``stuck``: 200 streams on one HTTP/2 connection, one of which never opens
  its window; the other 199's longest gap between events (events every 10 ms,
  20,000/s on the connection, and every 50 ms).
* ``rapid reset``: 100,000 HEADERS+DATA+RST_STREAM streams from one client
  while a bystander connection streams; the proxy's RSS and CPU before/after,
  the GOAWAY code, the bystander's longest gap, how many requests reached the
  upstream.

Usage: ``python bench/h2_bench.py [--quick]``; writes ``bench/results/h2.json``.
``--stuck ROUNDS`` / ``--resets ROUNDS`` / ``--cpu ROUNDS`` run one scenario alone
(``--cpu``: ``throughput`` over HTTP/2 only, the proxy's CPU per event),
tokenwire and nginx alternating (``--base DIR``: an older checkout beside
them); they print. The floods are ``h2_flood.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidecar_bench import client

from testbed.targets import (
    LOAD,
    PY,
    RunningSidecar,
    certificate,
    cpu_seconds,
    fake_upstream,
    free_port,
    nginx,
    nginx_worker_pid,
    process,
    rss_kib,
    sidecar,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
H2LOAD = str(ROOT / "bench" / "h2_load.py")
# The stuck-stream scenario holds 200 streams on one connection: both proxies
# allow 256 (their default, 128, would refuse the last 72).
MAX_STREAMS = 256


def fetch_closes(upstream_port: int) -> dict[str, Any]:
    """What the fake upstream saw end: ``closes`` (cut by the proxy) and ``finished``, by id."""
    with urllib.request.urlopen(f"http://127.0.0.1:{upstream_port}/closes", timeout=10) as response:
        seen: dict[str, Any] = json.loads(response.read())
    return seen


def sidecar_tls(listen_port: int, upstream_port: int, cert: str, key: str,
                code: str | None = None) -> contextlib.AbstractContextManager[RunningSidecar]:
    """The sidecar with TLS and HTTP/2 as this bench runs it; ``code``: another
    ``tokenwire`` package (an older checkout) for a before/after comparison."""
    return sidecar(listen_port, upstream_port, code=code, admin=False, flags=(
        "--tls-cert", cert, "--tls-key", key, "--http2-max-concurrent-streams", str(MAX_STREAMS),
        # nginx's client_header_timeout (60 s): 200 TLS handshakes from one
        # Python client on a busy box can take longer than the sidecar's 10 s.
        "--header-read-timeout-s", "60"))


def nginx_h2(listen_port: int, upstream_port: int, cert: str,
             key: str) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    return nginx(listen_port, upstream_port, tls=(cert, key), max_streams=MAX_STREAMS)


def load(scenario: str, port: int, *args: str, timeout_s: float = 600) -> dict[str, Any]:
    cmd = [PY, H2LOAD, scenario, "--target", f"127.0.0.1:{port}", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    for line in run.stdout.splitlines():
        if line.startswith('{"result"'):
            result: dict[str, Any] = json.loads(line)["result"]
            return result
    return {"error": f"{scenario}: exit {run.returncode}: {run.stderr[-800:]}"}


def rapid_reset(port: int, upstream_port: int, pid: int, pairs: int) -> dict[str, Any]:
    bystander = subprocess.Popen(
        [PY, H2LOAD, "stuck", "--target", f"127.0.0.1:{port}", "--streams", "2", "--events", "600",
         "--interval-ms", "10"], stdout=subprocess.PIPE, text=True)
    before_rss, before_cpu = rss_kib(pid), cpu_seconds(pid)
    attack = load("rapid-reset", port, "--pairs", str(pairs))
    after_rss, after_cpu = rss_kib(pid), cpu_seconds(pid)
    out, _ = bystander.communicate(timeout=120)
    gap = json.loads(next(line for line in out.splitlines() if line.startswith('{"result"')))["result"]
    seen = fetch_closes(upstream_port)
    reached = len([k for k in {**seen["closes"], **seen["finished"]} if k.startswith("rr")])
    return {**attack, "rss_before_kib": before_rss, "rss_after_kib": after_rss,
            "proxy_cpu_s": round(after_cpu - before_cpu, 3), "bystander_longest_gap_ms":
            gap["others_longest_gap_ms"], "streams_reaching_upstream": reached}


def run(quick: bool) -> dict[str, Any]:
    streams, events = (50, 200) if quick else (200, 500)
    pairs = 20_000 if quick else 100_000
    tmp = Path(tempfile.mkdtemp(prefix="tokenwire-h2-bench-"))
    cert, key = certificate(tmp)
    upstream_port, sidecar_port, nginx_port = free_port(), free_port(), free_port()
    results: dict[str, Any] = {"targets": {}}
    with fake_upstream(upstream_port), \
            sidecar_tls(sidecar_port, upstream_port, cert, key) as side, \
            nginx_h2(nginx_port, upstream_port, cert, key) as ngx:
        print("[direct] throughput", flush=True)
        direct = client("throughput", upstream_port, upstream_port, "--streams", str(streams),
                        "--events", str(events), "--interval-ms", "10")
        results["direct"] = direct
        pids = {"tokenwire": side.pid, "nginx": nginx_worker_pid(ngx)}
        ports = {"tokenwire": sidecar_port, "nginx": nginx_port}
        for name in ("tokenwire", "nginx"):
            row: dict[str, Any] = {}
            for proto in ("h1", "h2"):
                print(f"[{name}] throughput {proto}", flush=True)
                cpu_before = cpu_seconds(pids[name])
                h1_flag = ["--h1"] if proto == "h1" else []
                tp = load("throughput", ports[name], "--streams", str(streams), "--connections", "10",
                          "--events", str(events), "--interval-ms", "10", *h1_flag)
                if "error" in tp:
                    row[f"throughput_{proto}"] = tp
                    continue
                tp["proxy_cpu_us_per_event"] = round(
                    (cpu_seconds(pids[name]) - cpu_before) / max(tp["delivered_events"], 1) * 1e6, 1)
                tp["added_latency_p50_ms"] = round(tp["latency"]["p50_ms"] - direct["latency"]["p50_ms"], 3)
                tp["added_latency_p99_ms"] = round(tp["latency"]["p99_ms"] - direct["latency"]["p99_ms"], 3)
                row[f"throughput_{proto}"] = tp
                print(f"[{name}] reset {proto}", flush=True)
                row[f"reset_{proto}"] = load("reset", ports[name], "--upstream-port", str(upstream_port),
                                             "--streams", "50" if quick else "200", *h1_flag)
            h1, h2 = row["throughput_h1"], row["throughput_h2"]
            row["h2_vs_h1"] = {} if "error" in h1 or "error" in h2 else {
                "delivered_events": round(h2["delivered_events"] / max(h1["delivered_events"], 1), 4),
                "added_latency_p50": round(h2["added_latency_p50_ms"] / h1["added_latency_p50_ms"], 3)
                if h1["added_latency_p50_ms"] > 0 else None}
            for interval_ms in (10, 50):
                print(f"[{name}] stuck stream, events every {interval_ms} ms", flush=True)
                row[f"stuck_{interval_ms}ms"] = load("stuck", ports[name], "--streams", str(streams),
                                                     "--events", str(3000 // interval_ms),
                                                     "--interval-ms", str(interval_ms))
            print(f"[{name}] rapid reset {pairs}", flush=True)
            row["rapid_reset"] = rapid_reset(ports[name], upstream_port, pids[name], pairs)
            results["targets"][name] = row
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def rotation(stack: contextlib.ExitStack, code: str | None) -> tuple[int, dict[str, int], dict[str, int]]:
    """The fake upstream and the targets a ``--stuck``/``--resets``/``--cpu`` run
    (and ``h2_flood.py``) takes turns on (tokenwire, nginx, and ``code`` as
    ``base``), entered on ``stack``; returns the upstream's port, each target's
    port and the pid that serves it."""
    tmp = Path(tempfile.mkdtemp(prefix="tokenwire-h2-rounds-"))
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
    cert, key = certificate(tmp)
    upstream_port = free_port()
    ports = {"tokenwire": free_port(), "nginx": free_port(), **({"base": free_port()} if code else {})}
    stack.enter_context(process([PY, LOAD, "upstream", "--port", str(upstream_port)], "upstream"))
    ours = stack.enter_context(sidecar_tls(ports["tokenwire"], upstream_port, cert, key))
    theirs = stack.enter_context(nginx_h2(ports["nginx"], upstream_port, cert, key))
    pids = {"tokenwire": ours.pid, "nginx": nginx_worker_pid(theirs)}
    if code is not None:
        base = stack.enter_context(sidecar_tls(ports["base"], upstream_port, cert, key, code=code))
        pids["base"] = base.pid
    return upstream_port, ports, pids


def cpu_rounds(rounds: int, streams: int, code: str | None = None) -> dict[str, Any]:
    """Only ``throughput`` over HTTP/2 (``streams`` streams on 10 connections,
    500 events every 10 ms), tokenwire and nginx alternating (and ``code`` as
    ``base``), ``rounds`` rounds after a warm-up: the proxy's CPU per event
    (user + system over the run / events delivered), the median over rounds,
    and the median of the per-round ratios to ``base`` (or nginx)."""
    rows: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        _, ports, pids = rotation(stack, code)
        names = list(ports)
        for round_index in range(rounds + 1):  # round 0 warms up
            order = names if round_index % 2 else names[::-1]
            for name in order:
                cpu_before = cpu_seconds(pids[name])
                result = load("throughput", ports[name], "--streams", str(streams), "--connections", "10",
                              "--events", "500", "--interval-ms", "10")
                if "error" in result:
                    print(f"[round {round_index}] {name}: {result['error']}", flush=True)
                    continue
                us = (cpu_seconds(pids[name]) - cpu_before) / max(result["delivered_events"], 1) * 1e6
                print(f"[round {round_index}] {name}: {us:.1f} us/event, complete {result['complete']}, "
                      f"p50/p99 {result['latency']['p50_ms']}/{result['latency']['p99_ms']} ms", flush=True)
                if round_index:
                    rows.setdefault(name, []).append(us)

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    against = "base" if code else "nginx"
    ratios = [a / b for a, b in zip(rows.get("tokenwire", []), rows.get(against, []), strict=False)]
    return {"rounds": rounds, "streams": streams, "load_average_after": list(os.getloadavg()),
            "cpu_us_per_event": {name: round(median(values), 1) for name, values in rows.items()},
            "runs": {name: [round(v, 1) for v in values] for name, values in rows.items()},
            f"tokenwire_over_{against}_median": round(median(ratios), 3) if ratios else None}


def stuck_rounds(rounds: int, streams: int, code: str | None = None) -> dict[str, Any]:
    """Only the stuck-stream scenario, tokenwire and nginx alternating (and the
    checkout in ``code`` as ``base``), ``rounds`` rounds after a warm-up, at
    events every 50 ms and 10 ms; per cell the median over rounds of the other
    streams' longest gap and gap p99, as multiples of the upstream's gap."""
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        _, ports, _ = rotation(stack, code)
        for round_index in range(rounds + 1):  # round 0 warms up
            for interval_ms in (50, 10):
                for name, port in ports.items():
                    result = load("stuck", port, "--streams", str(streams),
                                  "--events", str(3000 // interval_ms), "--interval-ms", str(interval_ms))
                    print(f"[round {round_index}] {name} every {interval_ms} ms: {json.dumps(result)}",
                          flush=True)
                    if round_index and "error" not in result:
                        rows.setdefault(f"{interval_ms}ms", {}).setdefault(name, []).append(result)

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    summary = {cell: {name: {
        "others_complete_min": min(r["others_complete"] for r in runs),
        "longest_gap_ms": median([r["others_longest_gap_ms"] for r in runs]),
        "longest_gap_x_upstream": round(median([r["others_longest_gap_ms"] for r in runs])
                                        / runs[0]["upstream_gap_ms"], 2),
        "gap_p99_ms": median([r["others_gap_p99_ms"] for r in runs])}
        for name, runs in by_name.items()} for cell, by_name in rows.items()}
    return {"rounds": rounds, "streams": streams, "load_average_after": list(os.getloadavg()),
            "summary": summary, "runs": rows}


def reset_rounds(rounds: int, streams: int, code: str | None = None) -> dict[str, Any]:
    """Only the reset scenario (``streams`` streams one at a time, cancelled
    after 3 events: RST_STREAM over HTTP/2, a TCP reset over HTTP/1.1), tokenwire
    and nginx alternating (and ``code`` as ``base``), ``rounds`` rounds after a
    warm-up; per cell the median over rounds of p50 and of p99."""
    rows: dict[str, dict[str, list[dict[str, float]]]] = {}
    with contextlib.ExitStack() as stack:
        upstream_port, ports, _ = rotation(stack, code)
        for round_index in range(rounds + 1):  # round 0 warms up
            for proto in ("h2", "h1"):
                for name, port in ports.items():
                    result = load("reset", port, "--upstream-port", str(upstream_port), "--streams",
                                  str(streams), *(["--h1"] if proto == "h1" else []))
                    print(f"[round {round_index}] {name} {proto}: {json.dumps(result)}", flush=True)
                    if round_index and "error" not in result:
                        rows.setdefault(proto, {}).setdefault(name, []).append(
                            result["reset_to_upstream_close"])

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    summary = {proto: {name: {"p50_ms": median([r["p50_ms"] for r in runs]),
                              "p99_ms": median([r["p99_ms"] for r in runs])}
                       for name, runs in by_name.items()} for proto, by_name in rows.items()}
    return {"rounds": rounds, "streams": streams, "load_average_after": list(os.getloadavg()),
            "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 streams x 200 events, 20,000 pairs")
    parser.add_argument("--stuck", type=int, metavar="ROUNDS", default=0,
                        help="only the stuck-stream scenario (200 streams on one connection), "
                             "tokenwire and nginx alternating, ROUNDS rounds; prints")
    parser.add_argument("--resets", type=int, metavar="ROUNDS", default=0,
                        help="only the reset scenario (100 streams one at a time, HTTP/2 and "
                             "HTTP/1.1), tokenwire and nginx alternating, ROUNDS rounds; prints")
    parser.add_argument("--cpu", type=int, metavar="ROUNDS", default=0,
                        help="only HTTP/2 throughput (200 streams on 10 connections), the proxy's CPU "
                             "per event, tokenwire and nginx alternating, ROUNDS rounds; prints and "
                             "writes bench/results/h2_cpu.json")
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="--stuck/--resets/--cpu: also run the tokenwire package in DIR/tokenwire "
                             "as base")
    args = parser.parse_args()
    if args.cpu:
        cpu = cpu_rounds(args.cpu, 200, args.base)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "h2_cpu.json").write_text(json.dumps(cpu, indent=2) + "\n")
        print(json.dumps(cpu, indent=2))
        return 0
    if args.resets:
        print(json.dumps(reset_rounds(args.resets, 100, args.base), indent=2))
        return 0
    if args.stuck:
        print(json.dumps(stuck_rounds(args.stuck, 200, args.base)["summary"], indent=2))
        return 0
    results = run(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("h2_quick.json" if args.quick else "h2.json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
