"""HTTP/2 floods, frame by frame: tokenwire beside nginx (``http2``, TLS) and,
with ``--base DIR``, an older checkout, side by side in one run.

Method (the figures: bench/README.md, "HTTP/2 floods"):

* The targets of ``h2_bench.py --stuck`` (``h2_bench.rotation``): one fake
  upstream (``sse_load.py upstream``), the sidecar (TLS, ALPN h2, default
  flood limits: 100 resets/s, 500 SETTINGS/PING/PRIORITY/s, 2,000
  WINDOW_UPDATE/s), nginx 1.22 (``listen ... ssl http2``, one worker, its
  defaults) and ``base``; and tokenwire (and ``base``) again on plaintext
  (prior knowledge, ``tokenwire-h2c``), where one read of the sidecar's holds
  up to 256 KiB of flood where a TLS read holds some 16-64 KiB (nginx speaks
  HTTP/2 here only under TLS). The targets take turns round after round (the
  order alternating, round 0 a warm-up); each figure is the median over rounds.
* ``rapid_reset``: a bystander process (``h2_flood.py bystander``) streams one
  answer of 300 events every 10 ms on its own connection; after its 50th event
  a flood process (``h2_flood.py flood rapid-reset``) writes prebuilt
  HEADERS(END_STREAM)+RST_STREAM(CANCEL) pairs, 4,000 a write (220 KB, what
  one read of the sidecar's can hold), as fast as the socket takes them, until
  a GOAWAY or the close. Reported: the streams the
  target took before its GOAWAY (its last stream id + 1, halved), its code,
  the pairs written, the target's CPU over the flood, and the bystander's
  longest gap between events while the flood lasted and over its whole answer,
  beside ``quiet``: the same bystander with no flood.
* ``settings`` / ``ping``: 10,000 SETTINGS (or PING) frames in one write: the
  ACKs that came back, the GOAWAY code, the target's CPU.
* ``window_update``: 10,000 WINDOW_UPDATE frames (connection window, +1 each)
  in one write: the GOAWAY code, the target's CPU.

Usage: ``python bench/h2_flood.py [--rounds 3] [--base DIR]``; writes
``bench/results/h2_flood.json``. ``bystander`` and ``flood`` are its load
clients, each its own process so that neither is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from h2_bench import RESULTS, rotation
from h2_load import PREFACE, H2Conn, _tls, connect, frame
from sse_load import StreamResult

from testbed.targets import PY, cpu_seconds, free_port, sidecar

SELF = str(Path(__file__).resolve())
# POST /v1/chat/completions from HPACK's static table and literals without
# indexing: one block serves every stream of the flood, no encoder state.
BLOCK = b"\x83\x87\x04\x14/v1/chat/completions\x01\x05bench"
CANCEL = (8).to_bytes(4, "big")
CONTROL = {"settings": (0x4, b"\x00\x04\x00\x00\xff\xff"), "ping": (0x6, b"\x00" * 8),
           "window_update": (0x8, b"\x00\x00\x00\x01")}


class FloodConn(asyncio.Protocol):
    """The flooding connection: counts the ACKs it gets and keeps the GOAWAY."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.acks = {0x4: 0, 0x6: 0}
        self.goaway: tuple[int, int] | None = None
        self.ended_ns = 0
        self.closed = asyncio.get_running_loop().create_future()
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags, payload = buffer[3], buffer[4], buffer[9:9 + length]
            if kind in self.acks and flags & 0x1:
                self.acks[kind] += 1
            elif kind == 0x4 and self.transport is not None:
                self.transport.write(frame(0x4, 0x1, 0, b""))  # the target's own SETTINGS
            elif kind == 0x7 and self.goaway is None:
                self.goaway = (int.from_bytes(payload[:4], "big") & 0x7FFFFFFF,
                               int.from_bytes(payload[4:8], "big"))
                self.ended_ns = time.monotonic_ns()
            buffer = buffer[9 + length:]
        self._buffer = buffer

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended_ns = self.ended_ns or time.monotonic_ns()
        if not self.closed.done():
            self.closed.set_result(None)


def _context(plain: bool) -> dict[str, Any]:
    """``create_connection``'s TLS arguments (ALPN h2), none on plaintext."""
    if plain:
        return {}
    context = _tls()
    context.set_alpn_protocols(["h2"])
    return {"ssl": context, "server_hostname": "localhost"}


async def flood(host: str, port: int, kind: str, count: int, plain: bool, burst: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(FloodConn, host, port, **_context(plain))
    transport = conn.transport
    assert transport is not None
    transport.write(PREFACE + frame(0x4, 0, 0, b""))
    started = time.monotonic_ns()
    written = 0
    if kind == "rapid-reset":
        for first in range(0, count, burst):
            if transport.is_closing() or conn.goaway is not None:
                break
            transport.write(b"".join(frame(0x1, 0x5, 1 + 2 * i, BLOCK) + frame(0x3, 0, 1 + 2 * i, CANCEL)
                                     for i in range(first, min(first + burst, count))))
            written = min(first + burst, count)
            await asyncio.sleep(0)  # let a GOAWAY in
            while transport.get_write_buffer_size() > 1 << 20 and not transport.is_closing():
                await asyncio.sleep(0.001)
    else:
        frame_type, payload = CONTROL[kind]
        transport.write(frame(frame_type, 0, 0, payload) * count)
        written = count
    # A target that answers every frame and stays open (no limit) has answered within seconds.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.closed, 15 if kind == "rapid-reset" else 3)
    transport.abort()
    last_stream_id, code = conn.goaway if conn.goaway is not None else (None, None)
    return {"kind": kind, "written": written, "goaway_code": code, "goaway_last_stream_id": last_stream_id,
            "streams_before_goaway": None if last_stream_id is None else (last_stream_id + 1) // 2,
            "settings_acks": conn.acks[0x4], "ping_acks": conn.acks[0x6],
            "started_ns": started, "ended_ns": conn.ended_ns}


async def bystander(host: str, port: int, events: int, ready_after: int, plain: bool) -> dict[str, Any]:
    """One answer of ``events`` events every 10 ms; says ``ready`` after ``ready_after`` of them."""
    if plain:
        _, conn = await asyncio.get_running_loop().create_connection(H2Conn, host, port)
        await conn.ready
    else:
        conn = await connect(host, port)
    times: dict[int, list[int]] = {}
    conn.data_times = times
    result = StreamResult()
    stream_id = conn.open({"id": f"bystander-{port}-{time.monotonic_ns()}", "events": events,
                           "interval_ms": 10}, result)
    while len(times.get(stream_id, [])) < ready_after and not conn.done[stream_id].done():
        await asyncio.sleep(0.005)
    print("ready", flush=True)
    await conn.done[stream_id]
    assert conn.transport is not None
    conn.transport.close()
    return {"events": result.events, "times_ns": times.get(stream_id, [])}


def _client(*args: str, timeout_s: float = 120) -> dict[str, Any]:
    run = subprocess.run([PY, SELF, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    line = next((line for line in run.stdout.splitlines() if line.startswith('{"result"')), None)
    if line is None:
        return {"error": f"exit {run.returncode}: {run.stderr[-800:]}"}
    result: dict[str, Any] = json.loads(line)["result"]
    return result


def _gaps_ms(times: list[int], window: tuple[int, int] | None = None) -> float:
    """The longest gap between events (ms); with ``window``, among the gaps that overlap it."""
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(times)
            if window is None or (b >= window[0] and a <= window[1])]
    return round(max(gaps), 1) if gaps else float("nan")


def rapid_reset_round(port: int, pid: int, pairs: int | None, plain: bool) -> dict[str, Any]:
    """A bystander's answer, and (unless ``pairs`` is None) the flood during it."""
    target = ["--target", f"127.0.0.1:{port}", *(["--plain"] if plain else [])]
    watcher = subprocess.Popen([PY, SELF, "bystander", *target], stdout=subprocess.PIPE, text=True)
    assert watcher.stdout is not None
    if watcher.stdout.readline().strip() != "ready":
        watcher.kill()
        return {"error": "the bystander did not start"}
    row: dict[str, Any] = {}
    if pairs is not None:
        cpu_before = cpu_seconds(pid)
        row = _client("flood", "rapid-reset", *target, "--count", str(pairs))
        row["target_cpu_s"] = round(cpu_seconds(pid) - cpu_before, 3)
    out, _ = watcher.communicate(timeout=60)
    line = next((line for line in out.splitlines() if line.startswith('{"result"')), None)
    if line is None:
        return {**row, "error": "the bystander gave no result"}
    times = json.loads(line)["result"]["times_ns"]
    row["bystander_longest_gap_ms"] = _gaps_ms(times)
    if pairs is not None and "started_ns" in row:
        row["bystander_longest_gap_in_flood_ms"] = _gaps_ms(times, (row["started_ns"], row["ended_ns"]))
        row["flood_ms"] = round((row["ended_ns"] - row["started_ns"]) / 1e6, 1)
    return row


def control_round(kind: str, port: int, pid: int, plain: bool) -> dict[str, Any]:
    cpu_before = cpu_seconds(pid)
    row = _client("flood", kind, "--target", f"127.0.0.1:{port}", *(["--plain"] if plain else []),
                  "--count", "10000")
    row["target_cpu_s"] = round(cpu_seconds(pid) - cpu_before, 3)
    return row


def run(rounds: int, pairs: int, code: str | None) -> dict[str, Any]:
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        upstream_port, ports, pids = rotation(stack, code)
        for name, package in [("tokenwire-h2c", None), *([("base-h2c", code)] if code else [])]:
            ports[name] = free_port()
            plain = stack.enter_context(sidecar(ports[name], upstream_port, code=package, admin=False))
            pids[name] = plain.pid
        names = list(ports)
        for round_index in range(rounds + 1):  # round 0 warms up
            for name in names if round_index % 2 else names[::-1]:
                port, pid, plain = ports[name], pids[name], name.endswith("-h2c")
                done = {"quiet": rapid_reset_round(port, pid, None, plain),
                        "rapid_reset": rapid_reset_round(port, pid, pairs, plain),
                        **{kind: control_round(kind, port, pid, plain) for kind in CONTROL}}
                for cell, row in done.items():
                    row = {k: v for k, v in row.items() if not k.endswith("_ns")}
                    print(f"[round {round_index}] {name} {cell}: {json.dumps(row)}", flush=True)
                    if round_index:
                        cells.setdefault(cell, {}).setdefault(name, []).append(row)

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in rows[0]:
            values = [row[key] for row in rows if isinstance(row.get(key), int | float)]
            if values and all(isinstance(row.get(key), int | float) for row in rows):
                out[key] = {"median": round(statistics.median(values), 3), "max": max(values)}
            else:
                out[key] = sorted({str(row.get(key)) for row in rows})
        return out

    return {"rounds": rounds, "pairs": pairs, "load_average_after": list(os.getloadavg()),
            "summary": {cell: {name: summary(rows) for name, rows in by_name.items()}
                        for cell, by_name in cells.items()}, "runs": cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", nargs="?", choices=["bench", "bystander", "flood"], default="bench")
    parser.add_argument("kind", nargs="?", choices=["rapid-reset", *CONTROL], default="rapid-reset")
    parser.add_argument("--target", default="")
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--burst", type=int, default=4_000, help="rapid reset: pairs a write")
    parser.add_argument("--plain", action="store_true", help="a client: plaintext prior knowledge, not TLS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=100_000, help="rapid reset: pairs offered at most")
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="also run the tokenwire package in DIR/tokenwire as base")
    args = parser.parse_args()
    if args.role != "bench":
        host, port = args.target.rsplit(":", 1)
        coro = (bystander(host, int(port), 300, 50, args.plain) if args.role == "bystander"
                else flood(host, int(port), args.kind, args.count, args.plain, args.burst))
        try:
            import uvloop

            result = uvloop.run(coro)
        except ImportError:
            result = asyncio.run(coro)
        print(json.dumps({"result": result}), flush=True)
        return 0
    results = run(args.rounds, args.pairs, args.base)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "h2_flood.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
