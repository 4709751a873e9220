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
import heapq
import itertools
import json
import math
import os
import re
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

from tokenwire.middleware.core.sse import SSEParser


def raise_fd_limit(wanted: int = 65536) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, min(wanted, hard if hard != resource.RLIM_INFINITY else wanted))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


# One OpenAI chat chunk, exactly as ``json.dumps(..., separators=(",", ":"))``
# writes it, built with bytes formatting (the upstream makes 20,000 a second).
# The send time (``time.monotonic_ns()``) rides in ``system_fingerprint``, which
# a proxy that merges chunks keeps from the first one.
_CHUNK_HEAD = b'data: {"id":"%s","object":"chat.completion.chunk","created":1764460800,' \
              b'"model":"bench","system_fingerprint":"t'
_CHUNK_TAIL = b'","choices":[{"index":0,"delta":{"content":" w%d"},"finish_reason":null}]}\n\n'
_DONE = b"data: [DONE]\n\n"


def chunk_bytes(request_id: str, index: int) -> bytes:
    """One chunk of stream ``request_id``, stamped with the time now."""
    return (_CHUNK_HEAD % request_id.encode() + b"%d" % time.monotonic_ns()
            + _CHUNK_TAIL % index)


def token_text(index: int) -> str:
    return f" w{index}"


def expected_text(events: int) -> bytes:
    return "".join(token_text(j) for j in range(events)).encode()


# ---------------------------------------------------------------- upstream

# The upstream's one timer fires at most this often. Events fall due on each
# stream's own schedule (its start + i x interval, so streams are not in
# lockstep); a tick writes every event due by then, each stamped when written.
TICK_S = 0.001


class UpstreamState:
    """What the fake upstream saw, served at ``GET /closes`` for the benchmark."""

    def __init__(self) -> None:
        self.closes: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        # The proxy's port of each stream's connection (for a packet-level trace).
        self.peers: dict[str, int] = {}


class PacedStream:
    """One answer being generated: ``events`` chunks, one every ``interval_s``."""

    __slots__ = ("done", "events", "head", "interval_s", "next_index", "obfuscate", "parked", "protocol",
                 "request_id", "start")

    def __init__(self, protocol: UpstreamProtocol, request_id: str, events: int,
                 interval_s: float, start: float, obfuscate: bool = False) -> None:
        """``obfuscate``: a constant fingerprint and OpenAI's random-length
        ``obfuscation`` padding on every chunk instead of the per-chunk stamp."""
        self.obfuscate = obfuscate
        self.protocol = protocol
        self.request_id = request_id
        self.head = _CHUNK_HEAD % request_id.encode()
        self.events = events
        self.interval_s = interval_s
        self.start = start
        self.next_index = 0
        self.parked = False
        self.done = False

    def due_at(self) -> float:
        return self.start + self.next_index * self.interval_s

    def write_due(self, now: float) -> float | None:
        """Write every event due by ``now`` (one write); the next due time, or
        None when finished, closed or parked (paused; ``resume`` re-adds it)."""
        protocol = self.protocol
        transport = protocol.transport
        if self.done or transport is None or transport.is_closing():
            return None
        if protocol.paused:
            self.parked = True
            return None
        parts = []
        head, tail, interval_s, start = self.head, _CHUNK_TAIL, self.interval_s, self.start
        i, events = self.next_index, self.events
        while i < events and start + i * interval_s <= now:
            stamp = (b'0","obfuscation":"' + b"x" * (i * 7 % 16 + 1) if self.obfuscate
                     else b"%d" % time.monotonic_ns())
            data = head + stamp + tail % i
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
            i += 1
        self.next_index = i
        if i >= events:
            parts.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(_DONE), _DONE))
            self.done = True
        transport.write(b"".join(parts))
        if self.done:
            protocol.state.finished[self.request_id] = time.monotonic_ns()
            protocol.stream_finished()
            return None
        return start + i * interval_s


class Ticker:
    """The upstream's single timer: a heap of (due time, stream), popped every tick."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._heap: list[tuple[float, int, PacedStream]] = []
        self._order = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._wake_at = math.inf
        self._last_tick = -math.inf

    def add(self, stream: PacedStream) -> None:
        due = stream.due_at()
        heapq.heappush(self._heap, (due, next(self._order), stream))
        if due < self._wake_at:
            self._arm(due)

    def _arm(self, at: float) -> None:
        at = max(at, self._last_tick + TICK_S)
        if self._handle is not None:
            self._handle.cancel()
        self._wake_at = at
        self._handle = self._loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self._handle = None
        self._wake_at = math.inf
        now = self._last_tick = self._loop.time()
        heap, order = self._heap, self._order
        while heap and heap[0][0] <= now:
            stream = heapq.heappop(heap)[2]
            due = stream.write_due(now)
            if due is not None:
                heapq.heappush(heap, (due, next(order), stream))
        if heap:
            self._arm(heap[0][0])


class UpstreamProtocol(asyncio.Protocol):
    """POST body JSON ``{"id", "events", "interval_ms"}`` streams that many chunks.

    ``connection_lost`` records the time a stream's connection closed before
    it finished: the far end of the reset-propagation measurement.
    """

    def __init__(self, state: UpstreamState, ticker: Ticker) -> None:
        self.state = state
        self.ticker = ticker
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.stream: PacedStream | None = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        stream = self.stream
        if stream is not None and stream.parked:
            stream.parked = False
            self.ticker.add(stream)

    def connection_lost(self, exc: Exception | None) -> None:
        stream = self.stream
        if stream is not None and not stream.done:
            stream.done = True
            self.state.closes[stream.request_id] = time.monotonic_ns()

    def stream_finished(self) -> None:
        self.stream = None
        if self.buffer:
            self.data_received(b"")

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.stream is None:
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
                data_out = json.dumps({"closes": self.state.closes, "finished": self.state.finished,
                                       "peers": self.state.peers}).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n" % len(data_out) + data_out)
                continue
            spec = json.loads(body or b"{}")
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
            request_id = str(spec.get("id", "x"))
            self.state.peers[request_id] = self.transport.get_extra_info("peername")[1]
            self.stream = PacedStream(self, request_id, int(spec.get("events", 100)),
                                      float(spec.get("interval_ms", 10)) / 1000.0,
                                      asyncio.get_running_loop().time(),
                                      bool(spec.get("obfuscate", False)))
            self.ticker.add(self.stream)


def run_upstream(port: int) -> None:
    raise_fd_limit()
    state = UpstreamState()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ticker = Ticker()
        server = await loop.create_server(lambda: UpstreamProtocol(state, ticker), "127.0.0.1", port,
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
        self.text: list[bytes] = []
        self.last_event_at = 0
        self.first_event_at = 0
        self.started_at = time.monotonic_ns()

    @property
    def text_bytes(self) -> bytes:
        return b"".join(self.text)


_STAMP = b'"system_fingerprint":"t'
# The text of a chunk, still JSON-escaped (our tokens need no escapes, so the
# escaped text is the text; a merged chunk holds several tokens' text).
_CONTENT_RE = re.compile(rb'"content":"((?:[^"\\]|\\.)*)"')


class EventReader:
    """The client's view of one response: head, chunked framing, SSE events.

    Per event it does only bytes operations: the send time and the text are
    sliced out of the chunk, not parsed as JSON. Anything but a one-line
    ``data:`` event or a comment goes through the real parser (``SSEParser``).
    ``parse``: read every event as an SDK does instead, each block through
    ``SSEParser`` and each chunk through ``json.loads``, so the client's own
    work per event (and the time it is not reading) is a real client's.
    """

    def __init__(self, result: StreamResult, *, stop_after_events: int = 0, parse: bool = False) -> None:
        self.result = result
        self.stop_after_events = stop_after_events
        self.parse = parse
        self._head_done = False
        self._raw = b""
        self._body = b""

    def feed(self, data: bytes, now: int) -> bool:
        """Take bytes read at ``now``; True once the stream is over for us."""
        raw = self._raw + data if self._raw else data
        if not self._head_done:
            head_end = raw.find(b"\r\n\r\n")
            if head_end < 0:
                self._raw = raw
                return False
            if not raw.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(raw[:200].decode("latin-1", "replace"))
            self._head_done = True
            raw = raw[head_end + 4:]
        # De-chunk every complete chunk (no chunk extensions: none of the
        # servers measured writes them, and int() would refuse one).
        body = self._body
        position = 0
        ended = False
        while True:
            line_end = raw.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(raw[position:line_end], 16)
            chunk_end = line_end + 4 + size
            if len(raw) < chunk_end:
                break
            body += raw[line_end + 2:chunk_end - 2]
            position = chunk_end
            if size == 0:
                ended = True
                break
        self._raw = raw[position:] if position < len(raw) else b""
        if not body.endswith(b"\n\n"):
            blocks = body.split(b"\n\n")
            self._body = blocks.pop()
        else:
            blocks = body[:-2].split(b"\n\n")
            self._body = b""
        stop_after = self.stop_after_events
        result = self.result
        event = self._event
        if self.parse:
            parser = SSEParser()
            for block in blocks:
                for parsed in parser.feed(block + b"\n\n"):
                    if parsed.data is not None and self._parsed_event(parsed.data, now):
                        return True
            return ended or (bool(stop_after) and result.events >= stop_after)
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                if event(block[6:], now):
                    return True
            elif block.startswith(b":"):
                continue  # a comment (heartbeat)
            elif block:
                for parsed in SSEParser().feed(block + b"\n\n"):
                    if parsed.data is not None and event(parsed.data.encode(), now):
                        return True
        return ended or (bool(stop_after) and result.events >= stop_after)

    def _event(self, data: bytes, now: int) -> bool:
        result = self.result
        if data == b"[DONE]":
            result.complete = True
            result.last_event_at = now
            return True
        if b'"error"' in data:
            raise RuntimeError(data.decode("utf-8", "replace"))
        stamp = data.find(_STAMP)
        if stamp >= 0:
            stamp += len(_STAMP)
            result.latencies_ns.append(now - int(data[stamp:data.index(b'"', stamp)]))
        content = _CONTENT_RE.search(data)
        if content is not None:
            result.text.append(content[1])
        result.events += 1
        if not result.first_event_at:
            result.first_event_at = now
        result.last_event_at = now
        return bool(self.stop_after_events) and result.events >= self.stop_after_events


    def _parsed_event(self, data: str, now: int) -> bool:
        """``_event`` for a client that parses: the chunk as JSON, its fields read."""
        result = self.result
        if data == "[DONE]":
            result.complete = True
            result.last_event_at = now
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(data)
        stamp = chunk.get("system_fingerprint") or ""
        if stamp.startswith("t"):
            result.latencies_ns.append(now - int(stamp[1:]))
        choices = chunk.get("choices") or [{}]
        content = (choices[0].get("delta") or {}).get("content")
        if content:
            result.text.append(content.encode())
        result.events += 1
        if not result.first_event_at:
            result.first_event_at = now
        result.last_event_at = now
        return bool(self.stop_after_events) and result.events >= self.stop_after_events


def request_bytes(spec: dict[str, Any]) -> bytes:
    body = json.dumps({"model": "bench", "stream": True, **spec}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
            b"content-type: application/json\r\naccept: text/event-stream\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (str(spec["id"]).encode(), len(body), body))


class StreamClient(asyncio.Protocol):
    """A streaming request read by ``data_received``: the cheapest way to take
    many fast streams (no coroutine wake-up per read)."""

    def __init__(self, request: bytes, reader: EventReader, done: asyncio.Future[None]) -> None:
        self.request = request
        self.reader = reader
        self.done = done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            over = self.reader.feed(data, time.monotonic_ns())
        except Exception as error:
            self.done.set_exception(error)
            over = True
        if over:
            if not self.done.done():
                self.done.set_result(None)
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


class RawConn:
    """A client socket read with plain ``recv`` calls of the size asked for.

    asyncio's StreamReader drains the kernel buffer into user space as fast as
    data comes, which would make every "slow reader" a fast one; this reads
    only when the scenario does, so a small SO_RCVBUF really pushes back.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    async def read(self, size: int) -> bytes:
        return await self.loop.sock_recv(self.sock, size)

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
    await loop.sock_sendall(sock, request_bytes(spec))
    return RawConn(sock)


async def read_stream(conn: RawConn, result: StreamResult, *,
                      read_bytes: int = 65536, read_pause_s: float = 0.0,
                      stop_after_events: int = 0) -> None:
    reader = EventReader(result, stop_after_events=stop_after_events)
    while True:
        data = await conn.read(read_bytes)
        if not data or reader.feed(data, time.monotonic_ns()):
            return
        if read_pause_s:
            await asyncio.sleep(read_pause_s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


STEADY_FROM_EVENT = 50
"""A stream's events from this index on (0-based: the 51st on, 0.5 s into a
stream at 100 events/s) are the steady state's: long after a burst of
streams has been set up; the first 50 are the start's."""


def steady_latencies(results: list[StreamResult], *, start: bool = False) -> list[int]:
    """Every stream's latencies from its ``STEADY_FROM_EVENT``-th event on: the
    tail without the streams' start, where the early events wait behind the
    other streams' set-ups; with ``start``, the latencies before it instead."""
    if start:
        return [v for r in results for v in r.latencies_ns[:STEADY_FROM_EVENT]]
    return [v for r in results for v in r.latencies_ns[STEADY_FROM_EVENT:]]


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
                              interval_ms: float, at_most: int = 0, parse: bool = False) -> dict[str, Any]:
    """``streams`` concurrent answers of ``events`` chunks every ``interval_ms``
    (``at_most`` > 0: no more than that many open at once, the next one
    started as one ends; its first event counted from its own start).

    Every stream's text is checked to be exact. ``delivered_events`` counts the
    chunks the client read, ``delivered_tokens`` the tokens in them (a proxy
    that merged chunks under load delivers fewer chunks, the same tokens); one
    latency per chunk read, from the send time of its first token.
    """
    loop = asyncio.get_running_loop()
    results = [StreamResult() for _ in range(streams)]
    interval_s = interval_ms / 1000.0

    gate = asyncio.Semaphore(at_most or streams)

    async def one(i: int) -> None:
        # Spread the starts over one interval, as real traffic is not in lockstep.
        await asyncio.sleep(interval_s * i / streams)
        async with gate:
            results[i].started_at = time.monotonic_ns()
            done: asyncio.Future[None] = loop.create_future()
            request = request_bytes({"id": f"t{i}", "events": events, "interval_ms": interval_ms})
            transport, _ = await loop.create_connection(
                lambda: StreamClient(request, EventReader(results[i], parse=parse), done), host, port)
            try:
                await done
            finally:
                transport.close()

    started = time.monotonic_ns()
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    wall_s = (time.monotonic_ns() - started) / 1e9
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    delivered = sum(r.events for r in results)
    texts = [r.text_bytes for r in results]
    tokens = sum(text.count(b" w") for text in texts)
    expected = expected_text(events)
    latencies = [v for r in results for v in r.latencies_ns]
    return {
        "streams": streams, "events_per_stream": events, "interval_ms": interval_ms,
        "complete": sum(r.complete for r in results),
        "exact_text": sum(text == expected for text in texts),
        "delivered_events": delivered, "delivered_tokens": tokens, "wall_s": round(wall_s, 3),
        "delivered_events_per_s": round(delivered / wall_s, 1),
        "delivered_tokens_per_s": round(tokens / wall_s, 1),
        "latency": summarize_ms(latencies), "steady_latency": summarize_ms(steady_latencies(results)),
        "start_latency": summarize_ms(steady_latencies(results, start=True)),
        "errors": errors[:5],
        # From connecting to the first event: the whole set-up of a stream that
        # arrived in a burst (the streams start within one interval).
        "first_event": summarize_ms([r.first_event_at - r.started_at for r in results if r.first_event_at]),
    }


async def scenario_reset(host: str, port: int, upstream_port: int, streams: int,
                         concurrency: int, at_once: bool = False) -> dict[str, Any]:
    """Read a few events, reset, and see how long until the upstream's connection closes.

    ``at_once``: every stream first reads its 3 events, then all reset in one
    burst (back to back, no await between), so the proxy sees them together."""
    reset_at: dict[str, int] = {}
    ports: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    opened: dict[str, RawConn] = {}

    async def one(i: int) -> None:
        async with gate:
            request_id = f"r{i}-{os.getpid()}"
            conn = await open_stream(host, port, {"id": request_id, "events": 100000,
                                                  "interval_ms": 10})
            ports[request_id] = conn.sock.getsockname()[1]
            await read_stream(conn, StreamResult(), stop_after_events=3)
            if at_once:
                opened[request_id] = conn
                return
            reset_at[request_id] = conn.reset()
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(streams)))
    for request_id, conn in opened.items():
        reset_at[request_id] = conn.reset()
    await asyncio.sleep(0.5)
    seen = await fetch_json("127.0.0.1", upstream_port, "/closes")
    closes: dict[str, int] = seen["closes"]
    delays = [closes[k] - v for k, v in reset_at.items() if k in closes]
    return {"streams": streams, "upstream_closed": len(delays),
            "reset_to_upstream_close": summarize_ms(delays),
            "delays_ms": sorted(round(d / 1e6, 3) for d in delays),
            # For a packet-level trace: each stream's reset time, the client's
            # port, the proxy's port towards the upstream and the upstream's stamp.
            "streams_detail": {k: {"reset_ns": v, "client_port": ports.get(k),
                                   "proxy_upstream_port": seen.get("peers", {}).get(k),
                                   "upstream_closed_ns": closes.get(k)} for k, v in reset_at.items()}}


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
                        read_bytes: int, read_pause_ms: float, rcvbuf: int,
                        obfuscate: bool = False) -> dict[str, Any]:
    """Slow readers: how late does the last token arrive after it was generated?"""
    results = [StreamResult() for _ in range(streams)]
    tag = f"s{os.getpid()}-{time.monotonic_ns()}"

    async def one(i: int) -> None:
        conn = await open_stream(host, port, {"id": f"{tag}-{i}", "events": events,
                                              "interval_ms": 1, "obfuscate": obfuscate}, rcvbuf=rcvbuf)
        try:
            await read_stream(conn, results[i], read_bytes=read_bytes,
                              read_pause_s=read_pause_ms / 1000.0)
        except OSError:
            pass  # reset by the proxy (e.g. its pending cap): reported as incomplete
        finally:
            conn.close()

    await asyncio.gather(*(one(i) for i in range(streams)))
    seen = await fetch_json("127.0.0.1", upstream_port, "/closes")
    finished: dict[str, int] = seen["finished"]
    expected = expected_text(events)
    rows = []
    for i, r in enumerate(results):
        done_at = finished.get(f"{tag}-{i}")
        rows.append({
            "complete": r.complete, "exact_text": r.text_bytes == expected, "events": r.events,
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
    client.add_argument("--at-most", type=int, default=0,
                        help="throughput: at most this many streams open at once (default: all)")
    client.add_argument("--hold-s", type=float, default=10)
    client.add_argument("--read-bytes", type=int, default=2048)
    client.add_argument("--read-pause-ms", type=float, default=100)
    client.add_argument("--rcvbuf", type=int, default=4096)
    client.add_argument("--parse", action="store_true",
                        help="throughput: read every event as an SDK does (SSE parser, json.loads)")
    client.add_argument("--at-once", action="store_true",
                        help="reset: all streams reset in one burst once each has read 3 events")
    client.add_argument("--obfuscate", action="store_true",
                        help="slow: chunks carry obfuscation padding instead of a per-chunk stamp")
    args = parser.parse_args(argv)
    if args.cmd == "upstream":
        run_upstream(args.port)
        return 0
    raise_fd_limit()
    host, _, port_text = args.target.rpartition(":")
    port = int(port_text)
    if args.scenario == "throughput":
        coro = scenario_throughput(host, port, args.streams, args.events, args.interval_ms, args.at_most,
                                   args.parse)
    elif args.scenario == "reset":
        coro = scenario_reset(host, port, args.upstream_port, args.streams, args.concurrency,
                              args.at_once)
    elif args.scenario == "hold":
        coro = scenario_hold(host, port, args.streams, args.hold_s)
    else:
        coro = scenario_slow(host, port, args.upstream_port, args.streams, args.events,
                             args.read_bytes, args.read_pause_ms, args.rcvbuf, args.obfuscate)
    print(json.dumps({"result": _run(coro)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
