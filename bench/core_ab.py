"""Side-by-side run of ``core_bench.py`` on two versions of the wire core, in one process.

A refactor of the core must not slow it down, and on a shared machine two
runs minutes apart differ by more than most refactors do. So both versions
run in one process, interleaved pass by pass: the *before* tree (``--before``,
a git revision) is extracted to a temporary folder and imported as a second
package (the core's imports are all relative), ``core_bench.py``'s driver
loop is loaded once against each, and every pass times one version over all
streams and then the other (the order alternating), so load that drifts hits
both alike. Per regime the report gives each version's median events/s (wall
clock and per CPU second), its worst pass (the p99 of so few passes), and the
median of the per-pass ratios after/before (> 1: faster now), by wall clock
and by CPU time (on a loaded machine the second is the steadier).

Run: ``python bench/core_ab.py --before main [--passes 15 --streams 100]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "core_bench.py"


def _extract(revision: str, into: Path, package: str) -> None:
    """The ``middleware`` folder of ``revision`` as ``<package>.middleware`` under ``into``."""
    folder = into / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "middleware"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)


def _bench_against(package: str) -> dict[str, Any]:
    """``core_bench.py``'s namespace with its core imported from ``package``."""
    source = BENCH.read_text().replace("from tokenwire.middleware import",
                                       f"from {package}.middleware import")
    namespace: dict[str, Any] = {"__name__": f"core_bench_{package}"}
    exec(compile(source, str(BENCH), "exec"), namespace)
    return namespace


def _pass(bench: dict[str, Any], streams: list[list[bytes]], config: Any, *, paused: bool,
          via_events: bool) -> tuple[float, float]:
    start, cpu_start = time.perf_counter(), time.process_time()
    for reads in streams:
        bench["run_stream"](reads, config, paused=paused, via_events=via_events)
    return time.perf_counter() - start, time.process_time() - cpu_start


def _one_call_costs(bench: dict[str, Any], calls: int) -> tuple[float, float]:
    """CPU µs per ``next_deadline()`` and per ``forward_read()`` (the sidecar's
    keeps-up path, three plain chunks a read) on a stream that is STREAMING."""
    config = bench["WireConfig"](terminal_marker="[DONE]", upstream_idle_timeout_s=30.0)
    stream = bench["WireStream"](config, now=0.0, request_id="ab")
    stream.handle(bench["UpstreamHeaders"](200, bench["SSE_HEADERS"]), 0.0)
    stream.handle(bench["UpstreamData"](b'data: {"a":1}\n\n'), 0.0)
    stream.data_to_send(0.0)
    stream.handle(bench["WriteCompleted"](), 0.0)
    read = b"".join(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n'
                    for _ in range(3))
    next_deadline, forward_read = stream.next_deadline, stream.forward_read
    start = time.process_time()
    for _ in range(calls):
        next_deadline()
    deadline_s = time.process_time() - start
    now = 0.0
    start = time.process_time()
    for _ in range(calls):
        now += 1e-6
        forward_read(read, now)
    return deadline_s / calls * 1e6, (time.process_time() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main", help="git revision to compare against")
    parser.add_argument("--passes", type=int, default=15, help="timed passes per version and regime")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "core_ab.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        _extract(args.before, Path(scratch), "tokenwire_before")
        sys.path.insert(0, scratch)
        versions = {"before": _bench_against("tokenwire_before"), "after": _bench_against("tokenwire")}
        rng = random.Random(20261129)
        streams: list[list[bytes]] = []
        total_events = 0
        for _ in range(args.streams):
            reads, count = versions["after"]["make_stream"](rng, args.events)
            streams.append(reads)
            total_events += count
        configs = {name: bench["WireConfig"](terminal_marker="[DONE]") for name, bench in versions.items()}
        report: dict[str, Any] = {"before": args.before, "passes": args.passes, "streams": args.streams,
                                  "events": total_events, "python": sys.version.split()[0],
                                  "regimes": {}}
        for regime, paused in (("keeps_up", False), ("paused", True)):
            for feed, via_events in (("upstream_data", False), ("parser_then_events", True)):
                key = f"{regime}/{feed}"
                rates: dict[str, list[float]] = {"before": [], "after": []}
                cpu_rates: dict[str, list[float]] = {"before": [], "after": []}
                ratios: list[float] = []
                cpu_ratios: list[float] = []
                for n in range(args.passes + 1):
                    order = ["before", "after"] if n % 2 else ["after", "before"]
                    took: dict[str, tuple[float, float]] = {}
                    for name in order:
                        wall_s, cpu_s = _pass(versions[name], streams, configs[name], paused=paused,
                                              via_events=via_events)
                        took[name] = (wall_s, cpu_s)
                        if n:  # the first pass warms up
                            rates[name].append(total_events / wall_s)
                            cpu_rates[name].append(total_events / cpu_s)
                    if n:
                        ratios.append(took["before"][0] / took["after"][0])
                        cpu_ratios.append(took["before"][1] / took["after"][1])
                row = {f"{name}_{what}": round(value) for name in ("before", "after") for what, value in (
                    ("median", statistics.median(rates[name])), ("worst", min(rates[name])),
                    ("median_per_cpu_s", statistics.median(cpu_rates[name])))}
                row["ratio_median"] = round(statistics.median(ratios), 3)
                row["cpu_ratio_median"] = round(statistics.median(cpu_ratios), 3)
                report["regimes"][key] = row
                print(f"{key:28} before {row['before_median']:>8,}  after {row['after_median']:>8,} "
                      f"events/s (worst {row['before_worst']:,} / {row['after_worst']:,}); "
                      f"per-pass ratio after/before, median {row['ratio_median']:.3f} "
                      f"(per CPU second {row['cpu_ratio_median']:.3f})", flush=True)
        costs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for n in range(7):
            for name in (["before", "after"] if n % 2 else ["after", "before"]):
                costs[name].append(_one_call_costs(versions[name], 200_000))
        for name, rows in costs.items():
            report[f"{name}_next_deadline_us"] = round(statistics.median(r[0] for r in rows), 3)
            report[f"{name}_forward_read_us"] = round(statistics.median(r[1] for r in rows), 3)
        print(f"next_deadline {report['before_next_deadline_us']} -> {report['after_next_deadline_us']} µs, "
              f"forward_read {report['before_forward_read_us']} -> {report['after_forward_read_us']} µs "
              "(CPU, median of 7 alternating rounds of 200,000 calls)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
