"""HTTP/2 load clients for ``h2_bench.py``, one scenario per process.

An HTTP/2 connection is an ``asyncio.Protocol`` that reads frames by hand
(``H2Conn``: cheaper than any library, so the client is not what is measured);
each stream's DATA is read by ``sse_load.EventReader`` (the HTTP/1.1
benchmark's reader, fed the same bytes an HTTP/1.1 body would carry), so both
protocols are measured by one parser. The HTTP/1.1 path uses ``sse_load``'s own
client, over TLS here.

Scenarios (``python bench/h2_load.py SCENARIO --target HOST:PORT ...``), each
printing one ``{"result": ...}`` line:

* ``throughput``: S streams over C connections (HTTP/2) or S connections
  (``--h1``), E events every I ms each: completion, exact text, delivered
  events/s, latency from the upstream's send to the read (p50/p99).
* ``reset``: a stream reads 3 events, then RST_STREAM(CANCEL) (HTTP/2) or a
  TCP reset (``--h1``); the upstream's close time comes from its ``/closes``.
* ``stuck``: S streams on one connection, one of which never opens its window:
  the others' longest gap between events.
* ``rapid-reset``: N HEADERS+DATA+RST_STREAM streams as fast as one connection
  takes them, prebuilt frames; did a GOAWAY come, with which code, after how many.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import ssl
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_load import (
    EventReader,
    StreamClient,
    StreamResult,
    expected_text,
    fetch_json,
    raise_fd_limit,
    request_bytes,
    summarize_ms,
)

# The receive windows Chromium opens (a 6 MiB stream window, 15 MiB for the
# connection): a reader that keeps up is never held by flow control.
CHROME_STREAM_WINDOW_BYTES = 6 * 1024 * 1024
CHROME_CONNECTION_WINDOW_BYTES = 15 * 1024 * 1024


def _tls() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # a benchmark's own throwaway certificate
    return context


def _body(spec: dict[str, Any]) -> bytes:
    return json.dumps({"model": "bench", "stream": True, **spec}).encode()


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def split_frames(buffer: bytes) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """The whole frames at the head of ``buffer`` as (type, flags, stream id,
    payload), and what is left of it (a frame not yet whole)."""
    frames = []
    position = 0
    while len(buffer) - position >= 9:
        end = position + 9 + int.from_bytes(buffer[position:position + 3], "big")
        if end > len(buffer):
            break
        frames.append((buffer[position + 3], buffer[position + 4],
                       int.from_bytes(buffer[position + 5:position + 9], "big") & 0x7FFFFFFF,
                       buffer[position + 9:end]))
        position = end
    return frames, buffer[position:]


def control_reply(kind: int, flags: int, payload: bytes, out: list[bytes]) -> None:
    """A client's answer to the server's SETTINGS (ACK) and PING (ACK with its payload)."""
    if kind == 0x4 and not flags & 0x1:
        out.append(frame(0x4, 0x1, 0, b""))
    elif kind == 0x6 and not flags & 0x1:
        out.append(frame(0x6, 0x1, 0, payload))
# A request's header block from HPACK's static table and literals without
# indexing only, so one block serves every stream and no encoder state is kept.
REQUEST_BLOCK = (b"\x83"  # :method POST
                 b"\x87"  # :scheme https
                 b"\x04\x14/v1/chat/completions"  # :path
                 b"\x01\x05bench"  # :authority
                 b"\x0f\x10\x10application/json")  # content-type (static index 31)
_CREDIT_EVERY_BYTES = 1 << 20


class H2Conn(asyncio.Protocol):
    """One HTTP/2 client connection carrying many streams, read frame by frame.

    A measuring client must cost less than what it measures: requests are
    prebuilt frames, responses are split into frames by their 9-byte headers,
    DATA goes straight to the stream's ``EventReader``; response header blocks
    are not decoded (nothing here needs them), SETTINGS and PING are
    acknowledged, and windows are credited every MiB read, as a browser does.
    """

    def __init__(self, *, credit: Any = None, window_bytes: int = CHROME_STREAM_WINDOW_BYTES) -> None:
        self.readers: dict[int, EventReader] = {}
        self.done: dict[int, asyncio.Future[None]] = {}
        self.credit = credit or (lambda stream_id: True)
        self.window_bytes = window_bytes
        self.transport: asyncio.Transport | None = None
        self.goaway: int | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self._next_id = 1
        self._buffer = b""
        self._unacked: dict[int, int] = {}
        self._unacked_connection = 0
        self.data_times: dict[int, list[int]] | None = None
        """When set, the arrival time of every DATA frame, by stream."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = (0x4).to_bytes(2, "big") + self.window_bytes.to_bytes(4, "big")
        increment = (CHROME_CONNECTION_WINDOW_BYTES - 65_535).to_bytes(4, "big")
        self.transport.write(PREFACE + frame(0x4, 0, 0, settings) + frame(0x8, 0, 0, increment))
        self.ready.set_result(None)

    def open(self, spec: dict[str, Any], result: StreamResult, stop_after_events: int = 0) -> int:
        stream_id = self._next_id
        self._next_id += 2
        reader = EventReader(result, stop_after_events=stop_after_events)
        reader.feed(b"HTTP/1.1 200 OK\r\n\r\n", 0)
        self.readers[stream_id] = reader
        self.done[stream_id] = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(frame(0x1, 0x4, stream_id, REQUEST_BLOCK)
                             + frame(0x0, 0x1, stream_id, _body(spec)))
        return stream_id

    def credit_stream(self, stream_id: int, increment: int) -> None:
        assert self.transport is not None
        self.transport.write(frame(0x8, 0, stream_id, increment.to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        frames, self._buffer = split_frames(self._buffer + data if self._buffer else data)
        out: list[bytes] = []
        for kind, flags, stream_id, payload in frames:
            if kind == 0x0:
                self._on_data(stream_id, payload, now, out)
                if flags & 0x1:
                    self._finish(stream_id)
            elif (kind == 0x1 and flags & 0x1) or kind == 0x3:
                self._finish(stream_id)
            else:
                control_reply(kind, flags, payload, out)
                if kind == 0x7:
                    self.goaway = int.from_bytes(payload[4:8], "big")
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _on_data(self, stream_id: int, payload: bytes, now: int, out: list[bytes]) -> None:
        reader = self.readers.get(stream_id)
        if self.data_times is not None and payload:
            self.data_times.setdefault(stream_id, []).append(now)
        if reader is not None and payload:
            try:
                if reader.feed(b"%x\r\n%b\r\n" % (len(payload), payload), now):
                    self._finish(stream_id)
            except Exception as error:
                self._finish(stream_id, error)
        self._unacked_connection += len(payload)
        if self._unacked_connection >= _CREDIT_EVERY_BYTES:
            out.append(frame(0x8, 0, 0, self._unacked_connection.to_bytes(4, "big")))
            self._unacked_connection = 0
        if self.credit(stream_id):
            unacked = self._unacked.get(stream_id, 0) + len(payload)
            if unacked >= _CREDIT_EVERY_BYTES:
                out.append(frame(0x8, 0, stream_id, unacked.to_bytes(4, "big")))
                unacked = 0
            self._unacked[stream_id] = unacked

    def _finish(self, stream_id: int, error: BaseException | None = None) -> None:
        future = self.done.get(stream_id)
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def reset(self, stream_id: int) -> int:
        assert self.transport is not None
        self.transport.write(frame(0x3, 0, stream_id, (8).to_bytes(4, "big")))  # CANCEL
        return time.monotonic_ns()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream_id in list(self.done):
            self._finish(stream_id)


async def connect(host: str, port: int, **options: Any) -> H2Conn:
    loop = asyncio.get_running_loop()
    context = _tls()
    context.set_alpn_protocols(["h2"])
    _, protocol = await loop.create_connection(lambda: H2Conn(**options), host, port, ssl=context,
                                               server_hostname="localhost")
    await protocol.ready
    return protocol


def _summary(results: list[StreamResult], events: int, wall_s: float) -> dict[str, Any]:
    texts = [r.text_bytes for r in results]
    delivered = sum(r.events for r in results)
    return {"streams": len(results), "complete": sum(r.complete for r in results),
            "exact_text": sum(text == expected_text(events) for text in texts),
            "delivered_events": delivered, "wall_s": round(wall_s, 3),
            "delivered_events_per_s": round(delivered / wall_s, 1),
            "latency": summarize_ms([v for r in results for v in r.latencies_ns])}


async def throughput(host: str, port: int, *, streams: int, connections: int, events: int,
                     interval_ms: float, h1: bool) -> dict[str, Any]:
    results = [StreamResult() for _ in range(streams)]
    loop = asyncio.get_running_loop()
    interval_s = interval_ms / 1000.0
    conns = [] if h1 else [await connect(host, port) for _ in range(connections)]

    async def one(i: int) -> None:
        await asyncio.sleep(interval_s * i / streams)
        results[i].started_at = time.monotonic_ns()
        spec = {"id": f"t{i}", "events": events, "interval_ms": interval_ms}
        if h1:
            done: asyncio.Future[None] = loop.create_future()
            transport, _ = await loop.create_connection(
                lambda: StreamClient(request_bytes(spec), EventReader(results[i]), done), host, port,
                ssl=_tls(), server_hostname="localhost")
            try:
                await done
            finally:
                transport.close()
        else:
            conn = conns[i % connections]
            await conn.done[conn.open(spec, results[i])]

    started = time.monotonic_ns()
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    summary = _summary(results, events, (time.monotonic_ns() - started) / 1e9)
    summary["errors"] = sorted({repr(o)[:200] for o in outcomes if isinstance(o, BaseException)})[:5]
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()
    return summary


class ResettingClient(StreamClient):
    """An HTTP/1.1 stream that resets its TCP connection (SO_LINGER 0) after a few events."""

    def __init__(self, request: bytes, result: StreamResult, done: asyncio.Future[None]) -> None:
        super().__init__(request, EventReader(result, stop_after_events=3), done)
        self.result = result
        self.reset_at = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.result.events >= 3 and not self.reset_at and self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.reset_at = time.monotonic_ns()
            self.transport.abort()


async def reset(host: str, port: int, upstream_port: int, *, streams: int, h1: bool) -> dict[str, Any]:
    """Read 3 events, cancel (RST_STREAM, or a TCP reset with ``h1``); the upstream's close, after."""
    reset_at: dict[str, int] = {}
    conn = None if h1 else await connect(host, port)
    loop = asyncio.get_running_loop()
    for i in range(streams):
        request_id = f"rst{i}-{'h1' if h1 else 'h2'}-{port}"
        spec = {"id": request_id, "events": 100000, "interval_ms": 10}
        result = StreamResult()
        if conn is not None:
            stream_id = conn.open(spec, result, stop_after_events=3)
            await conn.done[stream_id]
            reset_at[request_id] = conn.reset(stream_id)
        else:
            done: asyncio.Future[None] = loop.create_future()
            client = ResettingClient(request_bytes(spec), result, done)
            await loop.create_connection(lambda client=client: client, host, port, ssl=_tls(),
                                         server_hostname="localhost")
            await done
            reset_at[request_id] = client.reset_at
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    closes: dict[str, int] = (await fetch_json("127.0.0.1", upstream_port, "/closes"))["closes"]
    delays = [closes[k] - v for k, v in reset_at.items() if k in closes and v]
    return {"streams": streams, "upstream_closed": len(delays),
            "reset_to_upstream_close": summarize_ms(delays)}


async def stuck(host: str, port: int, *, streams: int, events: int, interval_ms: float) -> dict[str, Any]:
    """One connection; stream 1 never credits its window; the rest's longest gaps."""
    results = [StreamResult() for _ in range(streams)]
    stuck_ids: set[int] = set()
    conn = await connect(host, port, credit=lambda stream_id: stream_id not in stuck_ids, window_bytes=4096)
    gaps_ms: list[float] = []
    times: dict[int, list[int]] = {}
    conn.data_times = times
    ids = []
    for i in range(streams):
        spec = {"id": f"stuck{i}-{port}", "events": events if i else 100000, "interval_ms": interval_ms}
        stream_id = conn.open(spec, results[i])
        if i == 0:
            stuck_ids.add(stream_id)  # its 4 KiB window is never opened further
        else:
            conn.credit_stream(stream_id, CHROME_STREAM_WINDOW_BYTES - 4096)
        ids.append(stream_id)
    await asyncio.gather(*(conn.done[stream_id] for stream_id in ids[1:]))
    for stream_id, series in times.items():
        if stream_id not in stuck_ids:
            gaps_ms += [(b - a) / 1e6 for a, b in itertools.pairwise(series)]
    assert conn.transport is not None
    conn.transport.close()
    others = results[1:]
    return {"streams": streams, "others_complete": sum(r.complete for r in others),
            "upstream_gap_ms": interval_ms, "others_longest_gap_ms": round(max(gaps_ms), 2),
            "others_gap_p99_ms": round(sorted(gaps_ms)[int(0.99 * (len(gaps_ms) - 1))], 2),
            "stuck_events": results[0].events}


async def rapid_reset(host: str, port: int, *, pairs: int) -> dict[str, Any]:
    """HEADERS (END_STREAM) + RST_STREAM(CANCEL) pairs, prebuilt, as fast as the
    socket takes them. The header block uses only HPACK's static table and
    literals without indexing, so one block serves every stream."""
    conn = await connect(host, port)
    block = (b"\x83"  # :method POST
             b"\x87"  # :scheme https
             b"\x04\x14/v1/chat/completions"  # :path, literal without indexing
             b"\x01\x05bench")  # :authority
    transport = conn.transport
    assert transport is not None
    sent = 0
    started = time.monotonic()
    batch: list[bytes] = []
    for i in range(pairs):
        stream_id = 1 + 2 * i
        body = b'{"id":"rr%d","events":100,"interval_ms":10}' % i
        batch.append(frame(0x1, 0x4, stream_id, block) + frame(0x0, 0x1, stream_id, body)
                     + frame(0x3, 0x0, stream_id, b"\x00\x00\x00\x08"))
        if len(batch) == 500 or i == pairs - 1:
            if transport.is_closing():
                break
            transport.write(b"".join(batch))
            sent += len(batch)
            batch = []
            await asyncio.sleep(0)  # let reads (a GOAWAY) in
            while transport.get_write_buffer_size() > 1 << 20 and not transport.is_closing():
                await asyncio.sleep(0.001)
    deadline = time.monotonic() + 10
    while conn.goaway is None and not transport.is_closing() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return {"pairs_offered": pairs, "pairs_written": sent, "goaway_code": conn.goaway,
            "wall_s": round(time.monotonic() - started, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["throughput", "reset", "stuck", "rapid-reset"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--upstream-port", type=int, default=0)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--interval-ms", type=float, default=10)
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--h1", action="store_true")
    args = parser.parse_args()
    raise_fd_limit()
    host, port = args.target.rsplit(":", 1)
    if args.scenario == "throughput":
        coro: Any = throughput(host, int(port), streams=args.streams, connections=args.connections,
                               events=args.events, interval_ms=args.interval_ms, h1=args.h1)
    elif args.scenario == "reset":
        coro = reset(host, int(port), args.upstream_port, streams=args.streams, h1=args.h1)
    elif args.scenario == "stuck":
        coro = stuck(host, int(port), streams=args.streams, events=args.events, interval_ms=args.interval_ms)
    else:
        coro = rapid_reset(host, int(port), pairs=args.pairs)
    try:
        import uvloop

        result = uvloop.run(coro)
    except ImportError:
        result = asyncio.run(coro)
    print(json.dumps({"result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
