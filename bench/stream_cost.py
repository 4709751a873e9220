"""What a stream costs to set up and tear down: many short answers, side by side.

Why: a long answer's cost is its events (``sidecar_bench.py --cpu``); a chat
product's answers are short and many, so the cost of a stream's set-up and
end (accept, parse the request, pick a pod, the upstream request, the
response head, the record, the bookkeeping) is what bounds its streams per
second and its first event under load.

Method: the fake upstream (``sse_load.py upstream``) and, beside it, direct
(the upstream itself), tokenwire (the sidecar, default config but the
upstream keep-alive nginx has), nginx (one worker) and, with ``--base DIR``,
the sidecar from that directory; each round, each target in turn, the load
client (``sse_load.py client throughput``) runs ``--streams`` answers of
``--events`` events 1 ms apart, ``--concurrency`` at a time, each stream its
own client connection. Per proxy: CPU per stream (``/proc/PID/stat`` user +
system over the run, / streams; the events' share is in it, the same for
every target), streams per second, first event p50 / p99 (request written →
first event read). Round 0 warms up; medians over the rounds, and each
round's ratio to nginx's in the same round.

Usage: ``python bench/stream_cost.py [--rounds 5] [--streams 2000] [--events 5]
[--concurrency 50] [--base DIR]``; writes ``bench/results/stream_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sidecar_bench

from sidecar_bench import NGINX_KEEPALIVE_FLAGS, RESULTS, STAMP_FLAGS, client, side_by_side

from testbed.targets import cpu_seconds


def stream_cost(rounds: int, streams: int, events: int, concurrency: int,
                base_code: str | None = None) -> dict[str, Any]:
    """The rounds (module docstring); per target its rows and medians."""
    flags = STAMP_FLAGS + NGINX_KEEPALIVE_FLAGS
    with side_by_side(base_code, direct=True, flags=flags) as (upstream_port, targets):
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for round_index in range(rounds + 1):  # round 0 warms up
            for name, (port, pid) in targets.items():
                before = cpu_seconds(pid) if pid is not None else 0.0
                result = client("throughput", port, upstream_port, "--streams", str(streams),
                                "--events", str(events), "--interval-ms", "1",
                                "--at-most", str(concurrency))
                used_s = cpu_seconds(pid) - before if pid is not None else None
                row = {"complete": result["complete"], "exact_text": result["exact_text"],
                       "streams_per_s": round(result["complete"] / result["wall_s"], 1),
                       "cpu_ms_per_stream": (round(used_s / streams * 1e3, 4)
                                             if used_s is not None else None),
                       "first_event": result["first_event"]}
                print(f"[round {round_index}] {name}: {json.dumps(row)}", flush=True)
                if round_index:
                    rows[name].append(row)

    def per_round_ratio(name: str, key: str, sub: str | None = None) -> float | None:
        if "nginx" not in rows or name == "nginx":
            return None
        ratios = []
        for mine, theirs in zip(rows[name], rows["nginx"], strict=True):
            a, b = (mine[key], theirs[key]) if sub is None else (mine[key][sub], theirs[key][sub])
            if a is None or not b:
                return None
            ratios.append(a / b)
        return round(statistics.median(ratios), 3)

    medians = {}
    for name, runs in rows.items():
        cpu = [r["cpu_ms_per_stream"] for r in runs if r["cpu_ms_per_stream"] is not None]
        medians[name] = {
            "cpu_ms_per_stream": round(statistics.median(cpu), 4) if cpu else None,
            "streams_per_s": statistics.median(r["streams_per_s"] for r in runs),
            "first_event_p50_ms": statistics.median(r["first_event"]["p50_ms"] for r in runs),
            "first_event_p99_ms": statistics.median(r["first_event"]["p99_ms"] for r in runs),
            "cpu_vs_nginx": per_round_ratio(name, "cpu_ms_per_stream"),
            "first_event_p50_vs_nginx": per_round_ratio(name, "first_event", "p50_ms"),
            "all_exact": all(r["exact_text"] == streams for r in runs),
        }
    return {"streams": streams, "events": events, "concurrency": concurrency, "rounds": rows,
            "load_average_after": list(os.getloadavg()), "medians": medians}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="also run the tokenwire package in DIR/tokenwire as base")
    args = parser.parse_args()
    result = stream_cost(args.rounds, args.streams, args.events, args.concurrency, args.base)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stream_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["medians"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
