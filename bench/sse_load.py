"""Shared pieces of the proxy benchmarks: a fast fake upstream and a load client.

Both are bare asyncio (uvloop when present) with minimal HTTP/1.1, so that
what is measured is the proxy between them, not a framework. They run as
separate processes (``python bench/sse_load.py upstream|client ...``) so the
load generator never shares an event loop with what it measures. Times are
``time.monotonic_ns()``, one clock for every process on the machine, so a send
time written into an event by the upstream can be compared with the receive
time at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import struct
import sys
import time
from typing import Any

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

from tokenwire.middleware.sse import SSEParser


def raise_fd_limit(wanted: int = 65536) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, min(wanted, hard if hard != resource.RLIM_INFINITY else wanted))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def chunk_bytes(request_id: str, index: int, text: str) -> bytes:
    """One OpenAI chat chunk, send time in ``system_fingerprint`` (kept on merge)."""
    payload = {
        "id": request_id, "object": "chat.completion.chunk", "created": 1764460800,
        "model": "bench", "system_fingerprint": f"t{time.monotonic_ns()}",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def token_text(index: int) -> str:
    return f" w{index}"


# ---------------------------------------------------------------- upstream


class UpstreamState:
    """What the fake upstream saw, served at ``GET /closes`` for the benchmark."""

    def __init__(self) -> None:
        self.closes: dict[str, int] = {}
        self.finished: dict[str, int] = {}


class UpstreamProtocol(asyncio.Protocol):
    """POST body JSON ``{"id", "events", "interval_ms"}`` streams that many chunks.

    ``connection_lost`` records the time a stream's connection closed before
    it finished: the far end of the reset-propagation measurement.
    """

    def __init__(self, state: UpstreamState) -> None:
        self.state = state
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.request_id: str | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            if self.request_id is not None:
                self.state.closes[self.request_id] = time.monotonic_ns()
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.task is None or self.task.done():
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            lines = self.buffer[:head_end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:] if line)}
            length = int(headers.get("content-length", "0"))
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4:head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            method, path, _ = lines[0].split(" ", 2)
            assert self.transport is not None
            if method == "GET" and path.startswith("/closes"):
                data_out = json.dumps({"closes": self.state.closes,
                                       "finished": self.state.finished}).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n" % len(data_out) + data_out)
                continue
            spec = json.loads(body or b"{}")
            self.task = asyncio.get_running_loop().create_task(self.stream(spec))

    async def stream(self, spec: dict[str, Any]) -> None:
        transport = self.transport
        assert transport is not None
        request_id = str(spec.get("id", "x"))
        self.request_id = request_id
        events = int(spec.get("events", 100))
        interval_s = float(spec.get("interval_ms", 10)) / 1000.0
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(events):
            if interval_s:
                delay = start + i * interval_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            await self.can_write.wait()
            if transport.is_closing():
                return
            data = chunk_bytes(request_id, i, token_text(i))
            transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        done = b"data: [DONE]\n\n"
        transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.state.finished[request_id] = time.monotonic_ns()


def run_upstream(port: int) -> None:
    raise_fd_limit()
    state = UpstreamState()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: UpstreamProtocol(state), "127.0.0.1", port,
                                          backlog=8192, reuse_address=True)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    _run(main())


# ---------------------------------------------------------------- client


class StreamResult:
    __slots__ = (
        "complete",
        "events",
        "first_event_at",
        "last_event_at",
        "latencies_ns",
        "started_at",
        "text",
    )

    def __init__(self) -> None:
        self.complete = False
        self.events = 0
        self.latencies_ns: list[int] = []
        self.text: list[str] = []
        self.last_event_at = 0
        self.first_event_at = 0
        self.started_at = time.monotonic_ns()


class RawConn:
    """A client socket read with plain ``recv`` calls of the size asked for.

    asyncio's StreamReader drains the kernel buffer into user space as fast as
    data comes, which would make every "slow reader" a fast one; this reads
    only when the scenario does, so a small SO_RCVBUF really pushes back.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.loop = asyncio.get_running_loop()

    async def read(self, size: int) -> bytes:
        if self.buffer:
            data, self.buffer = self.buffer[:size], self.buffer[size:]
            return data
        return await self.loop.sock_recv(self.sock, size)

    async def readuntil(self, separator: bytes) -> bytes:
        while separator not in self.buffer:
            data = await self.loop.sock_recv(self.sock, 65536)
            if not data:
                raise ConnectionError("closed before the response head")
            self.buffer += data
        end = self.buffer.index(separator) + len(separator)
        head, self.buffer = self.buffer[:end], self.buffer[end:]
        return head

    def close(self) -> None:
        self.sock.close()

    def reset(self) -> int:
        """Close with RST (SO_LINGER 0): what a killed phone app looks like."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        at = time.monotonic_ns()
        self.sock.close()
        return at


async def open_stream(host: str, port: int, spec: dict[str, Any], *, rcvbuf: int = 0) -> RawConn:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    body = json.dumps({"model": "bench", "stream": True, **spec}).encode()
    await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                            b"content-type: application/json\r\naccept: text/event-stream\r\n"
                            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                            % (str(spec["id"]).encode(), len(body), body))
    return RawConn(sock)


async def read_stream(reader: RawConn, result: StreamResult, *,
                      read_bytes: int = 65536, read_pause_s: float = 0.0,
                      stop_after_events: int = 0) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode("latin-1", "replace")[:200])
    parser = SSEParser()
    raw = b""
    while True:
        data = await reader.read(read_bytes)
        if not data:
            return
        now = time.monotonic_ns()
        raw += data
        # De-chunk whatever complete chunks are buffered.
        body = bytearray()
        while True:
            line_end = raw.find(b"\r\n")
            if line_end < 0:
                break
            size = int(raw[:line_end].split(b";")[0], 16)
            if len(raw) < line_end + 2 + size + 2:
                break
            body += raw[line_end + 2:line_end + 2 + size]
            raw = raw[line_end + 4 + size:]
            if size == 0:
                break
        for event in parser.feed(bytes(body)):
            if event.data is None:
                continue
            if event.data == "[DONE]":
                result.complete = True
                result.last_event_at = now
                return
            chunk = json.loads(event.data)
            if "error" in chunk:
                raise RuntimeError(event.data)
            fingerprint = chunk.get("system_fingerprint") or ""
            if fingerprint.startswith("t"):
                result.latencies_ns.append(now - int(fingerprint[1:]))
            result.events += 1
            result.text.append(chunk["choices"][0]["delta"].get("content", ""))
            if not result.first_event_at:
                result.first_event_at = now
            result.last_event_at = now
            if stop_after_events and result.events >= stop_after_events:
                return
        if read_pause_s:
            await asyncio.sleep(read_pause_s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize_ms(values_ns: list[int]) -> dict[str, float]:
    ms = [v / 1e6 for v in values_ns]
    return {"p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
            "mean_ms": round(statistics.fmean(ms), 3) if ms else float("nan"), "n": len(ms)}


async def fetch_json(host: str, port: int, path: str) -> Any:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: bench\r\n\r\n" % path.encode())
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    body = await reader.readexactly(length)
    writer.close()
    return json.loads(body)


async def scenario_throughput(host: str, port: int, streams: int, events: int,
                              interval_ms: float) -> dict[str, Any]:
    """``streams`` concurrent answers of ``events`` chunks every ``interval_ms``."""
    results = [StreamResult() for _ in range(streams)]
    interval_s = interval_ms / 1000.0

    async def one(i: int) -> None:
        # Spread the starts over one interval, as real traffic is not in lockstep.
        await asyncio.sleep(interval_s * i / streams)
        results[i].started_at = time.monotonic_ns()
        conn = await open_stream(host, port, {"id": f"t{i}", "events": events,
                                              "interval_ms": interval_ms})
        try:
            await read_stream(conn, results[i])
        finally:
            conn.close()

    started = time.monotonic_ns()
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    wall_s = (time.monotonic_ns() - started) / 1e9
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    delivered = sum(r.events for r in results)
    latencies = [v for r in results for v in r.latencies_ns]
    exact = sum("".join(r.text) == "".join(token_text(j) for j in range(events)) for r in results)
    return {
        "streams": streams, "events_per_stream": events, "interval_ms": interval_ms,
        "complete": sum(r.complete for r in results), "exact_text": exact,
        "delivered_events": delivered, "wall_s": round(wall_s, 3),
        "delivered_events_per_s": round(delivered / wall_s, 1),
        "latency": summarize_ms(latencies), "errors": errors[:5],
    }


async def scenario_reset(host: str, port: int, upstream_port: int, streams: int,
                         concurrency: int) -> dict[str, Any]:
    """Read a few events, reset, and see how long until the upstream's connection closes."""
    reset_at: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            request_id = f"r{i}-{os.getpid()}"
            conn = await open_stream(host, port, {"id": request_id, "events": 100000,
                                                  "interval_ms": 10})
            await read_stream(conn, StreamResult(), stop_after_events=3)
            reset_at[request_id] = conn.reset()
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(streams)))
    await asyncio.sleep(0.5)
    seen = await fetch_json("127.0.0.1", upstream_port, "/closes")
    closes: dict[str, int] = seen["closes"]
    delays = [closes[k] - v for k, v in reset_at.items() if k in closes]
    return {"streams": streams, "upstream_closed": len(delays),
            "reset_to_upstream_close": summarize_ms(delays)}


async def scenario_hold(host: str, port: int, streams: int, hold_s: float) -> dict[str, Any]:
    """Open ``streams`` long, quiet answers; hold them while the proxy's memory is read."""
    conns: list[RawConn] = []
    opened = 0

    async def one(i: int) -> None:
        nonlocal opened
        conn = await open_stream(host, port, {"id": f"h{i}", "events": 3,
                                              "interval_ms": 3_600_000})
        conns.append(conn)
        await read_stream(conn, StreamResult(), stop_after_events=1)
        opened += 1

    gate = asyncio.Semaphore(200)

    async def gated(i: int) -> None:
        async with gate:
            await one(i)

    await asyncio.gather(*(gated(i) for i in range(streams)), return_exceptions=True)
    print(json.dumps({"held": opened}), flush=True)
    await asyncio.sleep(hold_s)
    for conn in conns:
        conn.reset()
    return {"streams": streams, "opened": opened}


async def scenario_slow(host: str, port: int, upstream_port: int, streams: int, events: int,
                        read_bytes: int, read_pause_ms: float, rcvbuf: int) -> dict[str, Any]:
    """Slow readers: how late does the last token arrive after it was generated?"""
    results = [StreamResult() for _ in range(streams)]
    tag = f"s{os.getpid()}-{time.monotonic_ns()}"

    async def one(i: int) -> None:
        conn = await open_stream(host, port, {"id": f"{tag}-{i}", "events": events,
                                              "interval_ms": 1}, rcvbuf=rcvbuf)
        try:
            await read_stream(conn, results[i], read_bytes=read_bytes,
                              read_pause_s=read_pause_ms / 1000.0)
        finally:
            conn.close()

    await asyncio.gather(*(one(i) for i in range(streams)))
    seen = await fetch_json("127.0.0.1", upstream_port, "/closes")
    finished: dict[str, int] = seen["finished"]
    expected = "".join(token_text(j) for j in range(events))
    rows = []
    for i, r in enumerate(results):
        done_at = finished.get(f"{tag}-{i}")
        rows.append({
            "complete": r.complete, "exact_text": "".join(r.text) == expected, "events": r.events,
            "upstream_finished_s": None if done_at is None else round((done_at - r.started_at) / 1e9, 3),
            "last_token_s": round((r.last_event_at - r.started_at) / 1e9, 3),
            "last_token_after_generation_s": None if done_at is None
            else round((r.last_event_at - done_at) / 1e9, 3),
        })
    return {"streams": rows}


def _run(coro: Any) -> Any:
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upstream")
    up.add_argument("--port", type=int, required=True)
    client = sub.add_parser("client")
    client.add_argument("scenario", choices=["throughput", "reset", "hold", "slow"])
    client.add_argument("--target", required=True, help="HOST:PORT")
    client.add_argument("--upstream-port", type=int, default=0)
    client.add_argument("--streams", type=int, default=200)
    client.add_argument("--events", type=int, default=500)
    client.add_argument("--interval-ms", type=float, default=10)
    client.add_argument("--concurrency", type=int, default=20)
    client.add_argument("--hold-s", type=float, default=10)
    client.add_argument("--read-bytes", type=int, default=2048)
    client.add_argument("--read-pause-ms", type=float, default=100)
    client.add_argument("--rcvbuf", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.cmd == "upstream":
        run_upstream(args.port)
        return 0
    raise_fd_limit()
    host, _, port_text = args.target.rpartition(":")
    port = int(port_text)
    if args.scenario == "throughput":
        coro = scenario_throughput(host, port, args.streams, args.events, args.interval_ms)
    elif args.scenario == "reset":
        coro = scenario_reset(host, port, args.upstream_port, args.streams, args.concurrency)
    elif args.scenario == "hold":
        coro = scenario_hold(host, port, args.streams, args.hold_s)
    else:
        coro = scenario_slow(host, port, args.upstream_port, args.streams, args.events,
                             args.read_bytes, args.read_pause_ms, args.rcvbuf)
    print(json.dumps({"result": _run(coro)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
