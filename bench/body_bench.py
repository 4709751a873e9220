"""Many large uploads at once: a bystander stream's longest gap and the sidecar's RSS.

Method (figures in docs/perf/uploads.md):

* One upstream process (below: bare asyncio) counts and discards request
  bodies and answers ``{}``; ``/stream`` answers a paced event stream (an
  event every 10 ms).
* The sidecar runs as its own process (``tokenwire sidecar``), once with the
  default ``max_buffered_body_bytes`` (64 MiB) and once with the cap out of
  the way (4 GiB: every body is buffered, as before the cap), in alternating
  rounds of the same run.
* Per round: a bystander reads one stream; 32 clients each POST 15 MiB at
  once (no ``Expect``: the body follows the head at once, as the review's
  clients did); the bystander's longest gap between reads is its stall; the
  sidecar's peak RSS is sampled every 20 ms from ``/proc``.

Usage: ``python bench/body_bench.py [--rounds N]``; writes ``bench/results/bodies.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidecar_bench import RESULTS

from testbed.targets import PY, free_port, process, rss_kib, sidecar

UPLOADS = 32
UPLOAD_BYTES = 15 << 20
CAPS = {"cap 64 MiB (default)": 64 << 20, "no cap (4 GiB)": 4 << 30}


# ---------------------------------------------------------------- upstream


class _Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.body_left = -1
        self.path = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        while data:
            if self.body_left < 0:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, data = bytes(self.head[:end]), bytes(self.head[end + 4:])
                self.head.clear()
                lines = head.decode("latin-1").split("\r\n")
                self.path = lines[0].split(" ")[1]
                length = [int(line.split(":")[1]) for line in lines[1:]
                          if line.lower().startswith("content-length:")]
                self.body_left = length[0] if length else 0
            taken = min(self.body_left, len(data))
            self.body_left -= taken
            data = data[taken:]
            if self.body_left == 0:
                self.body_left = -1
                self._answer()

    def _answer(self) -> None:
        assert self.transport is not None
        if self.path.startswith("/stream"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
            asyncio.get_running_loop().create_task(self._paced())
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 2\r\n\r\n{}")

    async def _paced(self) -> None:
        assert self.transport is not None
        for i in itertools.count():
            if self.transport.is_closing():
                return
            event = b'data: {"i":%d}\n\n' % i
            self.transport.write(b"%x\r\n%b\r\n" % (len(event), event))
            await asyncio.sleep(0.01)


def run_upstream(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", port)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------- one round


def _bystander(port: int, arrivals: list[float], stop: threading.Event) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        sock.settimeout(0.5)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                data = sock.recv(65536)
                if not data:
                    return
                if b"data: " in data:
                    arrivals.append(time.monotonic())


def _upload(port: int, statuses: list[str]) -> None:
    body = b"u" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % UPLOAD_BYTES)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for _ in range(UPLOAD_BYTES >> 20):
                    sock.sendall(body)
            answer = sock.recv(64)
            statuses.append(answer.split(b" ", 2)[1].decode() if answer else "closed")
    except (ConnectionResetError, BrokenPipeError):
        statuses.append("reset")


def one_round(cap_bytes: int, upstream_port: int) -> dict[str, Any]:
    port = free_port()
    with sidecar(port, upstream_port, admin=False, flags=(
            "--max-body-bytes", str(16 << 20), "--max-buffered-body-bytes", str(cap_bytes))) as proc:
        rss_before = rss_kib(proc.pid)
        peak = [rss_before]
        arrivals: list[float] = []
        stop = threading.Event()
        bystander = threading.Thread(target=_bystander, args=(port, arrivals, stop), daemon=True)
        bystander.start()
        while len(arrivals) < 20:
            time.sleep(0.01)

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_kib(proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        statuses: list[str] = []
        started = time.monotonic()
        uploads = [threading.Thread(target=_upload, args=(port, statuses)) for _ in range(UPLOADS)]
        for thread in uploads:
            thread.start()
        for thread in uploads:
            thread.join(300)
        ended = time.monotonic()
        time.sleep(0.2)
        stop.set()
        bystander.join(2)
        sampler.join(2)
    during = [b - a for a, b in itertools.pairwise(arrivals) if b >= started and a <= ended]
    return {"max_gap_s": max(during), "p99_gap_s": statistics.quantiles(during, n=100)[98],
            "upload_s": ended - started, "rss_before_mib": rss_before / 1024,
            "rss_peak_mib": peak[0] / 1024,
            "statuses": {s: statuses.count(s) for s in sorted(set(statuses))}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
        return
    upstream_port = free_port()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CAPS}
    with process([PY, __file__, "--upstream", str(upstream_port)], "upstream"):
        for _ in range(args.rounds):
            for name, cap in CAPS.items():
                result = one_round(cap, upstream_port)
                runs[name].append(result)
                print(name, json.dumps(result), flush=True)
    summary = {name: {"median_max_gap_s": statistics.median(r["max_gap_s"] for r in results),
                      "median_p99_gap_s": statistics.median(r["p99_gap_s"] for r in results),
                      "median_rss_peak_mib": statistics.median(r["rss_peak_mib"] for r in results),
                      "rounds": results}
               for name, results in runs.items()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bodies.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, figures in summary.items():
        print(f"{name}: max gap {figures['median_max_gap_s']:.3f} s, p99 gap "
              f"{figures['median_p99_gap_s']:.3f} s, peak RSS {figures['median_rss_peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
