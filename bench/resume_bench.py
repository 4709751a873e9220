"""Resume benchmark: replay throughput and memory per stored event, memory and Redis stores.

Method (figures in docs/perf/resume.md):

* One fake upstream process (``sse_load.py upstream``: OpenAI chunks, here
  ~250 B each, all at once) and two sidecars started with ``--resume``, one
  per store: ``memory`` and ``redis://`` (a ``redis-server`` this script
  starts on a free port, ``--save "" --appendonly no``). Same run, same
  machine, so the two are compared side by side.
* ``store``: each sidecar generates ``--streams`` answers of ``--events``
  events through a POST read to the end (the ids checked contiguous). The
  memory per stored event is the sidecar's RSS growth (memory store) or Redis
  ``INFO memory`` ``used_memory`` growth (Redis store) over all stored events.
* ``replay``: a reconnecting reader (``GET /v1/streams/{stream}`` with
  ``Last-Event-ID: <stream>.1``) reads the rest of one stored answer as fast
  as it can, on a raw socket; one warm-up, then ``--replays`` rounds
  alternating the stores. Events/s and MB/s (SSE bytes after de-chunking,
  ids included) from sending the request to the chunked terminator; median
  and p99 (nearest rank; with few rounds p99 is the slowest). The first
  replay of each store is checked: ids contiguous, payloads equal to the
  original answer's.
* ``tracemalloc``: the same kind of answer (vLLM-shaped chunks from
  ``core_bench.py``) driven through a resumable ``WireStream`` into a
  ``MemoryReplayStore`` in this process; traced bytes per stored event,
  minus the frame's own bytes, against ``FRAME_OVERHEAD_BYTES``, the per-frame
  overhead the store counts against ``resume_total_bytes``.

Usage: ``python bench/resume_bench.py [--quick]``; writes ``bench/results/resume.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from core_bench import SSE_HEADERS, make_stream
from sse_load import chunk_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/

from tokenwire.middleware import (
    ReplayAppend,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
)
from tokenwire.middleware.shared.replay_store import FRAME_OVERHEAD_BYTES, MemoryReplayStore

from testbed.targets import RunningSidecar, fake_upstream, free_port, process, rss_kib, sidecar, wait_port
from tokenwire.tools.sse_client import parse_response

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CHUNK_BYTES = 250
# Far above the 1.4 MB answers measured here (the default is 8 MiB), so no
# replay is ever cut short by the per-stream cap. The first run of this bench
# found the old 1 MiB default stopping such an answer at ~4,000 events.
MAX_STREAM_BYTES = 64 << 20
_ID_RE = re.compile(rb"\nid: ([A-Za-z0-9_-]+)\.(\d+)\n")


# ---------------------------------------------------------------- processes


@contextlib.contextmanager
def redis_server() -> Iterator[int]:
    """A throw-away ``redis-server`` on a free port (no persistence): its port."""
    binary = shutil.which("redis-server") or "/usr/sbin/redis-server"
    if not Path(binary).exists():
        subprocess.run([str(ROOT / "scripts" / "system-deps.sh"), "redis-server"], check=True)
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    directory = tempfile.mkdtemp(prefix="tokenwire-redis-")
    with process([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--dir", directory, "--loglevel", "warning"],
                 "redis-server", ready_line=False):
        wait_port(port)
        yield port
    shutil.rmtree(directory, ignore_errors=True)


def resumable_sidecar(upstream_port: int, store: str) -> contextlib.AbstractContextManager[RunningSidecar]:
    return sidecar(free_port(), upstream_port, what=f"sidecar ({store})", flags=(
        "--resume", "--resume-store", store, "--resume-max-bytes", str(MAX_STREAM_BYTES),
        "--resume-ttl-s", "3600", "--resume-owner-secret", "bench"))


# ---------------------------------------------------------------- client


def fetch(port: int, request: bytes, timeout_s: float = 60.0) -> tuple[dict[str, str], bytes, float, float]:
    """One request on a fresh connection, body read to its chunked terminator as
    fast as the socket gives it: (headers, SSE body, seconds to first byte, seconds in all)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        buffer = bytearray()
        started = time.perf_counter()
        sock.sendall(request)
        first = 0.0
        while not buffer.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 20)
            if not data:
                raise RuntimeError(f"connection closed after {len(buffer)} bytes: {bytes(buffer[:300])!r}")
            if not first:
                first = time.perf_counter() - started
            buffer += data
        elapsed = time.perf_counter() - started
    response = parse_response(bytes(buffer))  # (checked outside the timed part)
    if response.status != 200 or not response.clean_end:
        raise RuntimeError(f"unexpected response: {response.status} {response.error}")
    return response.headers, response.body, first, elapsed


def post_request(request_id: str, events: int) -> bytes:
    body = json.dumps({"model": "bench", "stream": True, "id": request_id, "events": events,
                       "interval_ms": 0}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def resume_request(stream_id: str, after_seq: int) -> bytes:
    return (b"GET /v1/streams/%s HTTP/1.1\r\nhost: bench\r\naccept: text/event-stream\r\n"
            b"last-event-id: %s.%d\r\n\r\n" % (stream_id.encode(), stream_id.encode(), after_seq))


def events_of(body: bytes) -> list[tuple[bytes, int]]:
    """(stream id, seq) of every event of an SSE body."""
    return [(stream, int(seq)) for stream, seq in _ID_RE.findall(body)]


def payloads(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


def padded_request_id(index: int) -> str:
    """A request id long enough that the upstream's chunks are ~CHUNK_BYTES each
    (its chunk carries the id and a 19-digit send time)."""
    sample = len(chunk_bytes("", 2500))
    prefix = f"chatcmpl-{index:04d}-"
    return prefix + "x" * max(CHUNK_BYTES - sample - len(prefix), 0)


# ---------------------------------------------------------------- scenarios


def redis_used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def wait_stored(client: Any, stream_id: str, events: int, timeout_s: float = 30.0) -> None:
    """The Redis store writes behind: wait until every event and the end are in Redis."""
    deadline = time.monotonic() + timeout_s
    key = "tw:{" + stream_id + "}"
    while time.monotonic() < deadline:
        if client.xlen(key + ":e") >= events and client.hget(key + ":m", "end"):
            return
        time.sleep(0.01)
    raise RuntimeError(f"stream {stream_id} not fully in Redis after {timeout_s} s")


def store_answers(port: int, streams: int, events: int, measure: Callable[[], int],
                  redis_client: Any = None) -> dict[str, Any]:
    """Generate ``streams`` answers through a sidecar; memory growth per stored event."""
    gc_settle = 0.3  # let the sidecar finish its records and free per-stream buffers
    time.sleep(gc_settle)
    before = measure()
    stream_ids: list[str] = []
    frame_bytes = 0
    stored_events = 0
    for index in range(streams):
        headers, body, _, _ = fetch(port, post_request(padded_request_id(index), events))
        stream_id = headers["x-tokenwire-stream-id"]
        ids = events_of(body)
        expected = [(stream_id.encode(), seq) for seq in range(1, events + 2)]  # + [DONE]
        if ids != expected:
            raise RuntimeError(f"stream {stream_id}: ids not contiguous ({len(ids)} events)")
        if redis_client is not None:
            wait_stored(redis_client, stream_id, len(ids))
        stream_ids.append(stream_id)
        stored_events += len(ids)
        # What the store keeps per event: the event as the upstream framed it, without its id.
        frame_bytes += sum(len(data) + 2 for data in payloads(body))
    time.sleep(gc_settle)
    after = measure()
    return {"streams": streams, "events_stored": stored_events,
            "frame_bytes_mean": round(frame_bytes / stored_events, 1),
            "growth_bytes": after - before,
            "bytes_per_event": round((after - before) / stored_events, 1),
            "overhead_per_event": round((after - before - frame_bytes) / stored_events, 1),
            "stream_ids": stream_ids}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def replay_rounds(targets: dict[str, tuple[int, str, bytes]], replays: int) -> dict[str, Any]:
    """Alternate the stores round by round, so drift on a shared box hits both alike."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    for round_index in range(replays + 1):  # round 0 warms up (and is checked)
        for name, (port, stream_id, original) in targets.items():
            _, body, first_s, elapsed_s = fetch(port, resume_request(stream_id, 1))
            events = body.count(b"\nid: ")
            if round_index == 0:
                seqs = [seq for _, seq in events_of(body)]
                if seqs != list(range(2, len(payloads(original)) + 1)):
                    raise RuntimeError(f"{name}: replay ids not contiguous from 2")
                if payloads(body) != payloads(original)[1:]:
                    raise RuntimeError(f"{name}: replayed payloads differ from the answer")
                continue
            runs[name].append({"seconds": elapsed_s, "ttfb_ms": first_s * 1e3, "events": events,
                               "bytes": len(body)})
            print(f"[replay {round_index}] {name}: {events} events in {elapsed_s * 1e3:.1f} ms "
                  f"({events / elapsed_s:,.0f}/s)", flush=True)
    summary: dict[str, Any] = {}
    for name, rows in runs.items():
        answer_events, sse_bytes = rows[0]["events"], rows[0]["bytes"]
        # Every round replays the same answer: throughput is that size over the
        # median (or p99, the slow tail) replay time.
        median_s = statistics.median(r["seconds"] for r in rows)
        p99_s = percentile([r["seconds"] for r in rows], 0.99)
        summary[name] = {
            "events": answer_events, "sse_bytes": sse_bytes, "rounds": len(rows),
            "replay_ms": {"median": round(median_s * 1e3, 1), "p99": round(p99_s * 1e3, 1)},
            "events_per_s": {"median": round(answer_events / median_s), "p99": round(answer_events / p99_s)},
            "mb_per_s": {"median": round(sse_bytes / median_s / 1e6, 1),
                         "p99": round(sse_bytes / p99_s / 1e6, 1)},
            "ttfb_ms": {"median": round(statistics.median(r["ttfb_ms"] for r in rows), 2),
                        "p99": round(percentile([r["ttfb_ms"] for r in rows], 0.99), 2)},
        }
    return summary


def allocated_bytes(frame_length: int) -> int:
    """What one stored frame really takes: its bytes object as the allocator rounds
    it (pymalloc: 16-byte multiples up to 512 B; malloc adds a header above) plus
    its list slot. tracemalloc counts only the bytes asked for."""
    asked = sys.getsizeof(b"") + frame_length
    return 8 + (-(-asked // 16) * 16 if asked <= 512 else asked + 16)


def tracemalloc_cost(streams: int, events: int) -> dict[str, Any]:
    """Traced bytes a MemoryReplayStore holds per stored event, fed by the real wire core."""
    rng = random.Random(7)
    bodies = [make_stream(rng, events)[0] for _ in range(streams)]
    config = WireConfig(resume=True, resume_max_bytes=MAX_STREAM_BYTES)

    # Running sums, not a list: a list of lengths would be traced too (36 B per event).
    sums = {"frame_bytes": 0, "allocated": 0}

    async def fill(store: MemoryReplayStore) -> int:
        appended = 0
        for index, reads in enumerate(bodies):
            stream_id = f"bench{index}"
            await store.open(stream_id)
            stream = WireStream(config, now=0.0, request_id=stream_id, stream_id=stream_id)

            def handle(event: Any, now: float, stream: WireStream = stream) -> None:
                nonlocal appended
                for action in stream.handle(event, now):
                    if isinstance(action, ReplayAppend):
                        store.append(action)
                        appended += len(action.frames)
                        for frame in action.frames:
                            sums["frame_bytes"] += len(frame)
                            sums["allocated"] += allocated_bytes(len(frame))

            now = 0.0
            handle(UpstreamHeaders(200, SSE_HEADERS), now)
            for read in reads:
                now += 0.0001
                handle(UpstreamData(read), now)
                if stream.data_to_send(now):
                    handle(WriteCompleted(), now)
            handle(UpstreamEnded(), now)
            while not stream.finished:
                if stream.data_to_send(now):
                    handle(WriteCompleted(), now)
                else:
                    handle(Tick(), now)
        return appended

    store = MemoryReplayStore(ttl_s=3600.0, total_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    stored = asyncio.run(fill(store))
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_event = (after - before) / stored
    frame_bytes, allocated = sums["frame_bytes"], sums["allocated"]
    return {"streams": streams, "events_stored": stored,
            "frame_bytes_mean": round(frame_bytes / stored, 1),
            "traced_bytes_per_event": round(per_event, 1),
            "measured_overhead_per_event": round(per_event - frame_bytes / stored, 1),
            "with_allocator_rounding_overhead_per_event": round(allocated / stored - frame_bytes / stored, 1),
            "store_accounted_per_event": round(store.stored_bytes / stored, 1),
            "frame_overhead_bytes_constant": FRAME_OVERHEAD_BYTES}


def run(streams: int, events: int, replays: int) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": {"cores": os.cpu_count(), "python": sys.version.split()[0],
                                           "hiredis": redis.utils.HIREDIS_AVAILABLE},
                               "events_per_answer": events, "streams_stored": streams}
    print("[tracemalloc] memory store fed by the wire core", flush=True)
    results["tracemalloc_memory_store"] = tracemalloc_cost(streams, events)
    upstream_port = free_port()
    with redis_server() as redis_port, \
            fake_upstream(upstream_port), \
            resumable_sidecar(upstream_port, "memory") as on_memory, \
            resumable_sidecar(upstream_port, f"redis://127.0.0.1:{redis_port}/0") as on_redis_sidecar:
        memory_port, memory_proc, redis_sidecar = on_memory.port, on_memory.process, on_redis_sidecar.port
        client = redis.Redis(port=redis_port)
        # Both sidecars warm (imports, first connections, a first stored answer) before measuring.
        for port in (memory_port, redis_sidecar):
            fetch(port, post_request(padded_request_id(9999), 200))
        print(f"[store] memory: {streams} x {events} events", flush=True)
        memory = store_answers(memory_port, streams, events, lambda: rss_kib(memory_proc.pid) * 1024)
        print(f"[store] redis: {streams} x {events} events", flush=True)
        on_redis = store_answers(redis_sidecar, streams, events, lambda: redis_used_memory(client),
                                 redis_client=client)
        results["store"] = {"memory_sidecar_rss": memory, "redis_used_memory": on_redis}
        # One answer per store, replayed again and again (its payloads from a fresh replay from 0).
        targets: dict[str, tuple[int, str, bytes]] = {}
        for name, port, stored in (("memory", memory_port, memory), ("redis", redis_sidecar, on_redis)):
            stream_id = stored["stream_ids"][0]
            _, original, _, _ = fetch(port, resume_request(stream_id, 0))
            targets[name] = (port, stream_id, original)
        results["replay"] = replay_rounds(targets, replays)
        client.close()
    for stored in results["store"].values():
        del stored["stream_ids"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000, help="events per stored answer")
    parser.add_argument("--streams", type=int, default=10, help="answers stored per store")
    parser.add_argument("--replays", type=int, default=15, help="timed replays per store")
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.events, args.streams, args.replays = 1000, 2, 3
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run(args.streams, args.events, args.replays)
    results["quick"] = args.quick
    (RESULTS / "resume.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
