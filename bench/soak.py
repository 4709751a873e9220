"""Soak: a real sidecar process under mixed traffic for a long time (not in CI).

Method (figures in docs/perf/soak.md):

* A fake engine (``soak.py upstream``, its own process) streams OpenAI chat
  chunks at the pace each request asks for, and can die mid-stream on request.
* ``tokenwire sidecar`` runs as a process in front of it, writing its JSON
  stream records to a file.
* This process keeps ``--streams`` clients busy, each request one behaviour
  drawn at random: ``normal`` (read to the end), ``disconnect`` (close or reset
  after a few events), ``slow`` (small receive window, reads 1 KiB per 50 ms),
  ``stall`` (stops reading: the write deadline must end it), ``die`` (the
  upstream drops the connection mid-stream) and ``json`` (a non-stream request).
  With ``--resume`` the sidecar runs with ``--resume`` (memory store, a short
  TTL so the store reaches its steady size) and a ``resume`` behaviour joins:
  reset after a few events, reconnect with ``GET /v1/streams/{id}`` and
  ``Last-Event-ID``, read the rest; the reconnect is a request of its own.
* Every ``--sample-s`` seconds the sidecar's RSS and open file descriptors are
  read from /proc.
* At the end the load stops, in-flight requests finish, the sidecar gets
  SIGTERM, and every request id sent is looked up in the record file: each must
  have exactly one record, and its end reason must be the one its behaviour
  implies. Flatness is the least-squares slope of RSS and fds after warm-up,
  and the last-minutes median against the first.

``soak.py idle --connections 10000`` instead measures memory per idle keep-alive
connection (each served one request, then left open).

Usage: ``python bench/soak.py [run] [--minutes 30]`` (writes
``bench/results/soak.json`` and ``soak.png``); ``python bench/soak.py idle``
(writes ``bench/results/idle_connections.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import resource
import signal
import socket
import statistics
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
from testbed.targets import PY, free_port, process, rss_kib, sidecar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# behaviour: (weight, the end reasons its record may carry)
BEHAVIOURS: dict[str, tuple[int, tuple[str, ...]]] = {
    "normal": (55, ("complete",)),
    "disconnect": (15, ("client_gone",)),
    "slow": (10, ("complete",)),
    "stall": (5, ("slow_client",)),
    "die": (5, ("upstream_error",)),
    "json": (10, ("complete",)),
}
# Only with --resume. The first request is "detached" when its reader attached
# within the grace, or "complete" when the answer was done before it did.
RESUME_BEHAVIOURS: dict[str, tuple[int, tuple[str, ...]]] = {
    # With a grace, a client that leaves for good still lets an answer that ends
    # within the grace complete (into the store).
    "disconnect": (15, ("client_gone", "complete")),
    "resume": (15, ("detached", "complete")),
    "resume-reader": (0, ("complete",)),  # the reconnect; never drawn, it follows "resume"
}
_RESUME_ARGS = ("--resume", "--resume-grace-s", "2", "--resume-ttl-s", "60")
_WRITE_DEADLINE_S = 5.0
_WARM_UP_S = 60.0


# ---------------------------------------------------------------- the fake engine


def _chunk(text: str | None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    payload = {"id": "chatcmpl-soak", "object": "chat.completion.chunk", "created": 0, "model": "soak",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _serve_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            spec = json.loads(await reader.readexactly(length) or b"{}")
            if not spec.get("stream"):
                body = json.dumps({"object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%b" % (len(body), body))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            interval_s = float(spec.get("interval_ms", 10)) / 1000
            die_after = int(spec.get("die_after", -1))
            for i in range(int(spec.get("events", 50))):
                if i == die_after:
                    writer.transport.abort()
                    return
                writer.write(_chunk(f"tok{i} "))
                await writer.drain()
                await asyncio.sleep(interval_s)
            writer.write(_chunk(None, "stop") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()


async def _run_upstream(port: int) -> None:
    server = await asyncio.start_server(_serve_upstream, "127.0.0.1", port, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------- processes


@contextlib.contextmanager
def _started(log_file: Path, max_connections: int = 2_000, *,
             extra_args: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """This file's upstream and a sidecar in front of it: (the sidecar's process, its port)."""
    upstream_port = free_port()
    with process([PY, __file__, "upstream", "--port", str(upstream_port)], "upstream"), \
            sidecar(0, upstream_port, admin=False, flags=(
                "--log-file", str(log_file), "--max-connections", str(max_connections),
                "--write-deadline-s", str(_WRITE_DEADLINE_S), "--drain-s", "5", *extra_args)) as side:
        yield side.process, side.port


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _raise_own_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---------------------------------------------------------------- clients


def _resume_request(request_id: str, stream_id: str, last_event_id: str) -> bytes:
    return (f"GET /v1/streams/{stream_id} HTTP/1.1\r\nHost: soak\r\nAccept: text/event-stream\r\n"
            f"X-Request-Id: {request_id}\r\nLast-Event-ID: {last_event_id}\r\n"
            "Connection: close\r\n\r\n").encode()


def _ids(body: bytes) -> list[int]:
    return [int(line.rpartition(b".")[2]) for line in body.split(b"\n") if line.startswith(b"id: ")]


async def _resume_one(port: int, request_id: str, spec: dict[str, Any], rng: random.Random,
                      sent: dict[str, str]) -> str:
    """Reset after a few events, reconnect with Last-Event-ID, read the rest:
    "complete" if the two parts join exactly (ids k+1.. after k) and end in [DONE]."""
    reader, writer = await _connect(port)
    body = bytearray()
    stop_after = rng.randint(1, spec["events"] // 2)
    try:
        writer.write(_request(request_id, spec, close=True))
        while len(_ids(bytes(body))) < stop_after:
            data = await reader.read(65536)
            if not data:
                return "cut"
            body += data
    finally:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    head = bytes(body).split(b"\r\n\r\n", 1)[0]
    stream_id = next(value.strip().decode() for name, _, value in
                     (line.partition(b":") for line in head.split(b"\r\n"))
                     if name.strip().lower() == b"x-tokenwire-stream-id")
    last = _ids(bytes(body))[-1]
    reader_id = request_id + ".r"
    sent[reader_id] = "resume-reader"
    reader, writer = await _connect(port)
    rest = bytearray()
    try:
        writer.write(_resume_request(reader_id, stream_id, f"{stream_id}.{last}"))
        while data := await reader.read(65536):
            rest += data
    finally:
        writer.close()
    ids = _ids(bytes(rest))
    joined = bool(ids) and ids[0] == last + 1 and ids == sorted(set(ids))
    return "complete" if joined and rest.endswith(b"0\r\n\r\n") and b"data: [DONE]" in rest else "bad"


def _request(request_id: str, spec: dict[str, Any], *, close: bool) -> bytes:
    body = json.dumps({"model": "soak", "messages": [{"role": "user", "content": "hi"}], **spec}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


async def _connect(port: int, *, slow: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection; ``slow`` ones have a small receive window and a small
    StreamReader buffer, so not reading really stops the socket."""
    sock = socket.socket()
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=2048 if slow else 1 << 20)


async def _one_request(port: int, request_id: str, behaviour: str, rng: random.Random,
                       sent: dict[str, str]) -> str:
    """Run one request; what the client saw (complete / error / cut / ...)."""
    spec: dict[str, Any] = {"stream": behaviour != "json", "events": rng.randint(20, 200),
                            "interval_ms": rng.choice([2, 5, 10, 20])}
    if behaviour == "resume":
        return await _resume_one(port, request_id, spec, rng, sent)
    if behaviour == "die":
        spec["die_after"] = rng.randint(1, spec["events"] - 1)
    if behaviour in ("slow", "stall"):
        spec.update(events=300 if behaviour == "slow" else 20_000, interval_ms=2)
    reader, writer = await _connect(port, slow=behaviour in ("slow", "stall"))
    try:
        writer.write(_request(request_id, spec, close=True))
        body = bytearray()
        stop_after = rng.randint(1, spec["events"] // 2) if behaviour == "disconnect" else -1
        while True:
            if behaviour == "stall" and body.startswith(b"HTTP/1.1 200"):
                # Stop reading for good; the sidecar's write deadline must end the stream.
                writer.transport.pause_reading()
                await asyncio.sleep(_WRITE_DEADLINE_S * 2)
                return "stalled"
            data = await reader.read(1024 if behaviour == "slow" else 65536)
            if not data:
                break
            body += data
            if behaviour == "slow":
                await asyncio.sleep(0.05)
            if stop_after >= 0 and body.count(b"data: ") > stop_after and b"[DONE]" not in body:
                if rng.random() < 0.5:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return "left"
    except ConnectionError:
        return "reset"
    finally:
        writer.close()
    if behaviour == "json":
        return "complete" if body.startswith(b"HTTP/1.1 200") and body.endswith(b"}") else "bad"
    if body.endswith(b"0\r\n\r\n") and b"data: [DONE]" in body:
        return "complete"
    return "error" if b'"error"' in body else "cut"


async def _load(port: int, streams: int, until: float, seed: int, behaviours: dict[str, tuple[int, Any]],
                sent: dict[str, str], seen: collections.Counter[str]) -> None:
    rng = random.Random(seed)
    names = list(behaviours)
    weights = [behaviours[name][0] for name in names]
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while time.monotonic() < until:
            counter += 1
            request_id = f"soak-{counter}"
            behaviour = rng.choices(names, weights)[0]
            sent[request_id] = behaviour
            try:
                outcome = await asyncio.wait_for(_one_request(port, request_id, behaviour, rng, sent), 120)
            except (TimeoutError, OSError) as error:
                outcome = f"client-{type(error).__name__}"
            if behaviour == "disconnect" and outcome == "complete":
                # The whole answer was there before the client meant to leave.
                outcome = "complete-before-leaving"
                sent[request_id] = "normal"
            seen[f"{behaviour}:{outcome}"] += 1

    await asyncio.gather(*(worker() for _ in range(streams)))


async def _sample(pid: int, every_s: float, until: float, started: float,
                  samples: list[dict[str, float]], sent: dict[str, str]) -> None:
    while time.monotonic() < until:
        samples.append({"t_s": round(time.monotonic() - started, 1), "rss_kib": rss_kib(pid),
                        "fds": _open_fds(pid), "requests": len(sent)})
        await asyncio.sleep(every_s)


def _slope_per_min(samples: list[dict[str, float]], key: str) -> float:
    xs = [s["t_s"] / 60 for s in samples]
    ys = [s[key] for s in samples]
    if len(xs) < 2:
        return 0.0
    return statistics.linear_regression(xs, ys).slope


def _account(log_file: Path, sent: dict[str, str],
             behaviours: dict[str, tuple[int, tuple[str, ...]]]) -> dict[str, Any]:
    records: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in log_file.read_text().splitlines():
        record = json.loads(line)
        records[record["request_id"]].append(record)
    reasons: collections.Counter[str] = collections.Counter()
    unexpected: collections.Counter[str] = collections.Counter()
    for request_id, behaviour in sent.items():
        for record in records.get(request_id, []):
            reasons[record["end_reason"]] += 1
            if record["end_reason"] not in behaviours[behaviour][1]:
                unexpected[f"{behaviour}->{record['end_reason']}"] += 1
    return {
        "requests_sent": len(sent),
        "records": sum(len(r) for r in records.values()),
        "without_record": sorted(set(sent) - set(records))[:20],
        "without_record_count": len(set(sent) - set(records)),
        "with_several_records": sum(1 for r in records.values() if len(r) > 1),
        "records_for_unknown_ids": len(set(records) - set(sent)),
        "end_reasons": dict(reasons.most_common()),
        "end_reason_not_the_expected_one": dict(unexpected.most_common()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    _raise_own_fd_limit()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        log_file = Path(tmp) / "streams.jsonl"
        behaviours = {**BEHAVIOURS, **(RESUME_BEHAVIOURS if args.resume else {})}
        extra_args = _RESUME_ARGS if args.resume else ()
        sidecar, port = stack.enter_context(_started(log_file, extra_args=extra_args))
        sent: dict[str, str] = {}
        seen: collections.Counter[str] = collections.Counter()
        samples: list[dict[str, float]] = []
        started = time.monotonic()
        until = started + args.minutes * 60

        async def main() -> None:
            sampler = asyncio.ensure_future(_sample(sidecar.pid, args.sample_s, until + 3600, started,
                                                    samples, sent))
            await _load(port, args.streams, until, args.seed, behaviours, sent, seen)
            # Load over, everything in flight finished: one last sample of the quiet process.
            await asyncio.sleep(1)
            sampler.cancel()
            samples.append({"t_s": round(time.monotonic() - started, 1), "rss_kib": rss_kib(sidecar.pid),
                            "fds": _open_fds(sidecar.pid), "requests": len(sent)})

        asyncio.run(main())
        # A graceful stop, while both still run: its exit code is part of the result.
        sidecar.send_signal(signal.SIGTERM)
        exit_code = sidecar.wait(30)
        steady = [s for s in samples if s["t_s"] >= min(_WARM_UP_S, args.minutes * 60 / 4)]
        window = max(1, len(steady) // 10)
        result = {
            "minutes": args.minutes, "concurrent_clients": args.streams, "seed": args.seed,
            "write_deadline_s": _WRITE_DEADLINE_S, "sidecar_exit_code": exit_code,
            "client_outcomes": dict(sorted(seen.items())),
            "resume": args.resume,
            "accounting": _account(log_file, sent, behaviours),
            "rss_kib": {"first": samples[0]["rss_kib"], "after_warm_up": steady[0]["rss_kib"],
                        "max": max(s["rss_kib"] for s in samples), "last": samples[-1]["rss_kib"],
                        "first_tenth_median": statistics.median(s["rss_kib"] for s in steady[:window]),
                        "last_tenth_median": statistics.median(s["rss_kib"] for s in steady[-window:]),
                        "slope_kib_per_min": round(_slope_per_min(steady, "rss_kib"), 2)},
            "fds": {"min": min(s["fds"] for s in steady), "max": max(s["fds"] for s in steady),
                    "last": samples[-1]["fds"],
                    "slope_per_min": round(_slope_per_min(steady, "fds"), 3)},
            "samples": samples,
        }
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(minutes, [s["rss_kib"] / 1024 for s in samples])
    axes[0].set_title("sidecar RSS (MiB)")
    axes[1].plot(minutes, [s["fds"] for s in samples])
    axes[1].set_title("sidecar open file descriptors")
    axes[2].plot(minutes, [s["requests"] for s in samples])
    axes[2].set_title("requests sent (cumulative)")
    for axis in axes:
        axis.set_xlabel("minutes")
        axis.set_ylim(bottom=0)
    fig.suptitle(f"soak: {result['minutes']} min, {result['concurrent_clients']} concurrent clients, "
                 f"{result['accounting']['requests_sent']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------- idle connections


async def _open_idle(port: int, count: int, batch: int) -> list[asyncio.StreamWriter]:
    writers: list[asyncio.StreamWriter] = []

    async def one(i: int) -> asyncio.StreamWriter:
        reader, writer = await _connect(port)
        writer.write(_request(f"idle-{i}", {"stream": False}, close=False))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return writer

    for start in range(0, count, batch):
        writers += await asyncio.gather(*(one(i) for i in range(start, min(count, start + batch))))
    return writers


def idle(args: argparse.Namespace) -> dict[str, Any]:
    _raise_own_fd_limit()
    with tempfile.TemporaryDirectory() as tmp, \
            _started(Path(tmp) / "streams.jsonl", max_connections=args.connections + 100) as (sidecar, port):
        async def main() -> dict[str, Any]:
            warm = await _open_idle(port, args.warm_up, 100)
            before = rss_kib(sidecar.pid), _open_fds(sidecar.pid)
            started = time.monotonic()
            rest = await _open_idle(port, args.connections - args.warm_up, 200)
            opened_s = time.monotonic() - started
            await asyncio.sleep(2)
            after = rss_kib(sidecar.pid), _open_fds(sidecar.pid)
            for writer in warm + rest:
                writer.transport.abort()
            measured = args.connections - args.warm_up
            return {"connections": args.connections, "warm_up": args.warm_up,
                    "rss_kib_before": before[0], "rss_kib_after": after[0],
                    "fds_before": before[1], "fds_after": after[1],
                    "kib_per_connection": round((after[0] - before[0]) / measured, 2),
                    "open_s": round(opened_s, 2)}

        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    run_parser = sub.add_parser("run", help="the soak (default)")
    for p in (parser, run_parser):
        p.add_argument("--minutes", type=float, default=30.0)
        p.add_argument("--streams", type=int, default=32, help="concurrent clients")
        p.add_argument("--sample-s", type=float, default=5.0)
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--resume", action="store_true",
                       help="sidecar with --resume, and a resume behaviour (reset, reconnect, rest)")
    idle_parser = sub.add_parser("idle", help="memory per idle keep-alive connection")
    idle_parser.add_argument("--connections", type=int, default=10_000)
    idle_parser.add_argument("--warm-up", type=int, default=500)
    upstream_parser = sub.add_parser("upstream", help="(internal) the fake engine")
    upstream_parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.command == "upstream":
        asyncio.run(_run_upstream(args.port))
        return 0
    if args.command == "idle":
        result = idle(args)
        (RESULTS / "idle_connections.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    result = run(args)
    name = "soak_resume" if args.resume else "soak"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    accounting = result["accounting"]
    lost = accounting["without_record_count"] + accounting["with_several_records"]
    return 0 if lost == 0 and result["sidecar_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
