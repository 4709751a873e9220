"""What metrics and logs cost the sidecar: CPU per event with them on and off, side by side.

Method (figures in docs/perf/telemetry.md):

* One fake upstream process (``sse_load.py upstream``: paced OpenAI chunks)
  and three sidecars in front of it, started once and measured in turns,
  round after round (round 0 warms up and is not counted):

  - ``off``: ``--log-file ''`` and ``--log-level warning``: no stream line, no
    lifecycle line, and nobody scrapes ``/metrics``;
  - ``on``: ``--log-level info`` with every stream's line written to a file
    (JSON), and ``/metrics`` scraped every second while the load runs (a
    Prometheus scrapes every 15 s or so: this is the costly end);
  - ``debug``: as ``on``, with ``--log-level debug`` (each stream's lifecycle
    lines too).

* ``micro``, in this process, the pieces timed alone (medians of repeats):
  one stream's log line (JSON, to a file), one scrape of ``/metrics`` with 40
  open streams and 100 finished ones, and the core's token meter per write.
  With the events per stream of the load run, they say what the whole-process
  figures above cannot resolve (run-to-run noise there is several percent).

* Each turn is one ``sse_load.py client throughput`` run (S streams x E events
  every I ms); CPU is the sidecar process's user + system time
  (``/proc/PID/stat``) over the run, divided by the tokens the client got
  (exact text checked). The cost of telemetry is ``on`` minus ``off``, as a
  share of ``off``.

Usage: ``python bench/telemetry_bench.py [--rounds N] [--streams S] [--events E] [--interval-ms I]``;
writes ``bench/results/telemetry.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidecar_bench import RESULTS, client

from testbed.targets import RunningSidecar, cpu_seconds, fake_upstream, free_port, sidecar

MODES = ("off", "on", "debug")


def telemetry_sidecar(mode: str, upstream_port: int,
                      log_dir: Path) -> contextlib.AbstractContextManager[RunningSidecar]:
    """A sidecar with ``mode``'s telemetry (its admin port serves ``/metrics``)."""
    logs = (["--log-file", "", "--log-level", "warning"] if mode == "off"
            else ["--log-file", str(log_dir / f"{mode}.jsonl"), "--log-level",
                  "debug" if mode == "debug" else "info"])
    return sidecar(free_port(), upstream_port, flags=logs, what=f"sidecar ({mode})")


@contextlib.contextmanager
def scraping(admin_port: int, every_s: float) -> Iterator[list[int]]:
    """Scrape ``/metrics`` every ``every_s`` until the block ends; yields the sizes scraped."""
    stop = threading.Event()
    sizes: list[int] = []

    def scrape() -> None:
        while not stop.wait(every_s):
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=10) as answer:
                sizes.append(len(answer.read()))

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield sizes
    finally:
        stop.set()
        thread.join(15)


def run(rounds: int, streams: int, events: int, interval_ms: float) -> dict[str, Any]:
    upstream_port = free_port()
    rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp, \
            fake_upstream(upstream_port), \
            contextlib.ExitStack() as stack:
        started = {mode: stack.enter_context(telemetry_sidecar(mode, upstream_port, Path(tmp)))
                   for mode in MODES}
        targets = {mode: (side.port, side.admin_port, side.pid) for mode, side in started.items()}
        for round_index in range(rounds + 1):
            for mode, (port, admin_port, pid) in targets.items():
                with contextlib.ExitStack() as scrape:
                    scraped = scrape.enter_context(scraping(admin_port, 1.0)) if mode != "off" else []
                    before = cpu_seconds(pid)
                    result = client("throughput", port, upstream_port, "--streams", str(streams),
                                    "--events", str(events), "--interval-ms", str(interval_ms))
                    used_s = cpu_seconds(pid) - before
                tokens = max(result["delivered_tokens"], 1)
                row = {"us_per_event": round(used_s / tokens * 1e6, 2), "cpu_s": round(used_s, 3),
                       "tokens": result["delivered_tokens"], "exact_text": result["exact_text"],
                       "scrapes": len(scraped)}
                print(f"[round {round_index}] {mode}: {json.dumps(row)}", flush=True)
                if round_index:
                    rows[mode].append(row)
        log_lines = {mode: sum(1 for _ in (Path(tmp) / f"{mode}.jsonl").open())
                     for mode in MODES if mode != "off"}
    medians = {mode: statistics.median(r["us_per_event"] for r in runs) for mode, runs in rows.items()}
    off = medians["off"]
    return {"streams": streams, "events": events, "interval_ms": interval_ms, "rounds": rows,
            "log_lines": log_lines, "median_us_per_event": medians,
            "cost_vs_off": {mode: round((medians[mode] - off) / off, 4) for mode in MODES if mode != "off"}}


def micro(events_per_stream: int, streams: int) -> dict[str, float]:
    """Per-call costs of the telemetry pieces, timed alone (µs)."""
    import logging
    import timeit

    from tokenwire.middleware import (
        Finished,
        StreamRecord,
        UpstreamData,
        UpstreamEnded,
        UpstreamHeaders,
        WireStream,
        WriteCompleted,
    )
    from tokenwire.middleware.core.chunks import carries_token
    from tokenwire.middleware.core.meter import TokenMeter
    from tokenwire.sidecar.logs import StreamLog
    from tokenwire.sidecar.process.metrics import SidecarMetrics
    from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

    chunk = (b'data: {"id":"c","object":"chat.completion.chunk",'
             b'"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n')

    def finished_record() -> StreamRecord:
        stream = WireStream(SIDECAR_WIRE_DEFAULTS, now=0.0, request_id="r", upstreams=("http://u",))
        actions = stream.handle(UpstreamHeaders(200, ((b"content-type", b"text/event-stream"),)), 0.0)
        for i in range(events_per_stream):
            actions += stream.handle(UpstreamData(chunk), i * 0.005)
            while stream.data_to_send(i * 0.005):
                actions += stream.handle(WriteCompleted(), i * 0.005)
        actions += stream.handle(UpstreamData(b"data: [DONE]\n\n"), 9.0)
        while stream.data_to_send(9.0):
            actions += stream.handle(WriteCompleted(), 9.0)
        actions += stream.handle(UpstreamEnded(), 9.0)
        (done,) = [a for a in actions if isinstance(a, Finished)]
        return done.record

    record = finished_record()
    with tempfile.TemporaryDirectory() as tmp:
        log = StreamLog.open(str(Path(tmp) / "streams.jsonl"))
        logging.getLogger().setLevel(logging.INFO)
        line_us = min(timeit.repeat(lambda: log.write(record, method="POST", path="/v1/chat/completions",
                                                      client="127.0.0.1"), number=200, repeat=5)) / 200 * 1e6
        log.close()
    live = [(record, "1.1")] * streams
    metrics = SidecarMetrics(live=lambda: live)
    for _ in range(100):
        metrics.observe_record(record)
    scrape_us = min(timeit.repeat(metrics.render, number=20, repeat=5)) / 20 * 1e6

    def meter_writes() -> None:
        meter = TokenMeter(0.0, carries_token)
        meter.queued(chunk)
        for i in range(1000):
            meter.wrote(1, i * 0.005)

    meter_us = min(timeit.repeat(meter_writes, number=20, repeat=5)) / 20 / 1000 * 1e6
    return {"log_line_us": round(line_us, 1), "scrape_us": round(scrape_us, 1),
            "meter_per_write_us": round(meter_us, 3),
            "log_line_per_event_us": round(line_us / events_per_stream, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--micro-only", action="store_true", help="only the in-process timings")
    args = parser.parse_args()
    if args.micro_only:
        print(json.dumps(micro(args.events, args.streams)))
        return 0
    results = run(args.rounds, args.streams, args.events, args.interval_ms)
    results["micro"] = micro(args.events, args.streams)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "telemetry.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"median_us_per_event": results["median_us_per_event"],
                      "cost_vs_off": results["cost_vs_off"], "micro": results["micro"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
