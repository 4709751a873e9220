"""The sidecar's and the engine's time to first token, request by request, through ``tokenwire up``.

Method (figures in docs/perf/telemetry.md):

* ``tokenwire up --verbose`` (engine on a Unix socket, sidecar in front, as a
  user runs it) with a quickly trained tiny model built into a temp cache;
  ``--verbose`` echoes both children's JSON log lines, which is where the
  figures come from: the sidecar's ``stream ended`` line (``ttft_s``: its
  request start to the first token written to the client) and the engine's
  ``request finished`` line (``ttft_s``: arrival to the first token handed to
  the response), matched by the id the sidecar sent the engine.
* One warm-up request, then ``--requests`` streamed chat completions (8 tokens),
  one after the other, ``--rounds`` times; per round the median, min and max
  of sidecar minus engine.

Usage: ``python bench/ttft_bench.py [--requests N] [--rounds R]``; writes
``bench/results/ttft.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed.targets import child_lines, tiny_model, tokenwire_up

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def child_records(text: str, child: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in child_lines(text, child) if line.startswith("{")]


def one_round(model_dir: Path, cache_dir: Path, requests: int, work: Path) -> dict[str, Any]:
    log_path = work / "up.log"
    with tokenwire_up(model_dir, cache_dir, log_path) as up, httpx.Client(timeout=60) as client:
        for i in range(requests + 1):
            body = {"stream": True, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Tell me about the sea, {i}"}]}
            with client.stream("POST", f"http://127.0.0.1:{up.port}/v1/chat/completions", json=body,
                               headers={"X-Request-Id": f"ttft-{i}"}) as response:
                for _ in response.iter_lines():
                    pass
    text = log_path.read_text()
    streams = {r["request_id"]: r for r in child_records(text, "sidecar") if r["msg"] == "stream ended"}
    finished = {r["request_id"]: r for r in child_records(text, "engine") if r["msg"] == "request finished"}
    pairs = []
    for i in range(1, requests + 1):
        stream = streams[f"ttft-{i}"]
        engine = finished[stream.get("upstream_request_id", stream["request_id"])]
        pairs.append((stream["ttft_s"], engine["ttft_s"]))
    differences_ms = [(s - e) * 1e3 for s, e in pairs]
    return {"sidecar_ttft_ms_median": round(statistics.median(s for s, _ in pairs) * 1e3, 2),
            "engine_ttft_ms_median": round(statistics.median(e for _, e in pairs) * 1e3, 2),
            "difference_ms": {"median": round(statistics.median(differences_ms), 2),
                              "min": round(min(differences_ms), 2), "max": round(max(differences_ms), 2)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp) / "cache"
        cache_dir.mkdir()
        model_dir = tiny_model(cache_dir)
        rounds = []
        for index in range(args.rounds):
            result = one_round(model_dir, cache_dir, args.requests, Path(tmp))
            print(f"[round {index}] {json.dumps(result)}", flush=True)
            rounds.append(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {"requests": args.requests, "rounds": rounds}
    (RESULTS / "ttft.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
