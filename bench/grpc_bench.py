"""gRPC vs SSE through one sidecar, side by side in one run.

Method (figures in docs/perf/http2-grpc.md, "gRPC"):

* One paced fake upstream (``sse_load.py upstream``), one sidecar process
  (``tokenwire sidecar``, HTTP/1.1 and HTTP/2 on one port) and one nginx
  (one worker, ``listen ... http2``: HTTP/2 in plaintext) in front of it.
* ``throughput``: 200 concurrent streams x E chunks every 10 ms (100 messages/s
  each), six ways, one after the other, repeated ``--rounds`` times:
  ``direct`` (SSE straight from the upstream: the latency floor), ``sse`` (SSE
  through the sidecar, HTTP/1.1, ``sse_load.py client``), ``h2_sse`` and
  ``nginx_h2_sse`` (the same answer over HTTP/2 through the sidecar and
  through nginx), ``grpc`` (``tokenwire.v1.ChatCompletions/Create`` through
  the sidecar) and ``grpcio`` (the same calls from grpc.aio). The HTTP/2 paths
  use 10 connections of 20 streams each; all but grpcio's use one lean client
  that reads frames by hand (``RawGrpcConnection``), in its own process.
  Each chunk carries its send time (``time.monotonic_ns()``, one clock for all
  processes on the machine), which the gRPC message keeps in ``chunk_json``:
  latency = client read time - send time of the message's first token; added
  latency = a path's p50 (p99) - direct's p50 (p99). Delivered events/s,
  exact text per stream, the proxy's CPU per delivered event (its
  ``/proc`` time) and the client's; the ratios HTTP/2 CPU / nginx's and
  gRPC CPU / HTTP/2 SSE's.
* ``cancel``: a client reads 3 messages and cancels the call (gRPC:
  RST_STREAM CANCEL; SSE: a TCP reset), 100 times one at a time (the
  propagation alone) and 200 times 50 at a time (under 5,000 messages/s); the
  time from the cancel to the upstream seeing its connection closed (p50/p99).

Usage: ``python bench/grpc_bench.py [--rounds 3 --streams 200 --events 300 --out grpc.json]``;
writes ``bench/results/grpc.json``. ``python bench/grpc_bench.py client ...`` is the
gRPC load client (run by the benchmark itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))
import h2_load
import sidecar_bench as sb
import sse_load

from testbed import targets

METHOD = "/tokenwire.v1.ChatCompletions/Create"
_STAMP_RE = re.compile(rb'"system_fingerprint":"t(\d+)"')
_CONTENT_RE = re.compile(rb'"content":"((?:[^"\\]|\\.)*)"')


def _request(spec: dict[str, Any]) -> bytes:
    from tokenwire.v1 import streaming_pb2 as pb

    return pb.ChatCompletionRequest(model="bench", extra_json=json.dumps(spec)).SerializeToString()


def _channels(target: str, count: int) -> list[Any]:
    import grpc.aio

    # One connection per channel (grpc would otherwise share one subchannel).
    return [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(count)]


class RawGrpcConnection(asyncio.Protocol):
    """A lean gRPC client connection, read frame by frame as ``h2_load.H2Conn``
    reads SSE (h2's state machine cost this client 29 µs an event, more than
    the sidecar it measured, and its queueing showed up as the sidecar's
    latency tail). Requests are HPACK-encoded (hpack, one encoder per
    connection), response header blocks decoded only for the trailers' status;
    the windows are opened wide at the start, so nothing is credited later."""

    def __init__(self) -> None:
        import hpack

        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.transport: asyncio.Transport | None = None
        self.buffers: dict[int, bytearray] = {}
        self.on_message: dict[int, Any] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.sse: set[int] = set()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._next_id = 1
        self._pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        wide = (1 << 31) - 1
        settings = (0x4).to_bytes(2, "big") + wide.to_bytes(4, "big")  # INITIAL_WINDOW_SIZE
        self.transport.write(h2_load.PREFACE + h2_load.frame(0x4, 0, 0, settings)
                             + h2_load.frame(0x8, 0, 0, (wide - 65_535).to_bytes(4, "big")))
        self.ready.set_result(None)

    def call(self, payload: bytes, on_message: Any, *,
             sse: bool = False) -> tuple[int, asyncio.Future[bytes]]:
        """A gRPC call (``payload``: the request message), or with ``sse`` the same
        answer as SSE over HTTP/2 (``payload``: the JSON body): the HTTP/2 listener
        without the transcoder."""
        stream_id = self._next_id
        self._next_id += 2
        if sse:
            headers = [(b":method", b"POST"), (b":path", b"/v1/chat/completions"), (b":scheme", b"http"),
                       (b":authority", b"bench"), (b"content-type", b"application/json"),
                       (b"accept", b"text/event-stream")]
            body = payload
            self.sse.add(stream_id)
        else:
            headers = [(b":method", b"POST"), (b":path", METHOD.encode()), (b":scheme", b"http"),
                       (b":authority", b"bench"), (b"content-type", b"application/grpc"),
                       (b"te", b"trailers")]
            body = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self.buffers[stream_id] = bytearray()
        self.on_message[stream_id] = on_message
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.ended[stream_id] = done
        assert self.transport is not None
        self.transport.write(h2_load.frame(0x1, 0x4, stream_id, self.encoder.encode(headers))
                             + h2_load.frame(0x0, 0x1, stream_id, body))
        return stream_id, done

    def cancel(self, stream_id: int) -> None:
        assert self.transport is not None
        self.transport.write(h2_load.frame(0x3, 0, stream_id, (8).to_bytes(4, "big")))  # CANCEL

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        frames, self._pending = h2_load.split_frames(self._pending + data if self._pending else data)
        out: list[bytes] = []
        for kind, flags, stream_id, payload in frames:
            if kind == 0x0:
                assert not flags & 0x8, "padded DATA"  # neither proxy pads; a pad would be read as data
                self._on_data(stream_id, payload, now)
                if flags & 0x1 and stream_id in self.sse:
                    self._end(stream_id, b"0")
            elif kind == 0x1:
                assert flags & 0x4 and not flags & 0x28, "one unpadded header block a frame"
                headers = dict(self.decoder.decode(payload, raw=True))
                if flags & 0x1:  # trailers (or a trailers-only answer)
                    self._end(stream_id, headers.get(b"grpc-status", b"0" if stream_id in self.sse else b"?"))
            elif kind == 0x3:
                self._end(stream_id, b"reset")
            elif kind == 0x7:  # GOAWAY: the streams past its last id will not be answered
                last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                for open_id in [i for i in self.ended if i > last]:
                    self._end(open_id, b"goaway")
            else:
                h2_load.control_reply(kind, flags, payload, out)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _on_data(self, stream_id: int, payload: bytes, now: int) -> None:
        buffer = self.buffers.get(stream_id)
        if buffer is None:
            return
        buffer += payload
        on_message = self.on_message[stream_id]
        if stream_id in self.sse:
            end = buffer.rfind(b"\n\n")
            if end >= 0:
                for block in bytes(buffer[:end]).split(b"\n\n"):
                    # A heartbeat comment line may precede an event in its block.
                    if b"data: {" in block:
                        on_message(block, now)
                del buffer[:end + 2]
            return
        while len(buffer) >= 5:
            length = int.from_bytes(buffer[1:5], "big")
            if len(buffer) < 5 + length:
                break
            on_message(bytes(buffer[5:5 + length]), now)
            del buffer[:5 + length]

    def connection_lost(self, exc: Exception | None) -> None:
        # An error in data_received lands here too: every open stream ends, none waits.
        for stream_id in list(self.ended):
            self._end(stream_id, b"lost")

    def _end(self, stream_id: int, status: bytes) -> None:
        done = self.ended.pop(stream_id, None)
        self.buffers.pop(stream_id, None)
        if done is not None and not done.done():
            done.set_result(status)


async def _raw_connections(target: str, count: int) -> list[RawGrpcConnection]:
    host, port = target.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(count):
        _, protocol = await loop.create_connection(RawGrpcConnection, host, int(port))
        await protocol.ready
        connections.append(protocol)
    return connections


async def raw_throughput(target: str, streams: int, events: int, interval_ms: float,
                         connections: int, sse: bool = False) -> dict[str, Any]:
    conns = await _raw_connections(target, connections)
    results = [sse_load.StreamResult() for _ in range(streams)]
    codes: list[bytes] = []
    interval_s = interval_ms / 1000.0

    async def one(i: int) -> None:
        await asyncio.sleep(interval_s * i / streams)
        result = results[i]
        result.started_at = time.monotonic_ns()

        def on_message(raw: bytes, now: int) -> None:
            stamp = _STAMP_RE.search(raw)
            if stamp is not None:
                result.latencies_ns.append(now - int(stamp[1]))
            content = _CONTENT_RE.search(raw)
            if content is not None:
                result.text.append(content[1])
            result.events += 1

        spec = {"id": f"g{i}", "events": events, "interval_ms": interval_ms}
        payload = json.dumps({"model": "bench", "stream": True, **spec}).encode() if sse else _request(spec)
        _, done = conns[i % connections].call(payload, on_message, sse=sse)
        codes.append(await done)
        result.complete = True

    started = time.monotonic_ns()
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    wall_s = (time.monotonic_ns() - started) / 1e9
    return _throughput_result(results, [c.decode() for c in codes], outcomes, wall_s, streams, events,
                              interval_ms, ok="0")


async def raw_cancel(target: str, upstream_port: int, streams: int, concurrency: int) -> dict[str, Any]:
    conns = await _raw_connections(target, 10)
    cancelled_at: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        async with gate:
            request_id = f"gc{i}-{time.monotonic_ns()}"
            third: asyncio.Future[None] = loop.create_future()
            seen = [0]

            def on_message(raw: bytes, now: int) -> None:
                seen[0] += 1
                if seen[0] == 3 and not third.done():
                    third.set_result(None)

            conn = conns[i % len(conns)]
            stream_id, _ = conn.call(_request({"id": request_id, "events": 100000, "interval_ms": 10}),
                                     on_message)
            await third
            conn.buffers.pop(stream_id, None)
            conn.cancel(stream_id)
            cancelled_at[request_id] = time.monotonic_ns()
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(streams)))
    await asyncio.sleep(0.5)
    closes = (await sse_load.fetch_json("127.0.0.1", upstream_port, "/closes"))["closes"]
    delays = [closes[k] - v for k, v in cancelled_at.items() if k in closes]
    return {"streams": streams, "upstream_closed": len(delays),
            "cancel_to_upstream_close": sse_load.summarize_ms(delays)}


def _throughput_result(results: list[Any], codes: list[str], outcomes: list[Any], wall_s: float,
                       streams: int, events: int, interval_ms: float, ok: str) -> dict[str, Any]:
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    delivered_events = max(sum(r.events for r in results), 1)
    client_cpu_us = round(time.process_time() / delivered_events * 1e6, 2)
    expected = sse_load.expected_text(events)
    texts = [r.text_bytes for r in results]
    delivered = sum(r.events for r in results)
    return {
        "streams": streams, "events_per_stream": events, "interval_ms": interval_ms,
        "complete": sum(r.complete for r in results), "ok": codes.count(ok),
        "exact_text": sum(text == expected for text in texts), "delivered_events": delivered,
        "wall_s": round(wall_s, 3), "delivered_events_per_s": round(delivered / wall_s, 1),
        "latency": sse_load.summarize_ms([v for r in results for v in r.latencies_ns]),
        "steady_latency": sse_load.summarize_ms(sse_load.steady_latencies(results)),
        "start_latency": sse_load.summarize_ms(sse_load.steady_latencies(results, start=True)),
        "client_cpu_us_per_event": client_cpu_us, "errors": errors[:5],
    }


async def grpc_throughput(target: str, streams: int, events: int, interval_ms: float,
                          connections: int) -> dict[str, Any]:
    channels = _channels(target, connections)
    calls = [channel.unary_stream(METHOD) for channel in channels]  # raw bytes in and out
    results = [sse_load.StreamResult() for _ in range(streams)]
    codes: list[str] = []
    interval_s = interval_ms / 1000.0

    async def one(i: int) -> None:
        await asyncio.sleep(interval_s * i / streams)
        result = results[i]
        result.started_at = time.monotonic_ns()
        call = calls[i % connections](_request({"id": f"g{i}", "events": events, "interval_ms": interval_ms}))
        async for raw in call:
            now = time.monotonic_ns()
            stamp = _STAMP_RE.search(raw)
            if stamp is not None:
                result.latencies_ns.append(now - int(stamp[1]))
            content = _CONTENT_RE.search(raw)
            if content is not None:
                result.text.append(content[1])
            result.events += 1
        codes.append(str(await call.code()))
        result.complete = True

    started = time.monotonic_ns()
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    wall_s = (time.monotonic_ns() - started) / 1e9
    for channel in channels:
        await channel.close()
    return _throughput_result(results, codes, outcomes, wall_s, streams, events, interval_ms,
                              ok="StatusCode.OK")


async def grpc_cancel(target: str, upstream_port: int, streams: int, concurrency: int) -> dict[str, Any]:
    channels = _channels(target, 10)
    calls = [channel.unary_stream(METHOD) for channel in channels]
    cancelled_at: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            request_id = f"gc{i}-{time.monotonic_ns()}"
            call = calls[i % len(calls)](_request({"id": request_id, "events": 100000, "interval_ms": 10}))
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 3:
                    break
            cancelled_at[request_id] = time.monotonic_ns()
            call.cancel()
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(streams)))
    await asyncio.sleep(0.5)
    for channel in channels:
        await channel.close()
    closes = (await sse_load.fetch_json("127.0.0.1", upstream_port, "/closes"))["closes"]
    delays = [closes[k] - v for k, v in cancelled_at.items() if k in closes]
    return {"streams": streams, "upstream_closed": len(delays),
            "cancel_to_upstream_close": sse_load.summarize_ms(delays)}


def grpc_client(scenario: str, target_port: int, upstream_port: int, args: list[str]) -> dict[str, Any]:
    cmd = [targets.PY, __file__, "client", scenario, "--target", f"127.0.0.1:{target_port}",
           "--upstream-port", str(upstream_port), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in run.stdout.splitlines():
        if line.startswith('{"result"'):
            result: dict[str, Any] = json.loads(line)["result"]
            return result
    raise RuntimeError(f"grpc {scenario}: exit {run.returncode}, no result in {run.stdout[-500:]!r}; "
                       f"stderr {run.stderr[-2000:]}")


def run(rounds: int, streams: int, events: int, interval_ms: float) -> dict[str, Any]:
    upstream_port, sidecar_port = targets.free_port(), targets.free_port()
    load = ["--streams", str(streams), "--events", str(events), "--interval-ms", str(interval_ms)]
    nginx_port = targets.free_port()
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "sse": [], "h2_sse": [], "nginx_h2_sse": [],
                                             "grpc": [], "grpcio": []}
    with (targets.fake_upstream(upstream_port), targets.sidecar(sidecar_port, upstream_port) as side,
          targets.nginx(nginx_port, upstream_port, h2c=True) as nginx):
        nginx_pid = targets.nginx_worker_pid(nginx)

        def measured(result_of: Any, pid: int = side.pid) -> dict[str, Any]:
            """One run, with the proxy's CPU seconds per delivered event."""
            before = targets.cpu_seconds(pid)
            result: dict[str, Any] = result_of()
            used_s = targets.cpu_seconds(pid) - before
            result["proxy_cpu_us_per_event"] = round(used_s / max(result["delivered_events"], 1) * 1e6, 2)
            return result

        for _ in range(rounds):
            runs["direct"].append(sb.client("throughput", upstream_port, upstream_port, *load))
            runs["nginx_h2_sse"].append(measured(lambda: grpc_client(
                "h2-sse-throughput", nginx_port, upstream_port, [*load, "--connections", "10"]), nginx_pid))
            runs["sse"].append(measured(lambda: sb.client("throughput", sidecar_port, upstream_port, *load)))
            runs["h2_sse"].append(measured(lambda: grpc_client(
                "h2-sse-throughput", sidecar_port, upstream_port, [*load, "--connections", "10"])))
            runs["grpc"].append(measured(lambda: grpc_client("throughput", sidecar_port, upstream_port,
                                                             [*load, "--connections", "10"])))
            runs["grpcio"].append(measured(lambda: grpc_client(
                "grpcio-throughput", sidecar_port, upstream_port, [*load, "--connections", "10"])))
        cancel: dict[str, Any] = {}
        for concurrency in (1, 50):
            # 1: one stream at a time (the propagation alone); 50: 50 streams of 100 msgs/s open.
            count = ["--streams", "100" if concurrency == 1 else "200", "--concurrency", str(concurrency)]
            cancel[f"concurrency_{concurrency}"] = {
                "sse": sb.client("reset", sidecar_port, upstream_port, *count),
                "grpc": grpc_client("cancel", sidecar_port, upstream_port, count),
                "grpcio": grpc_client("grpcio-cancel", sidecar_port, upstream_port, count),
            }

    def median(path: str, key: str) -> float:
        return statistics.median(float(r["latency"][key]) if key.endswith("_ms") else float(r[key])
                                 for r in runs[path])

    summary: dict[str, Any] = {}
    for path in runs:
        summary[path] = {
            "delivered_events_per_s": median(path, "delivered_events_per_s"),
            "latency_p50_ms": median(path, "p50_ms"), "latency_p99_ms": median(path, "p99_ms"),
            "steady_p99_ms": statistics.median(r["steady_latency"]["p99_ms"] for r in runs[path]),
            "start_p99_ms": statistics.median(r["start_latency"]["p99_ms"] for r in runs[path]),
            "complete": [r["complete"] for r in runs[path]],
            "exact_text": [r["exact_text"] for r in runs[path]],
        }
        if path != "direct":
            summary[path]["proxy_cpu_us_per_event"] = median(path, "proxy_cpu_us_per_event")
    direct_p50 = summary["direct"]["latency_p50_ms"]
    for path in ("sse", "h2_sse", "nginx_h2_sse", "grpc", "grpcio"):
        summary[path]["added_p50_ms"] = round(summary[path]["latency_p50_ms"] - direct_p50, 3)
        summary[path]["added_p99_ms"] = round(summary[path]["latency_p99_ms"]
                                              - summary["direct"]["latency_p99_ms"], 3)
    h2_cpu = summary["h2_sse"]["proxy_cpu_us_per_event"]
    nginx_cpu = summary["nginx_h2_sse"]["proxy_cpu_us_per_event"]
    summary["h2_sse_cpu_over_nginx_h2"] = round(h2_cpu / max(nginx_cpu, 1e-9), 3)
    summary["grpc_cpu_over_h2_sse"] = round(summary["grpc"]["proxy_cpu_us_per_event"] / max(h2_cpu, 1e-9), 3)
    summary["grpc_over_sse_events_per_s"] = round(
        summary["grpc"]["delivered_events_per_s"] / summary["sse"]["delivered_events_per_s"], 4)
    sse_added = summary["sse"]["added_p50_ms"]
    summary["grpc_added_p50_over_sse"] = (round(summary["grpc"]["added_p50_ms"] / sse_added, 3)
                                          if sse_added > 0 else None)
    return {"rounds": runs, "summary": summary, "cancel": cancel}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("scenario", choices=["throughput", "cancel", "grpcio-throughput", "grpcio-cancel",
                                                    "h2-sse-throughput"])
    client.add_argument("--target", required=True)
    client.add_argument("--upstream-port", type=int, default=0)
    client.add_argument("--streams", type=int, default=200)
    client.add_argument("--events", type=int, default=300)
    client.add_argument("--interval-ms", type=float, default=10)
    client.add_argument("--connections", type=int, default=10)
    client.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--interval-ms", type=float, default=10)
    parser.add_argument("--out", default="grpc.json", help="file name under bench/results")
    args = parser.parse_args()
    if args.command == "client":
        sse_load.raise_fd_limit()
        coro: Any
        if args.scenario == "throughput":
            coro = raw_throughput(args.target, args.streams, args.events, args.interval_ms, args.connections)
        elif args.scenario == "h2-sse-throughput":
            coro = raw_throughput(args.target, args.streams, args.events, args.interval_ms, args.connections,
                                  sse=True)
        elif args.scenario == "grpcio-throughput":
            coro = grpc_throughput(args.target, args.streams, args.events, args.interval_ms, args.connections)
        elif args.scenario == "cancel":
            coro = raw_cancel(args.target, args.upstream_port, args.streams, args.concurrency)
        else:
            coro = grpc_cancel(args.target, args.upstream_port, args.streams, args.concurrency)
        # grpc.aio runs on the standard asyncio loop (not uvloop).
        print(json.dumps({"result": asyncio.run(coro)}), flush=True)
        return 0
    results = run(args.rounds, args.streams, args.events, args.interval_ms)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sb.RESULTS.mkdir(parents=True, exist_ok=True)
    (sb.RESULTS / args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"summary": results["summary"], "cancel": results["cancel"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
