"""Instructions per event and per stream: the sidecar (and nginx) under callgrind.

Why: CPU time per event on a shared 2-core VM moves by 2x with the load of
other jobs (a loaded machine batches reads and so *lowers* the figure), so a
change worth 5-10 % cannot be seen in ``sidecar_bench.py --cpu`` without many
rounds on a quiet machine. The number of user-space instructions a proxy
executes for the same traffic does not depend on the load: valgrind counts
them exactly, and two versions of the code compare in one run, on any machine.

Method: one fake upstream (``sse_load.py upstream``) and, per target, one
proxy process under ``valgrind --tool=callgrind --instr-atstart=no`` (the
start-up runs uninstrumented). A warm-up run of the load client opens and
reads as many streams as a counted run (so both counted runs find their
upstream connections pooled: with fewer, only the first would open some, and
its connects would pass for per-event work); then counting is switched on
(``callgrind_control -i on``) for a run of S streams x E1 events, the
counters are dumped and zeroed,
and a second run of S x E2 events is counted. Each event is its own upstream
read and client write (E events at 40 ms a stream: valgrind slows the proxy
~50x, and a loop that fell behind would merge reads and count fewer
instructions per event). Per event = (I2 - I1) / (S x (E2 - E1)); per stream
= what is left of I1 once its events are taken off, / S (parse the request,
open the upstream request, build the core, end, record).

Targets: ``tokenwire`` (this checkout), ``base`` (``--base DIR``: another
copy of the package, e.g. ``git archive OLD tokenwire`` plus ``middleware``
and ``sidecar`` under ``DIR/tokenwire``), ``nginx`` (one process,
``master_process off``, ``proxy_buffering off``). What valgrind cannot count:
the kernel (the ``read``/``write`` system calls, the same number per event
for every target) and the cost of cache misses.

Resets (``--resets N``): N clients each open a stream and read its first
event (the upstream then stays silent), counting is switched on, all N reset
their connections back to back (``SO_LINGER`` 0), the upstream is polled until
it saw every connection close, the proxy is left a few seconds for the
bookkeeping it does after (the record, metrics, the pod), and counting stops:
per reset = the count / N, everything a departing client costs.

Usage: ``python bench/instructions.py [--base DIR] [--streams 5] [--events 40 200] [--keep DIR]
[--resets N]`` (``--keep``: leave the dumps in DIR; ``callgrind_annotate
--inclusive=yes`` on the second dump of a target shows where its instructions
go); writes ``bench/results/instructions.json`` (``instructions_resets.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidecar_bench import RESULTS, ROOT, client
from sse_load import request_bytes

from testbed.targets import fake_upstream, free_port, nginx, sidecar

_TOTALS = re.compile(r"^totals: (\d+)", re.MULTILINE)


def _ensure_valgrind() -> None:
    if shutil.which("valgrind") is None:
        subprocess.run([str(ROOT / "scripts" / "system-deps.sh"), "valgrind"], check=True)


def _load(port: int, upstream_port: int, streams: int, events: int) -> int:
    result = client("throughput", port, upstream_port, "--streams", str(streams), "--events", str(events),
                    "--interval-ms", "40", timeout_s=1800)
    if result["exact_text"] != streams:
        raise RuntimeError(f"inexact text through the proxy: {result}")
    return int(result["delivered_tokens"])


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _dumped_totals(out_prefix: Path, before: set[Path]) -> int:
    """The instruction count of the dump ``callgrind_control -d`` just wrote."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for path in sorted(set(out_prefix.parent.glob(out_prefix.name + "*")) - before):
            match = _TOTALS.search(path.read_text(errors="replace"))
            if match:
                return int(match.group(1))
        time.sleep(0.2)
    raise RuntimeError("callgrind wrote no dump")


@contextlib.contextmanager
def _proxy(name: str, port: int, upstream_port: int, out_prefix: Path,
           base: str | None) -> Iterator[int]:
    """The proxy ``name`` under callgrind (instrumentation off until asked): its pid."""
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out_prefix}.%p"]
    if name == "nginx":
        # No master process: the one process valgrind runs is the one that serves.
        with nginx(port, upstream_port, wrapper=valgrind, master_process=False, ready_timeout_s=600) as proc:
            yield proc.pid
        return
    # The base runs from its own directory (targets.sidecar's ``code``), this
    # checkout's from the scratch one: ``python -m`` puts the working directory first.
    with sidecar(port, upstream_port, code=base if name == "base" else None, wrapper=valgrind,
                 cwd=str(out_prefix.parent), ready_timeout_s=600) as side:
        yield side.pid


def measure(name: str, upstream_port: int, streams: int, events: tuple[int, int],
            base: str | None, scratch: Path) -> dict[str, Any]:
    port = free_port()
    out_prefix = scratch / f"callgrind.{name}"
    with _proxy(name, port, upstream_port, out_prefix, base) as pid:
        # Warm-up: imports, caches, and as many pooled upstream connections as
        # a counted run opens streams (else the first run alone connects).
        _load(port, upstream_port, streams, 5)
        counts = []
        for n in events:
            before = set(scratch.glob(out_prefix.name + "*"))
            _control(pid, "-z")
            _control(pid, "-i", "on")
            delivered = _load(port, upstream_port, streams, n)
            _control(pid, "-i", "off")
            _control(pid, "-d")
            counts.append((delivered, _dumped_totals(out_prefix, before)))
    (e1, i1), (e2, i2) = counts
    per_event = (i2 - i1) / (e2 - e1)
    per_stream = (i1 - per_event * e1) / streams
    return {"instructions": {str(e): i for e, i in counts},
            "per_event": round(per_event), "per_stream": round(per_stream)}


def _closes_seen(upstream_port: int) -> set[str]:
    """The request ids whose connection the fake upstream saw close early."""
    with socket.create_connection(("127.0.0.1", upstream_port), timeout=10) as sock:
        sock.sendall(b"GET /closes HTTP/1.1\r\nhost: bench\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += sock.recv(65536)
    return set(json.loads(body)["closes"])


def measure_resets(name: str, upstream_port: int, clients: int, base: str | None,
                   scratch: Path) -> dict[str, Any]:
    """Instructions of ``clients`` departures in one burst (see the module docstring)."""
    port = free_port()
    out_prefix = scratch / f"callgrind.resets.{name}"
    with _proxy(name, port, upstream_port, out_prefix, base) as pid:
        _load(port, upstream_port, 5, 5)  # warm-up: imports, pools, caches
        tag = f"z{os.getpid()}-{name}"
        ids = [f"{tag}-{i}" for i in range(clients)]
        socks = []
        for request_id in ids:
            sock = socket.create_connection(("127.0.0.1", port), timeout=600)
            sock.sendall(request_bytes({"id": request_id, "events": 3, "interval_ms": 3_600_000}))
            socks.append(sock)
        for sock in socks:  # the head and the first event, then silence
            data = b""
            while b"data:" not in data or not data.endswith(b"\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError(f"{name}: the stream ended before its first event")
                data += chunk
        before = set(scratch.glob(out_prefix.name + "*"))
        _control(pid, "-z")
        _control(pid, "-i", "on")
        for sock in socks:  # back to back, as a front end that drops its connections would
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        deadline = time.monotonic() + 600
        while not set(ids) <= _closes_seen(upstream_port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the upstream did not see every close")
            time.sleep(0.5)
        time.sleep(5)  # the bookkeeping after the closes (slowed ~50x by valgrind)
        _control(pid, "-i", "off")
        _control(pid, "-d")
        total = _dumped_totals(out_prefix, before)
    return {"clients": clients, "instructions": total, "per_reset": round(total / clients)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="DIR", help="also count the tokenwire package in DIR/tokenwire")
    parser.add_argument("--streams", type=int, default=5)
    parser.add_argument("--events", type=int, nargs=2, default=(40, 200), metavar=("E1", "E2"))
    parser.add_argument("--targets", default="tokenwire,base,nginx")
    parser.add_argument("--resets", type=int, metavar="N", default=0,
                        help="count N clients resetting at once instead")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the callgrind dumps in DIR (for callgrind_annotate)")
    args = parser.parse_args()
    _ensure_valgrind()
    targets = [t for t in args.targets.split(",") if t != "base" or args.base]
    if args.resets:
        return _main_resets(targets, args.resets, args.base, args.keep)
    results: dict[str, Any] = {"streams": args.streams, "events": list(args.events), "targets": {}}
    upstream_port = free_port()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    scratch_dir = contextlib.nullcontext(args.keep) if args.keep else \
        tempfile.TemporaryDirectory(prefix="tokenwire-callgrind-")
    with scratch_dir as scratch, fake_upstream(upstream_port):
        for name in targets:
            row = measure(name, upstream_port, args.streams, tuple(args.events), args.base, Path(scratch))
            results["targets"][name] = row
            print(f"{name:10} {row['per_event']:>8,} instructions/event {row['per_stream']:>11,} /stream",
                  flush=True)
    if "nginx" in results["targets"]:
        ngx = results["targets"]["nginx"]
        for row in results["targets"].values():
            row["per_event_vs_nginx"] = round(row["per_event"] / ngx["per_event"], 2)
            row["per_stream_vs_nginx"] = round(row["per_stream"] / ngx["per_stream"], 2)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "instructions.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


def _main_resets(targets: list[str], clients: int, base: str | None, keep: str | None) -> int:
    results: dict[str, Any] = {"clients": clients, "targets": {}}
    upstream_port = free_port()
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    scratch_dir = contextlib.nullcontext(keep) if keep else \
        tempfile.TemporaryDirectory(prefix="tokenwire-callgrind-")
    with scratch_dir as scratch, fake_upstream(upstream_port):
        for name in targets:
            row = measure_resets(name, upstream_port, clients, base, Path(scratch))
            results["targets"][name] = row
            print(f"{name:10} {row['per_reset']:>11,} instructions/reset ({clients} at once)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "instructions_resets.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
