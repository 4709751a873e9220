"""Micro-benchmark of the sans-IO wire core: events/s on one core.

Pipeline measured, per upstream event: ``SSEParser.feed`` (bytes as they come
off the upstream socket, a few events per read) -> ``WireStream.handle`` ->
``encode`` / ``PendingBuffer`` -> ``data_to_send`` -> ``WriteCompleted``.
Events are realistic OpenAI chat chunks as vLLM sends them (~150-250 bytes,
1-4 tokens of text each).

Two regimes:

* ``keeps_up``: the socket is always writable; after every upstream read the
  driver writes what the core hands it (one write per read of a few events).
* ``paused``: the socket is paused for most of the stream, so events queue in
  the pending buffer and merge (coalescing); it resumes every 64 reads.

Method: ``--streams`` streams of ``--events`` chunks each are pre-encoded and
split into reads of 1-4 events (fixed seed); each run times, with
``time.perf_counter``, the whole pipeline over all streams on one thread. The
median of ``--runs`` runs is reported (after one warm-up run) and written to
``bench/results/core.json``.

Run: ``python bench/core_bench.py [--runs 7 --streams 200 --events 500]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from tokenwire.middleware import (
    SocketPaused,
    SocketResumed,
    SSEParser,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
)

TARGET_EVENTS_PER_S = 150_000
WORDS = ("the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", ",", " and", " é",
         " naïve", " \"quoted\"", " 数据", "\n", " tokens", " stream", " wire")
SSE_HEADERS = ((b"content-type", b"text/event-stream"),)


def chunk_json(index: int, text: str | None, *, role: bool = False, finish: bool = False) -> str:
    """One chat.completion.chunk shaped like vLLM's (pydantic model_dump_json)."""
    delta: dict[str, object] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif text is not None:
        delta = {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": None,
              "finish_reason": "stop" if finish else None, "stop_reason": None}
    chunk = {"id": "chatcmpl-9f1c2a7e4b0d4e4f8a1b2c3d4e5f6a7b", "object": "chat.completion.chunk",
             "created": 1733000000 + index // 50, "model": "meta-llama/Llama-3.1-8B-Instruct",
             "choices": [choice]}
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def make_stream(rng: random.Random, events: int) -> tuple[list[bytes], int]:
    """The upstream body of one stream, split into reads of 1-4 events."""
    payloads = [chunk_json(0, None, role=True)]
    for i in range(1, events - 1):
        payloads.append(chunk_json(i, "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))))
    payloads.append(chunk_json(events, None, finish=True))
    payloads.append("[DONE]")
    encoded = [b"data: " + p.encode() + b"\n\n" for p in payloads]
    reads: list[bytes] = []
    i = 0
    while i < len(encoded):
        n = rng.randint(1, 4)
        reads.append(b"".join(encoded[i:i + n]))
        i += n
    return reads, len(encoded)


def run_stream(reads: list[bytes], config: WireConfig, *, paused: bool, via_events: bool) -> int:
    """Drive one stream through the core; return bytes written."""
    now = 0.0
    stream = WireStream(config, now=now, request_id="bench")
    handle = stream.handle
    data_to_send = stream.data_to_send
    written = 0
    handle(UpstreamHeaders(200, SSE_HEADERS), now)
    parser = SSEParser() if via_events else None
    if paused:
        handle(SocketPaused(), now)
    for n, read in enumerate(reads, 1):
        now += 0.0001
        if parser is not None:
            for event in parser.feed(read):
                handle(UpstreamEvent(event), now)
        else:
            handle(UpstreamData(read), now)
        if paused and n % 64 == 0:
            handle(SocketResumed(), now)
        data = data_to_send(now)
        if data:
            written += len(data)
            handle(WriteCompleted(), now)
            if paused:
                handle(SocketPaused(), now)
    if parser is not None:
        parser.close()
    handle(SocketResumed(), now)
    handle(UpstreamEnded(), now)
    while not stream.finished:
        data = data_to_send(now)
        if data:
            written += len(data)
            handle(WriteCompleted(), now)
        else:
            handle(Tick(), now)
    return written


def measure(streams: list[list[bytes]], events: int, config: WireConfig, *, paused: bool,
            via_events: bool, runs: int) -> dict[str, object]:
    rates: list[float] = []
    cpu_rates: list[float] = []
    for run in range(runs + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        for reads in streams:
            run_stream(reads, config, paused=paused, via_events=via_events)
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        if run:  # the first run warms up
            rates.append(events / elapsed)
            cpu_rates.append(events / cpu_s)
    # Wall clock is the headline; per CPU second shows how much of the gap is
    # other processes taking the core on this shared machine.
    return {"median_events_per_s": round(statistics.median(rates)),
            "min_events_per_s": round(min(rates)), "max_events_per_s": round(max(rates)),
            "median_events_per_cpu_s": round(statistics.median(cpu_rates)),
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--events", type=int, default=500, help="chunks per stream")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "core.json")
    args = parser.parse_args(argv)
    rng = random.Random(20261129)
    streams: list[list[bytes]] = []
    total_events = 0
    total_bytes = 0
    for _ in range(args.streams):
        reads, count = make_stream(rng, args.events)
        streams.append(reads)
        total_events += count
        total_bytes += sum(len(r) for r in reads)
    config = WireConfig(terminal_marker="[DONE]")  # the sidecar's, without retries
    results: dict[str, object] = {}
    for name, paused in (("keeps_up", False), ("paused", True)):
        for feed_name, via_events in (("upstream_data", False), ("parser_then_events", True)):
            key = f"{name}/{feed_name}"
            results[key] = measure(streams, total_events, config, paused=paused,
                                   via_events=via_events, runs=args.runs)
            print(f"{key:34} {results[key]['median_events_per_s']:>10,} events/s, "
                  f"{results[key]['median_events_per_cpu_s']:>10,} per CPU s (median of {args.runs})",
                  flush=True)
    worst = min(int(r["median_events_per_s"]) for r in results.values())  # type: ignore[call-overload]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "benchmark": "wire core: SSEParser + WireStream + encoder, one thread",
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "meets_target": worst >= TARGET_EVENTS_PER_S,
        "streams": args.streams,
        "events_per_stream": args.events + 1,
        "total_events": total_events,
        "mean_event_bytes": round(total_bytes / total_events, 1),
        "results": results,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"worst median {worst:,} events/s; target {TARGET_EVENTS_PER_S:,}: "
          f"{'met' if report['meets_target'] else 'NOT met'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
