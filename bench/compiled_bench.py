"""The sidecar with its core compiled (mypyc) against the same code as pure Python, side by side.

``scripts/compile-core.sh`` compiles the hot modules of the wire core in place.
This bench asks what that buys the sidecar: one fake upstream
(``sse_load.py upstream``), two sidecars in front of it, both started from
this checkout (``compiled``: the checkout as it is, its core compiled; and
``pure``: the checkout's ``.py`` files copied to a scratch package put first
on the path, no extensions), and nginx beside them for scale. Each round runs
``sse_load.py client throughput`` (``--streams`` x ``--events`` chunks every
``--interval-ms``) against each target in turn, the order alternating round
by round so drifting load hits both alike; per target: the proxy process's
CPU (user + system, ``/proc/PID/stat``) per delivered event, delivered
events/s, and the client-side latency (upstream send to client read) p50/p99.
The report gives per target the median and worst over rounds, and the median
of the per-round ratios compiled/pure (< 1: the compiled core costs less).

Run: ``python bench/compiled_bench.py [--rounds 7 --streams 40 --events 500 --interval-ms 5]``
from a checkout whose core is compiled; writes ``bench/results/compiled.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenwire.middleware import compiled_modules

# The bench folder is not a package: its sidecar_bench.py is imported by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sidecar_bench as sb


def pure_copy(into: Path) -> Path:
    """This checkout's packages as ``.py`` only, under ``into/tokenwire``."""
    package = into / "tokenwire"
    shutil.copytree(sb.ROOT / "tokenwire", package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("middleware", "sidecar", "engine"):
        shutil.copytree(sb.ROOT / name, package / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--no-nginx", action="store_true", help="only the two sidecars")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                        help="one more sidecar, run from the tokenwire package in DIR/tokenwire "
                             "(e.g. another build of the core), as NAME; repeatable")
    parser.add_argument("--out", type=Path, default=sb.RESULTS / "compiled.json")
    args = parser.parse_args(argv)
    if not compiled_modules():
        parser.error("this checkout's core is not compiled: run scripts/compile-core.sh first")
    rows: dict[str, list[dict[str, Any]]] = {}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        base = str(pure_copy(Path(scratch)))
        upstream_port = sb.free_port()
        stack.enter_context(sb.process([sb.PY, sb.LOAD, "upstream", "--port", str(upstream_port)],
                                       "upstream"))
        targets: dict[str, tuple[int, int]] = {}
        arms = [("compiled", None), ("pure", base), *(tuple(a.split("=", 1)) for a in args.also)]
        for name, code in arms:
            port = sb.free_port()
            targets[name] = (port, stack.enter_context(sb.sidecar(port, upstream_port, code=code)).pid)
        if not args.no_nginx:
            port = sb.free_port()
            targets["nginx"] = (port, sb.nginx_worker_pid(stack.enter_context(sb.nginx(port, upstream_port))))
        for round_index in range(args.rounds + 1):  # round 0 warms up
            order = list(targets) if round_index % 2 else list(reversed(targets))
            used: dict[str, float] = {}
            for name in order:
                port, pid = targets[name]
                before = sb.cpu_seconds(pid)
                result = sb.client("throughput", port, upstream_port, "--streams", str(args.streams),
                                   "--events", str(args.events), "--interval-ms", f"{args.interval_ms:g}")
                tokens = max(result["delivered_tokens"], 1)
                used[name] = (sb.cpu_seconds(pid) - before) / tokens * 1e6
                row = {"us_per_event": round(used[name], 2), "tokens": result["delivered_tokens"],
                       "exact_text": result["exact_text"],
                       "delivered_events_per_s": result["delivered_events_per_s"],
                       "latency_p50_ms": result["latency"]["p50_ms"],
                       "latency_p99_ms": result["latency"]["p99_ms"]}
                print(f"[round {round_index}] {name}: {json.dumps(row)}", flush=True)
                if round_index:
                    rows.setdefault(name, []).append(row)
            if round_index:
                ratios.append(used["compiled"] / used["pure"])
    summary = {name: {"us_per_event_median": statistics.median(r["us_per_event"] for r in runs),
                      "us_per_event_worst": max(r["us_per_event"] for r in runs),
                      "latency_p50_ms_median": statistics.median(r["latency_p50_ms"] for r in runs),
                      "latency_p99_ms_median": statistics.median(r["latency_p99_ms"] for r in runs),
                      "exact_text_min": min(r["exact_text"] for r in runs)}
               for name, runs in rows.items()}
    report = {"rounds": args.rounds, "streams": args.streams, "events": args.events,
              "interval_ms": args.interval_ms, "compiled_modules": list(compiled_modules()),
              "summary": summary, "ratio_compiled_over_pure_median": round(statistics.median(ratios), 3),
              "ratios": [round(r, 3) for r in ratios], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("summary", "ratio_compiled_over_pure_median", "ratios")},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
