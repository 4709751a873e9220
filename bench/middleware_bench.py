"""ASGI middleware benchmark (not a test): CPU per event, and disconnect propagation.

1. CPU per event. A uvicorn server process serves a Starlette
   ``StreamingResponse`` of OpenAI chat chunks, bare or wrapped in
   :class:`TokenWireMiddleware`. A client in another process opens
   ``--streams`` concurrent streams and reads them to the end. The server
   reports its own CPU time (``resource.getrusage``) before and after; CPU per
   event = delta / events delivered. Bare and wrapped runs alternate, repeated
   ``--repeats`` times; medians are reported. ``--base DIR``: also run the
   middleware from another ``tokenwire`` package (``DIR/tokenwire``, e.g. an
   older commit's ``git archive``) as a third server in the same rotation, so
   before and after are measured side by side.
2. Disconnect propagation. The server's app sits in a silent 60 s "prefill";
   the client sends a request, waits 30 ms, then resets the connection
   (SO_LINGER 0). The app records when it sees ``CancelledError`` and the
   ``on_abort`` hook when it is called (CLOCK_MONOTONIC, shared by both
   processes); latency = that time - the client's time just before the reset.
3. ``--instructions EVENTS``: user-space instructions per event, bare and
   wrapped, counted by valgrind (cachegrind) on the same servers: a figure
   that other processes on a shared machine cannot move
   (:func:`instructions_benchmark`). Needs ``valgrind``.

Run: ``.venv/bin/python bench/middleware_bench.py`` (writes
``bench/results/middleware.json``; ``--servers httptools`` for one server,
``--out FILE`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "middleware.json"


# ---------------------------------------------------------------- server process


def build_app(mode: str, events: int) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from tokenwire.middleware import TokenWireMiddleware

    cancelled_at: list[float] = []
    aborted_at: list[float] = []
    chunk = ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
             '"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}\n\n')

    async def tokens() -> AsyncIterator[str]:
        for i in range(events):
            yield chunk % i
            await asyncio.sleep(0)  # an engine hands tokens over through a queue
        yield "data: [DONE]\n\n"

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(tokens(), media_type="text/event-stream")

    async def prefill(request: Request) -> StreamingResponse:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            raise
        return StreamingResponse(tokens(), media_type="text/event-stream")

    async def cpu(request: Request) -> JSONResponse:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return JSONResponse({"cpu_s": usage.ru_utime + usage.ru_stime})

    async def latencies(request: Request) -> JSONResponse:
        body = {"cancelled_at": list(cancelled_at), "aborted_at": list(aborted_at)}
        cancelled_at.clear()
        aborted_at.clear()
        return JSONResponse(body)

    app = Starlette(routes=[Route("/stream", stream), Route("/prefill", prefill), Route("/cpu", cpu),
                            Route("/latencies", latencies)])
    if mode == "bare":
        return app
    return TokenWireMiddleware(app, on_abort=lambda request_id, reason: aborted_at.append(time.monotonic()))


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    uvicorn.run(build_app(args.mode, args.events), host="127.0.0.1", port=args.port, http=args.http,
                loop=args.loop, log_level="critical", access_log=False, lifespan="off",
                backlog=4096)


# ---------------------------------------------------------------- client side


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    def __init__(self, mode: str, http: str, loop: str, events: int, code: str | None = None,
                 wrapper: list[str] | None = None) -> None:
        """``code``: a directory holding another ``tokenwire`` package to serve
        the middleware from (``--base``); ``wrapper``: a command to run the
        server under (valgrind)."""
        self.port = free_port()
        path = [code] if code is not None else []
        self.process = subprocess.Popen(
            [*(wrapper or []), sys.executable, __file__, "serve", "--mode", mode, "--http", http,
             "--loop", loop, "--port", str(self.port), "--events", str(events)],
            env={**os.environ,
                 "PYTHONPATH": os.pathsep.join([*path, str(Path(__file__).resolve().parent.parent)])})
        deadline = time.monotonic() + (30 if wrapper is None else 300)
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("server did not start") from None
                time.sleep(0.05)

    def get_json(self, path: str) -> Any:
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return json.loads(data.split(b"\r\n\r\n", 1)[1])

    def close(self, timeout_s: float = 10) -> None:
        self.process.terminate()
        self.process.wait(timeout_s)


async def read_stream(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    received = 0
    while chunk := await reader.read(1 << 16):
        received += len(chunk)
    writer.close()
    return received


def cpu_run(server: Server, streams: int, events: int) -> dict[str, float]:
    before = server.get_json("/cpu")["cpu_s"]
    started = time.perf_counter()

    async def main() -> list[int]:
        return await asyncio.gather(*(read_stream(server.port) for _ in range(streams)))

    sizes = asyncio.run(main())
    wall_s = time.perf_counter() - started
    cpu_s = server.get_json("/cpu")["cpu_s"] - before
    assert all(size > events * 100 for size in sizes), sizes
    delivered = streams * (events + 1)
    return {"cpu_s": cpu_s, "wall_s": wall_s, "events": delivered,
            "cpu_us_per_event": cpu_s / delivered * 1e6}


def cpu_benchmark(args: argparse.Namespace, http: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "middleware": []}
    if args.base is not None:
        runs["base"] = []
    servers = {mode: Server("middleware" if mode == "base" else mode, http, args.loop, args.events,
                            code=args.base if mode == "base" else None)
               for mode in runs}
    try:
        for server in servers.values():  # warm up both
            cpu_run(server, args.streams, args.events)
        for _ in range(args.repeats):
            for mode, server in servers.items():
                runs[mode].append(cpu_run(server, args.streams, args.events))
    finally:
        for server in servers.values():
            server.close()
    medians = {mode: statistics.median(r["cpu_us_per_event"] for r in rs) for mode, rs in runs.items()}
    result: dict[str, Any] = {
        "http": http, "loop": args.loop, "streams": args.streams, "events_per_stream": args.events,
        "repeats": args.repeats,
        "cpu_us_per_event_bare": round(medians["bare"], 3),
        "cpu_us_per_event_middleware": round(medians["middleware"], 3),
        "added_us_per_event": round(medians["middleware"] - medians["bare"], 3),
        "overhead_pct": round((medians["middleware"] / medians["bare"] - 1) * 100, 1),
    }
    for mode, rs in runs.items():
        # The least-disturbed round: other processes only ever add CPU time.
        result[f"cpu_us_per_event_{mode}_min"] = round(min(r["cpu_us_per_event"] for r in rs), 3)
    if "base" in medians:
        result["base"] = args.base
        result["cpu_us_per_event_base"] = round(medians["base"], 3)
        result["added_us_per_event_base"] = round(medians["base"] - medians["bare"], 3)
    # Each round's added cost against the bare run just before it: the
    # machine's load moves both alike, so this is steadier than the medians.
    for mode in ("middleware", "base"):
        if mode in runs:
            added = [w["cpu_us_per_event"] - b["cpu_us_per_event"]
                     for b, w in zip(runs["bare"], runs[mode], strict=True)]
            result[f"added_us_per_event_{mode}_paired_median"] = round(statistics.median(added), 3)
    result["runs"] = runs
    return result


def instructions_benchmark(args: argparse.Namespace, http: str) -> dict[str, Any]:
    """User-space instructions per event (valgrind's cachegrind): free of the
    noise CPU time picks up from other processes on a shared machine. Each
    server (bare, middleware, ``--base``) serves ``--streams`` streams of E1
    and then E2 events in two runs under cachegrind; instructions per event =
    the difference of the two runs' totals / (streams x (E2 - E1)), so start-up
    and per-stream costs cancel. The kernel's share (the socket writes) is the
    same bare and wrapped and is not counted."""
    low, high = 100, 100 + args.instructions
    modes = ["bare", "middleware", *(["base"] if args.base is not None else [])]
    per_event: dict[str, float] = {}
    for mode in modes:
        totals = []
        for events in (low, high):
            log = Path(tempfile.mkdtemp(prefix="tokenwire-cachegrind-")) / "log"
            wrapper = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                       "--cachegrind-out-file=/dev/null", f"--log-file={log}"]
            server = Server("middleware" if mode == "base" else mode, http, args.loop, events,
                            code=args.base if mode == "base" else None, wrapper=wrapper)
            try:
                async def read_all(port: int = server.port) -> list[int]:
                    return await asyncio.gather(*(read_stream(port) for _ in range(args.instr_streams)))
                asyncio.run(read_all())
                # A server that could not bind its port (taken meanwhile) has
                # exited, and the streams were read from someone else's.
                assert server.process.poll() is None, "the server exited early"
            finally:
                server.close(timeout_s=120)
            refs = re.search(r"I\s+refs:\s+([\d,]+)", log.read_text())
            assert refs is not None, log.read_text()
            totals.append(int(refs.group(1).replace(",", "")))
        per_event[mode] = (totals[1] - totals[0]) / (args.instr_streams * (high - low))
    result: dict[str, Any] = {"http": http, "streams": args.instr_streams, "events": [low, high],
                              "instructions_per_event": {m: round(v) for m, v in per_event.items()}}
    for mode in modes[1:]:
        result[f"added_instructions_per_event_{mode}"] = round(per_event[mode] - per_event["bare"])
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def disconnect_benchmark(args: argparse.Namespace, http: str, code: str | None = None) -> dict[str, Any]:
    server = Server("middleware", http, args.loop, 10, code=code)
    linger = struct.pack("ii", 1, 0)
    reset_at: list[float] = []
    try:
        for _ in range(args.resets):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"GET /prefill HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.03)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            reset_at.append(time.monotonic())
            sock.close()
            time.sleep(0.01)
        time.sleep(0.5)
        seen = server.get_json("/latencies")
    finally:
        server.close()
    assert len(seen["cancelled_at"]) == len(reset_at) == len(seen["aborted_at"]), seen
    cancel_ms = [(c - r) * 1000 for c, r in zip(sorted(seen["cancelled_at"]), reset_at, strict=True)]
    abort_ms = [(a - r) * 1000 for a, r in zip(sorted(seen["aborted_at"]), reset_at, strict=True)]
    return {
        "http": http, "loop": args.loop, "resets": len(reset_at),
        "app_cancelled_ms": {"p50": round(percentile(cancel_ms, 50), 3),
                             "p99": round(percentile(cancel_ms, 99), 3),
                             "max": round(max(cancel_ms), 3)},
        "on_abort_ms": {"p50": round(percentile(abort_ms, 50), 3),
                        "p99": round(percentile(abort_ms, 99), 3),
                        "max": round(max(abort_ms), 3)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "serve"])
    parser.add_argument("--mode", default="bare")
    parser.add_argument("--http", default="httptools")
    parser.add_argument("--loop", default="uvloop")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--resets", type=int, default=200)
    parser.add_argument("--servers", default="httptools,h11",
                        help="bench: the uvicorn HTTP implementations to run, comma-separated")
    parser.add_argument("--base", metavar="DIR", default=None,
                        help="bench: also run the middleware of the tokenwire package in DIR/tokenwire "
                             "(e.g. `git archive OLD tokenwire middleware sidecar engine` unpacked "
                             "into DIR/tokenwire) side by side")
    parser.add_argument("--out", default=str(RESULTS), help="bench: where to write the results")
    parser.add_argument("--instructions", type=int, default=0, metavar="EVENTS",
                        help="bench: also count user-space instructions per event under valgrind "
                             "(cachegrind), from runs of 100 and 100+EVENTS events per stream")
    parser.add_argument("--instr-streams", type=int, default=16,
                        help="bench: concurrent streams of the --instructions runs")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
        return
    import uvicorn

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["bench/middleware_bench.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "uvicorn": uvicorn.__version__},
        "cpu_per_event": [],
        "disconnect": [],
        "instructions": [],
    }
    for http in args.servers.split(","):
        if args.instructions > 0:
            counted = instructions_benchmark(args, http)
            print(f"instructions/event {http}: {counted['instructions_per_event']}", flush=True)
            result["instructions"].append(counted)
        cpu = cpu_benchmark(args, http)
        base = "" if args.base is None else (f", base {cpu['cpu_us_per_event_base']} us "
                                             f"(+{cpu['added_us_per_event_base']})")
        print(f"cpu/event {http}: bare {cpu['cpu_us_per_event_bare']} us, middleware "
              f"{cpu['cpu_us_per_event_middleware']} us (+{cpu['added_us_per_event']}, "
              f"{cpu['overhead_pct']}%){base}", flush=True)
        result["cpu_per_event"].append(cpu)
        for code in (None, args.base) if args.base is not None else (None,):
            if args.resets <= 0:
                break
            disconnect = disconnect_benchmark(args, http, code)
            if code is not None:
                disconnect["base"] = code
            print(f"disconnect {http}{'' if code is None else ' (base)'}: app cancelled p50 "
                  f"{disconnect['app_cancelled_ms']['p50']} ms, "
                  f"p99 {disconnect['app_cancelled_ms']['p99']} ms", flush=True)
            result["disconnect"].append(disconnect)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
