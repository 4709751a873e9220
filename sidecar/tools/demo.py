"""``tokenwire demo``: the guided tour, live over real sockets.

It starts ``tokenwire up`` (engine on a Unix socket, sidecar in front) on free
ports, or uses one already running (``--url`` plus ``--engine-socket``), and
shows, section by section:

1. the wire: the first and last frames of a streamed chat completion, as the
   bytes the sidecar wrote (HTTP/1.1 chunked framing around SSE events);
2. timing: TTFT and inter-event gaps over a few parallel streams, with tokens
   counted from the usage block (the ``probe`` functions);
3. a slow reader under each slow-client policy, side by side: one extra
   sidecar per policy in front of the same engine, each read by a raw socket
   with a small receive buffer that takes 512 bytes every 50 ms, plus the same
   reader straight at the engine for reference;
4. a dropped connection: a long answer reset mid-stream (RST), and the
   engine's running count before and after;
5. resume: an answer cut mid-stream and resumed with ``Last-Event-ID`` on a
   resumable sidecar, the text proven identical to an uninterrupted run and the
   engine's token counter proving it generated once; then an idempotent repeat.

The same figures go to ``--out`` as ``report.html`` (with matplotlib PNGs) and
``report.json``. The exit status is 0 only if every section ran and its key
claim held; otherwise the failed checks are printed.

The readers here use plain blocking sockets on purpose: an asyncio stream
reader drains the kernel buffer as fast as it can and would hide the very
slowness section 3 is about.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import math
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
from tokenwire.middleware.chunks import read_chunk
from tokenwire.middleware.errors import SSEProtocolError
from tokenwire.middleware.headers import STREAM_ID_HEADER
from tokenwire.middleware.sse import SSEParser

from . import up
from .probe import run_load, summarize

POLICIES = ("coalesce", "block", "drop")
PROMPT = "Tell me about the sea."

# The slow reader: a receive buffer small enough that the kernel cannot hide
# the reader's pace from the sender, read in small bites at a fixed rhythm.
SLOW_RECEIVE_BUFFER_BYTES = 4096
SLOW_READ_BYTES = 512
SLOW_READ_INTERVAL_S = 0.05
# The per-policy sidecars cap their own socket and transport buffers too (see
# docs/architecture.md#slow-readers), tighter than the defaults
# (16 KiB / 8 KiB): a demo answer is only tens of KB, and with the defaults
# the kernel and transport buffers alone would hold most of it, so a slow
# reader would show no difference between the policies.
SLOW_SIDECAR_ARGS = ("--socket-send-buffer-bytes", "4096", "--write-high-water-bytes", "4096")

_RUNNING_GAUGE = "tokenwire_engine_running"
_GENERATED_COUNTER = "tokenwire_engine_generated_tokens_total"
_SIDECAR_START_TIMEOUT_S = 30.0
_READ_TIMEOUT_S = 120.0
_DROP_WAIT_S = 10.0
# The resumable sidecar of section 5: a grace long enough for the demo's own
# reconnect, which comes at once.
RESUME_SIDECAR_ARGS = ("--resume", "--resume-grace-s", "5")


class DemoError(RuntimeError):
    """A section could not run; the message says why."""


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """How big the tour is; ``--quick`` shrinks it for tests."""

    timing_requests: int = 16
    timing_concurrency: int = 4
    timing_max_tokens: int = 64
    slow_max_tokens: int = 300
    drop_max_tokens: int = 2000
    drop_read_events: int = 5
    resume_max_tokens: int = 200
    resume_read_events: int = 12

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(timing_requests=8, timing_max_tokens=32, slow_max_tokens=200,
                   resume_max_tokens=100)


# --- raw HTTP over real sockets ---------------------------------------------------------

Connect = Callable[[], socket.socket]


def tcp_connector(host: str, port: int, *, receive_buffer_bytes: int | None = None) -> Connect:
    """A function opening a TCP connection, with a capped receive buffer if asked."""
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer_bytes is not None:
            # Before connect(): the window scale is agreed in the handshake.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.settimeout(_READ_TIMEOUT_S)
        sock.connect((host, port))
        return sock
    return connect


def unix_connector(path: str, *, receive_buffer_bytes: int | None = None) -> Connect:
    """A function opening a connection to a Unix socket."""
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if receive_buffer_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.settimeout(_READ_TIMEOUT_S)
        sock.connect(path)
        return sock
    return connect


def _request_bytes(method: str, target: str, body: bytes = b"", *,
                   connection: h11.Connection | None = None,
                   extra_headers: Sequence[tuple[str, str]] = ()) -> bytes:
    conn = connection or h11.Connection(h11.CLIENT)
    headers = [("host", "tokenwire-demo"), ("accept", "text/event-stream"),
               ("connection", "close"), *extra_headers]
    if method == "POST":
        headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
    out = conn.send(h11.Request(method=method, target=target, headers=headers)) or b""
    if body:
        out += conn.send(h11.Data(data=body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


def http_get(connect: Connect, target: str) -> tuple[int, bytes]:
    """A plain ``GET`` (used on the engine's Unix socket): status and body."""
    conn = h11.Connection(h11.CLIENT)
    with connect() as sock:
        sock.sendall(_request_bytes("GET", target, connection=conn))
        status, body = 0, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, body


def chat_body(model: str, max_tokens: int, *, ignore_eos: bool = True) -> bytes:
    """A streamed, greedy chat completion request that reports its usage."""
    return json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
        "temperature": 0, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": PROMPT}],
    }).encode()


@dataclass
class Answer:
    """What a reader made of one streamed chat completion."""

    status: int = 0
    request_id: str = ""
    events: int = 0
    text: str = ""
    finish_reason: str | None = None
    saw_done: bool = False
    completion_tokens: int | None = None
    error: str | None = None
    body_complete: bool = False
    wall_s: float = 0.0
    stream_id: str = ""
    """``x-tokenwire-stream-id`` (resumable sidecars only)."""
    ids: list[str] = field(default_factory=list)
    """The ``id:`` of every data event, in order (resumable sidecars only)."""

    @property
    def complete(self) -> bool:
        """Finished by the upstream and terminated with ``[DONE]`` and a clean body end."""
        return self.error is None and self.finish_reason is not None and self.saw_done \
            and self.body_complete

    def take(self, data: str) -> None:
        """Account for one SSE ``data`` payload."""
        if data == "[DONE]":
            self.saw_done = True
            return
        self.events += 1
        facts = read_chunk(data)
        if facts.error is not None:
            self.error = facts.error
            return
        if facts.completion_tokens is not None:
            self.completion_tokens = facts.completion_tokens
        self.text += facts.text
        if facts.finish_reason is not None:
            self.finish_reason = facts.finish_reason


class StreamReader:
    """Reads one streamed response off a blocking socket, ``recv_bytes`` at a time.

    ``on_event`` is called after every SSE event; returning False stops reading
    (the caller then owns the socket).
    """

    def __init__(self, sock: socket.socket, *, recv_bytes: int = 65536,
                 interval_s: float = 0.0) -> None:
        self.sock = sock
        self.answer = Answer()
        self.raw = bytearray()
        self._recv_bytes = recv_bytes
        self._interval_s = interval_s
        self._conn = h11.Connection(h11.CLIENT)
        self._parser = SSEParser()

    def send(self, target: str, body: bytes, *, method: str = "POST",
             headers: Sequence[tuple[str, str]] = ()) -> None:
        self.sock.sendall(_request_bytes(method, target, body, connection=self._conn,
                                         extra_headers=headers))

    def read(self, on_event: Callable[[Answer], bool] | None = None) -> Answer:
        started = time.perf_counter()
        try:
            while not self._read_once(on_event):
                if self._interval_s:
                    time.sleep(self._interval_s)
        except (OSError, h11.RemoteProtocolError, SSEProtocolError) as error:
            # A body cut without its chunked terminator is how the wire core
            # says "this stream did not finish": report it as such.
            self.answer.error = self.answer.error or f"{type(error).__name__}: {error}"
        self.answer.wall_s = time.perf_counter() - started
        return self.answer

    def _read_once(self, on_event: Callable[[Answer], bool] | None) -> bool:
        """One ``recv`` and whatever it completes; True when done."""
        data = self.sock.recv(self._recv_bytes)
        self.raw += data
        self._conn.receive_data(data)
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                return False
            if isinstance(event, h11.Response):
                self.answer.status = event.status_code
                headers = dict(event.headers)
                self.answer.request_id = headers.get(b"x-request-id", b"").decode()
                self.answer.stream_id = headers.get(STREAM_ID_HEADER, b"").decode()
            elif isinstance(event, h11.Data):
                for sse in self._parser.feed(event.data):
                    if sse.data is None:
                        continue
                    if sse.id is not None:
                        self.answer.ids.append(sse.id)
                    self.answer.take(sse.data)
                    if on_event is not None and not on_event(self.answer):
                        return True
            elif isinstance(event, h11.EndOfMessage):
                self.answer.body_complete = True
                return True
            elif isinstance(event, h11.ConnectionClosed):
                return True


def stream_chat(connect: Connect, body: bytes, **reader_options: Any) -> StreamReader:
    """Open a connection and send a streamed chat completion; the caller reads."""
    reader = StreamReader(connect(), **reader_options)
    reader.send("/v1/chat/completions", body)
    return reader


def engine_metrics(engine_socket: str) -> dict[str, float]:
    """The engine's unlabelled Prometheus samples, read over its Unix socket."""
    status, body = http_get(unix_connector(engine_socket), "/metrics")
    if status != 200:
        raise DemoError(f"engine /metrics answered HTTP {status}")
    samples: dict[str, float] = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def engine_model_name(engine_socket: str) -> str:
    status, body = http_get(unix_connector(engine_socket), "/v1/models")
    if status != 200:
        raise DemoError(f"engine /v1/models answered HTTP {status}")
    return str(json.loads(body)["data"][0]["id"])


# --- the sections -------------------------------------------------------------------------

def _escaped(data: bytes) -> str:
    """``repr``-style escapes (``\\r\\n``, ``\\n\\n`` visible), without the ``b'...'``."""
    return repr(data)[2:-1]


def _elide(text: str, keep: int = 150) -> str:
    if len(text) <= keep:
        return text
    return text[:40] + " … " + text[-(keep - 40):]


def split_wire(raw: bytes) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """Response head lines and body chunks (size line, payload) as they went over the wire."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [line + b"\r\n" for line in head.split(b"\r\n")] + [b"\r\n"]
    chunks: list[tuple[bytes, bytes]] = []
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0], 16)
        chunks.append((size_line + b"\r\n", rest[:size] + rest[size:size + 2]))
        body = rest[size + 2:]
        if size == 0:
            break
    return lines, chunks


def section_wire(api: Connect, model: str) -> dict[str, Any]:
    """1. One short streamed answer through the sidecar, kept as raw bytes."""
    reader = stream_chat(api, chat_body(model, 24))
    with reader.sock:
        answer = reader.read()
    head, chunks = split_wire(bytes(reader.raw))
    return {"head": [_escaped(line) for line in head],
            "chunks": [(_escaped(size), _escaped(payload)) for size, payload in chunks],
            "answer": asdict(answer), "complete": answer.complete, "bytes": len(reader.raw)}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def rank(q: float) -> float | None:
        if not ordered:
            return None
        # Nearest rank: a value that was actually observed.
        return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] * 1000, 2)
    return {"p50": rank(50), "p95": rank(95), "p99": rank(99)}


def section_timing(api_url: str, model: str, settings: DemoSettings) -> dict[str, Any]:
    """2. Parallel streams through the sidecar with the probe's client."""
    outcomes = asyncio.run(run_load(
        api_url, requests=settings.timing_requests, concurrency=settings.timing_concurrency,
        model=model, prompt=PROMPT, max_tokens=settings.timing_max_tokens, timeout_s=60.0,
        progress=False))
    summary = summarize(outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [gap for o in outcomes for gap in o.gaps_s]
    return {"requests": settings.timing_requests, "concurrency": settings.timing_concurrency,
            "max_tokens": settings.timing_max_tokens, "ok": summary["ok"],
            "truncated": summary["truncated"], "errors": summary["errors"],
            "error_samples": summary["error_samples"],
            "ttft_ms": _percentiles(ttfts), "gap_ms": _percentiles(gaps),
            "events": summary["events"], "tokens": summary["tokens"],
            "gap_samples_ms": [round(g * 1000, 3) for g in gaps],
            "ttft_samples_ms": [round(t * 1000, 3) for t in ttfts]}


@dataclass
class ExtraSidecar:
    """One extra sidecar in front of the same engine (a policy, resume), and its stream log."""

    policy: str
    child: up.Child
    log_file: Path
    port: int = 0

    def record(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The sidecar's JSON record of the (single) stream it served."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                for line in self.log_file.read_text().splitlines():
                    record: dict[str, Any] = json.loads(line)
                    return record
            time.sleep(0.1)
        return None


@contextlib.contextmanager
def extra_sidecars(engine_socket: str, workdir: Path, flavours: Mapping[str, Sequence[str]], *,
                   echo: bool) -> Iterator[list[ExtraSidecar]]:
    """Start one sidecar per ``{name: extra args}`` in front of ``engine_socket``; stop them on exit."""
    sidecars: list[ExtraSidecar] = []
    try:
        for name, args in flavours.items():
            log_file = workdir / f"sidecar-{name}.jsonl"
            argv = [sys.executable, "-m", "tokenwire.sidecar", "sidecar", "--listen", "127.0.0.1:0",
                    "--upstream", f"unix:{engine_socket}", *args, "--log-file", str(log_file)]
            sidecars.append(ExtraSidecar(name, up.Child(f"sidecar ({name})", argv, echo=echo),
                                         log_file))
        deadline = time.monotonic() + _SIDECAR_START_TIMEOUT_S
        for sidecar in sidecars:
            child = sidecar.child
            while not child.ready.wait(0.2):
                if not child.alive() or time.monotonic() > deadline:
                    raise DemoError(f"the {child.name} did not start:\n{child.last_words()}")
            match = re.search(r"listen=\S+:(\d+)", child.ready_line)
            if match is None:
                raise DemoError(f"the {child.name} printed an unexpected ready line: "
                                f"{child.ready_line!r}")
            sidecar.port = int(match.group(1))
        yield sidecars
    finally:
        for sidecar in sidecars:
            sidecar.child.stop()


def _slow_read(connect: Connect, body: bytes) -> Answer:
    reader = stream_chat(connect, body, recv_bytes=SLOW_READ_BYTES, interval_s=SLOW_READ_INTERVAL_S)
    with reader.sock:
        return reader.read()


def section_slow_reader(engine_socket: str, model: str, settings: DemoSettings, workdir: Path,
                        *, echo: bool) -> dict[str, Any]:
    """3. The same slow reader under each policy, and straight at the engine, side by side."""
    body = chat_body(model, settings.slow_max_tokens)
    flavours = {policy: ("--slow-client-policy", policy, *SLOW_SIDECAR_ARGS) for policy in POLICIES}
    with extra_sidecars(engine_socket, workdir, flavours, echo=echo) as sidecars:
        targets: dict[str, Connect] = {
            s.policy: tcp_connector("127.0.0.1", s.port,
                                    receive_buffer_bytes=SLOW_RECEIVE_BUFFER_BYTES)
            for s in sidecars}
        targets["direct"] = unix_connector(engine_socket,
                                           receive_buffer_bytes=SLOW_RECEIVE_BUFFER_BYTES)
        answers: dict[str, Answer] = {}
        engine_bytes = 0

        def run(name: str) -> None:
            try:
                if name == "engine pace":
                    nonlocal engine_bytes
                    reader = stream_chat(unix_connector(engine_socket), body)
                    with reader.sock:
                        answers[name] = reader.read()
                    engine_bytes = len(reader.raw)
                else:
                    answers[name] = _slow_read(targets[name], body)
            except OSError as error:
                answers[name] = Answer(error=f"{type(error).__name__}: {error}")

        # All four at once: the same engine batch, the same moment, a fair comparison.
        # A fast reader straight at the engine alongside shows how long generating took.
        threads = [threading.Thread(target=run, args=(name,)) for name in [*targets, "engine pace"]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        records = {s.policy: s.record() for s in sidecars}
    reference = answers["direct"].text
    engine_s = answers["engine pace"].wall_s
    rows = []
    for name in (*POLICIES, "direct"):
        answer = answers[name]
        record = records.get(name) or {}
        usage = record.get("usage") or {}
        tokens = answer.completion_tokens or usage.get("completion_tokens")
        rows.append({
            "reader": name if name == "direct" else f"{name} (sidecar)", "policy": name,
            "complete": answer.complete, "text_chars": len(answer.text),
            "same_text_as_direct": answer.text == reference if name != "direct" else None,
            "events_received": answer.events, "tokens_generated": tokens,
            "pending_high_water_bytes": record.get("pending_high_water_bytes"),
            "coalesced_events": record.get("coalesced_events"),
            "dropped_events": record.get("dropped_events"),
            "end_reason": record.get("end_reason"),
            "wall_s": round(answer.wall_s, 2), "error": answer.error})
    return {"max_tokens": settings.slow_max_tokens, "receive_buffer_bytes": SLOW_RECEIVE_BUFFER_BYTES,
            "read_bytes": SLOW_READ_BYTES, "read_interval_ms": SLOW_READ_INTERVAL_S * 1000,
            "rows": rows, "engine_generation_s": round(engine_s, 2),
            "engine_bytes_per_s": round(engine_bytes / engine_s) if engine_s else None,
            "reader_bytes_per_s": round(SLOW_READ_BYTES / SLOW_READ_INTERVAL_S)}


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the kernel sends RST, as when a client dies."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def section_drop(api: Connect, engine_socket: str, model: str, settings: DemoSettings,
                 log_file: Path | None) -> dict[str, Any]:
    """4. A long answer reset mid-stream; the engine's running count before and after."""
    before = engine_metrics(engine_socket)
    reader = stream_chat(api, chat_body(model, settings.drop_max_tokens))
    answer = reader.read(lambda a: a.events < settings.drop_read_events)
    if answer.error or answer.events < settings.drop_read_events:
        reader.sock.close()
        raise DemoError(f"the long answer did not start: {answer.error or 'too few events'}")
    during = engine_metrics(engine_socket)
    timeline: list[tuple[float, float]] = [(0.0, during.get(_RUNNING_GAUGE, math.nan))]
    reset_at = time.perf_counter()
    _reset(reader.sock)
    dropped_after_s: float | None = None
    after = during
    while time.perf_counter() - reset_at < _DROP_WAIT_S:
        after = engine_metrics(engine_socket)
        elapsed = time.perf_counter() - reset_at
        timeline.append((round(elapsed * 1000, 2), after.get(_RUNNING_GAUGE, math.nan)))
        if dropped_after_s is None and after.get(_RUNNING_GAUGE, 0) < during.get(_RUNNING_GAUGE, 0):
            dropped_after_s = elapsed
        if dropped_after_s is not None and elapsed > dropped_after_s + 0.2:
            break
        time.sleep(0.005)
    generated = after.get(_GENERATED_COUNTER, 0) - before.get(_GENERATED_COUNTER, 0)
    record = None
    if log_file is not None:
        deadline = time.monotonic() + 5
        while record is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                for line in log_file.read_text().splitlines():
                    candidate = json.loads(line)
                    if candidate.get("request_id") == answer.request_id:
                        record = candidate
            time.sleep(0.05)
    return {"max_tokens": settings.drop_max_tokens, "events_read": answer.events,
            "running_before": before.get(_RUNNING_GAUGE), "running_during": during.get(_RUNNING_GAUGE),
            "running_after": after.get(_RUNNING_GAUGE),
            "dropped": dropped_after_s is not None,
            "reset_to_drop_ms": None if dropped_after_s is None else round(dropped_after_s * 1000, 1),
            "tokens_generated": generated, "timeline_ms": timeline,
            "sidecar_end_reason": None if record is None else record.get("end_reason")}


def _read_all(connect: Connect, target: str, body: bytes = b"", *, method: str = "POST",
              headers: Sequence[tuple[str, str]] = ()) -> Answer:
    reader = StreamReader(connect())
    reader.send(target, body, method=method, headers=headers)
    with reader.sock:
        return reader.read()


def section_resume(engine_socket: str, model: str, settings: DemoSettings, workdir: Path,
                   *, echo: bool) -> dict[str, Any]:
    """5. Cut an answer mid-stream, resume it with Last-Event-ID, prove it identical."""
    body = chat_body(model, settings.resume_max_tokens)
    with extra_sidecars(engine_socket, workdir, {"resume": RESUME_SIDECAR_ARGS}, echo=echo) as sidecars:
        sidecar = sidecars[0]
        api = tcp_connector("127.0.0.1", sidecar.port)
        # The uninterrupted run (greedy decoding: the same prompt gives the same text).
        reference = _read_all(api, "/v1/chat/completions", body)
        if not reference.complete:
            raise DemoError(f"the uninterrupted answer did not complete: {reference.error}")
        # The interrupted run: read some events, then the "phone" loses its network.
        before = engine_metrics(engine_socket)
        reader = stream_chat(api, body)
        first = reader.read(lambda a: a.events < settings.resume_read_events)
        if not first.stream_id or not first.ids:
            reader.sock.close()
            raise DemoError("the resumable sidecar sent no stream id or event ids")
        _reset(reader.sock)
        last_id = first.ids[-1]
        rest = _read_all(api, f"/v1/streams/{first.stream_id}", method="GET",
                         headers=[("last-event-id", last_id)])
        after = engine_metrics(engine_socket)
        # An idempotent repeat: the second request gets the first one's answer.
        key = [("idempotency-key", f"demo-{first.stream_id}")]
        one = _read_all(api, "/v1/chat/completions", body, headers=key)
        between = engine_metrics(engine_socket)
        two = _read_all(api, "/v1/chat/completions", body, headers=key)
        last = engine_metrics(engine_socket)
        records = [json.loads(line) for line in sidecar.log_file.read_text().splitlines()
                   if line.strip()] if sidecar.log_file.exists() else []
    ids = first.ids + rest.ids
    seqs = [int(i.rpartition(".")[2]) for i in ids]
    generated = after.get(_GENERATED_COUNTER, 0) - before.get(_GENERATED_COUNTER, 0)
    end_reasons = {r.get("request_id"): r.get("end_reason") for r in records}
    return {
        "max_tokens": settings.resume_max_tokens, "stream_id": first.stream_id,
        "events_before_drop": first.events, "last_event_id": last_id,
        "resumed_status": rest.status, "resumed_events": rest.events,
        "resumed_complete": rest.complete,
        "ids_contiguous": seqs == list(range(1, len(seqs) + 1)),
        "duplicate_ids": len(ids) - len(set(ids)),
        "text_identical": first.text + rest.text == reference.text,
        "text_chars": len(reference.text),
        "engine_tokens_for_interrupted_run": generated,
        "completion_tokens": rest.completion_tokens or reference.completion_tokens,
        "first_request_end_reason": end_reasons.get(first.request_id),
        "idempotent_same_text": one.text == two.text == reference.text,
        "idempotent_second_engine_tokens": last.get(_GENERATED_COUNTER, 0)
        - between.get(_GENERATED_COUNTER, 0),
        "idempotent_same_ids": one.ids == two.ids,
    }


# --- the terminal report ------------------------------------------------------------------

def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            .rstrip() for row in rows]


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)


SLOW_COLUMNS = [("reader", "reader"), ("complete", "complete"), ("text_chars", "text chars"),
                ("same_text_as_direct", "same text"), ("events_received", "events"),
                ("tokens_generated", "tokens"), ("pending_high_water_bytes", "pending high-water B"),
                ("coalesced_events", "coalesced"), ("dropped_events", "dropped"),
                ("end_reason", "end reason"), ("wall_s", "wall s")]


def render_text(report: dict[str, Any]) -> str:
    """The terminal report."""
    out: list[str] = [f"tokenwire demo — sidecar {report['api_url']}, engine unix:{report['engine_socket']}"]
    wire = report.get("wire")
    if wire:
        out += ["", "1. The wire: a streamed chat completion through the sidecar, as bytes",
                "   (HTTP/1.1 chunked framing: each chunk is a hex size line, an SSE event "
                "ending in \\n\\n, then \\r\\n)", ""]
        out += [f"  {line}" for line in wire["head"]]
        chunks = wire["chunks"]
        shown = chunks[:4]
        for size, payload in shown:
            out.append(f"  {size}{_elide(payload)}")
        if len(chunks) > 6:
            out.append(f"  … {len(chunks) - 6} more chunks …")
        for size, payload in chunks[max(len(shown), len(chunks) - 2):]:
            out.append(f"  {size}{_elide(payload)}")
        answer = wire["answer"]
        out.append(f"  -> {answer['events']} events, {answer['completion_tokens']} tokens, "
                   f"finish_reason={answer['finish_reason']}, [DONE]={_fmt(answer['saw_done'])}, "
                   f"{wire['bytes']} bytes")
    timing = report.get("timing")
    if timing:
        out += ["", f"2. Timing: {timing['requests']} streams, {timing['concurrency']} at a time, "
                    f"max_tokens {timing['max_tokens']}, through the sidecar"]
        ttft, gap = timing["ttft_ms"], timing["gap_ms"]
        out += _table([["", "p50", "p95", "p99"],
                       ["TTFT ms", _fmt(ttft["p50"]), _fmt(ttft["p95"]), _fmt(ttft["p99"])],
                       ["inter-event gap ms", _fmt(gap["p50"]), _fmt(gap["p95"]), _fmt(gap["p99"])]])
        out.append(f"  {timing['ok']}/{timing['requests']} complete, {timing['truncated']} truncated, "
                   f"{timing['errors']} errors; {timing['events']} content events for "
                   f"{timing['tokens']} tokens (usage blocks)")
        out += [f"  error: {sample}" for sample in timing["error_samples"]]
    slow = report.get("slow_reader")
    if slow:
        out += ["", f"3. A slow reader under each policy: SO_RCVBUF {slow['receive_buffer_bytes']}, "
                    f"recv({slow['read_bytes']}) every {slow['read_interval_ms']:g} ms, "
                    f"{slow['max_tokens']} tokens (ignore_eos)"]
        rows = [[label for _, label in SLOW_COLUMNS]]
        rows += [[_fmt(row[key]) for key, _ in SLOW_COLUMNS] for row in slow["rows"]]
        out += _table(rows)
        out += [f"  {row['reader']}: {row['error']}" for row in slow["rows"] if row["error"]]
        out.append(f"  the engine generated the answer in {slow['engine_generation_s']} s "
                   f"({_fmt(slow['engine_bytes_per_s'])} B/s to a fast reader, direct, at the same "
                   f"time); the slow reader takes at most {slow['reader_bytes_per_s']} B/s")
        if (slow["engine_bytes_per_s"] or 0) < slow["reader_bytes_per_s"]:
            out.append("  the engine was slower than the reader this time (a busy machine?), so "
                       "little backpressure built up")
        out.append("  coalesce merges pending text into fewer events; block stops reading the "
                   "upstream; drop keeps only the newest event (for refreshable state, not answers)")
    drop = report.get("drop")
    if drop:
        out += ["", f"4. A dropped connection: a {drop['max_tokens']}-token answer, "
                    f"{drop['events_read']} events read, then RST (SO_LINGER 0)"]
        out.append(f"  engine running sequences: before {_fmt(drop['running_before'])}, "
                   f"while streaming {_fmt(drop['running_during'])}, "
                   f"after reset {_fmt(drop['running_after'])}")
        if drop["dropped"]:
            out.append(f"  the count dropped {drop['reset_to_drop_ms']} ms after the reset; the engine "
                       f"generated {drop['tokens_generated']:g} of {drop['max_tokens']} tokens")
        else:
            out.append("  the count did NOT drop")
        if drop["sidecar_end_reason"]:
            out.append(f"  sidecar stream record: end_reason={drop['sidecar_end_reason']}")
    resume = report.get("resume")
    if resume:
        out += ["", f"5. Resume: a {resume['max_tokens']}-token answer through a sidecar with "
                    f"{' '.join(RESUME_SIDECAR_ARGS)}",
                f"  read {resume['events_before_drop']} events, then RST; reconnected with "
                f"GET /v1/streams/{resume['stream_id']} and Last-Event-ID: {resume['last_event_id']}",
                f"  -> HTTP {resume['resumed_status']}, {resume['resumed_events']} more events, "
                f"complete={_fmt(resume['resumed_complete'])}; ids contiguous="
                f"{_fmt(resume['ids_contiguous'])}, duplicates={resume['duplicate_ids']}",
                f"  text identical to an uninterrupted run ({resume['text_chars']} chars): "
                f"{_fmt(resume['text_identical'])}",
                f"  the engine generated {resume['engine_tokens_for_interrupted_run']:g} tokens for "
                f"the interrupted answer ({_fmt(resume['completion_tokens'])} in it): one generation; "
                f"first request's record: end_reason={resume['first_request_end_reason']}",
                f"  Idempotency-Key sent twice: same text={_fmt(resume['idempotent_same_text'])}, "
                f"same ids={_fmt(resume['idempotent_same_ids'])}, engine tokens for the second: "
                f"{resume['idempotent_second_engine_tokens']:g}"]
    if report.get("failures"):
        out += ["", "checks failed:"] + [f"  - {failure}" for failure in report["failures"]]
    else:
        out += ["", "all checks passed"]
    return "\n".join(out) + "\n"


# --- the HTML report ----------------------------------------------------------------------

def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Matplotlib PNGs of the timings; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tokenwire demo: matplotlib is not installed; the HTML report has no plots",
              file=sys.stderr)
        return []
    names: list[str] = []
    timing = report.get("timing")
    if timing and timing["gap_samples_ms"]:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.hist(timing["gap_samples_ms"], bins=40, color="#3a6ea5")
        for label, value in timing["gap_ms"].items():
            if value is not None:
                ax.axvline(value, linestyle="--", color="#c0392b", linewidth=1)
                ax.text(value, ax.get_ylim()[1] * 0.9, f" {label}", color="#c0392b", fontsize=8)
        ax.set_xlabel("gap between events at the client (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"Inter-event gaps, {timing['requests']} streams x{timing['concurrency']}")
        fig.tight_layout()
        fig.savefig(out_dir / "gaps.png", dpi=100)
        plt.close(fig)
        names.append("gaps.png")
    slow = report.get("slow_reader")
    if slow:
        rows = slow["rows"]
        labels = [row["policy"] for row in rows]
        metrics = [("events_received", "events received"), ("wall_s", "wall time (s)"),
                   ("pending_high_water_bytes", "pending high-water (bytes)")]
        fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.5))
        for ax, (key, title) in zip(axes, metrics, strict=True):
            values = [row[key] or 0 for row in rows]
            colors = ["#3a6ea5" if row["complete"] else "#c0392b" for row in rows]
            ax.bar(labels, values, color=colors)
            ax.set_title(title, fontsize=10)
        fig.suptitle("Slow reader per policy (red: incomplete answer)", fontsize=11)
        fig.tight_layout()
        fig.savefig(out_dir / "policies.png", dpi=100)
        plt.close(fig)
        names.append("policies.png")
    drop = report.get("drop")
    if drop and drop["timeline_ms"]:
        fig, ax = plt.subplots(figsize=(7, 3))
        xs, ys = zip(*drop["timeline_ms"], strict=True)
        ax.step(xs, ys, where="post", color="#3a6ea5")
        ax.set_xlabel("ms after the reset")
        ax.set_ylabel("engine running")
        ax.set_title("Engine running sequences after the client's RST")
        fig.tight_layout()
        fig.savefig(out_dir / "drop.png", dpi=100)
        plt.close(fig)
        names.append("drop.png")
    return names


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: dict[str, Any], text: str, plots: list[str]) -> str:
    """``report.html``: the terminal report's tables, the full wire bytes, the plots."""
    parts = ["<!doctype html><meta charset='utf-8'><title>tokenwire demo</title><style>"
             "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "pre{background:#f4f4f4;padding:1em;overflow-x:auto;font-size:12px}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
             "padding:4px 8px;text-align:left}img{max-width:100%}</style>",
             "<h1>tokenwire demo</h1>",
             f"<p>sidecar <code>{html.escape(report['api_url'])}</code>, engine "
             f"<code>unix:{html.escape(report['engine_socket'])}</code></p>"]
    wire = report.get("wire")
    if wire:
        frames = wire["head"] + [size + payload for size, payload in wire["chunks"]]
        parts += ["<h2>1. The wire</h2><p>Every byte the sidecar wrote for one streamed chat "
                  "completion, escaped so CR/LF framing is visible.</p>",
                  "<pre>" + html.escape("\n".join(frames)) + "</pre>"]
    timing = report.get("timing")
    if timing:
        ttft, gap = timing["ttft_ms"], timing["gap_ms"]
        parts += [f"<h2>2. Timing</h2><p>{timing['requests']} streams, {timing['concurrency']} at a "
                  f"time; {timing['events']} events for {timing['tokens']} tokens.</p>",
                  _html_table(["", "p50", "p95", "p99"],
                              [["TTFT ms"] + [_fmt(ttft[q]) for q in ("p50", "p95", "p99")],
                               ["inter-event gap ms"] + [_fmt(gap[q]) for q in ("p50", "p95", "p99")]])]
        if "gaps.png" in plots:
            parts.append("<img src='gaps.png' alt='inter-event gap histogram'>")
    slow = report.get("slow_reader")
    if slow:
        parts += ["<h2>3. A slow reader under each policy</h2>",
                  f"<p>SO_RCVBUF {slow['receive_buffer_bytes']}, recv({slow['read_bytes']}) every "
                  f"{slow['read_interval_ms']:g} ms; the engine generated the answer in "
                  f"{slow['engine_generation_s']} s.</p>",
                  _html_table([label for _, label in SLOW_COLUMNS],
                              [[_fmt(row[key]) for key, _ in SLOW_COLUMNS] for row in slow["rows"]])]
        if "policies.png" in plots:
            parts.append("<img src='policies.png' alt='per-policy bars'>")
    drop = report.get("drop")
    if drop:
        parts += ["<h2>4. A dropped connection</h2>",
                  _html_table(["running before", "while streaming", "after reset",
                               "reset to drop (ms)", "tokens generated"],
                              [[_fmt(drop["running_before"]), _fmt(drop["running_during"]),
                                _fmt(drop["running_after"]), _fmt(drop["reset_to_drop_ms"]),
                                _fmt(drop["tokens_generated"])]])]
        if "drop.png" in plots:
            parts.append("<img src='drop.png' alt='engine running count after the reset'>")
    resume = report.get("resume")
    if resume:
        parts += ["<h2>5. Resume</h2>",
                  _html_table(["events before drop", "Last-Event-ID", "resumed events",
                               "ids contiguous", "text identical", "engine tokens",
                               "idempotent repeat: engine tokens"],
                              [[_fmt(resume["events_before_drop"]), html.escape(resume["last_event_id"]),
                                _fmt(resume["resumed_events"]), _fmt(resume["ids_contiguous"]),
                                _fmt(resume["text_identical"]),
                                _fmt(resume["engine_tokens_for_interrupted_run"]),
                                _fmt(resume["idempotent_second_engine_tokens"])]])]
    parts += ["<h2>Terminal report</h2><pre>" + html.escape(text) + "</pre>"]
    return "\n".join(parts) + "\n"


# --- putting it together ------------------------------------------------------------------

def _checks(report: dict[str, Any]) -> list[str]:
    """The claims each section exists to show; a failed one fails the demo."""
    failures = []
    if not report["wire"]["complete"]:
        failures.append(f"the wire section's answer was not complete: {report['wire']['answer']['error']}")
    timing = report["timing"]
    if timing["ok"] != timing["requests"]:
        failures.append(f"timing: only {timing['ok']}/{timing['requests']} streams complete")
    for row in report["slow_reader"]["rows"]:
        if row["policy"] in ("coalesce", "block") and not row["complete"]:
            failures.append(f"slow reader under {row['policy']}: answer incomplete ({row['error']})")
    if not report["drop"]["dropped"]:
        failures.append("the engine's running count did not drop after the reset")
    resume = report["resume"]
    if not (resume["text_identical"] and resume["ids_contiguous"] and resume["resumed_complete"]):
        failures.append("resume: the resumed text was not the uninterrupted text, complete and in order")
    if resume["engine_tokens_for_interrupted_run"] > resume["max_tokens"]:
        failures.append("resume: the engine generated more than one answer's tokens")
    if not resume["idempotent_same_text"] or resume["idempotent_second_engine_tokens"] > 0:
        failures.append("resume: an idempotent repeat generated again")
    return failures


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _progress(message: str) -> None:
    print(f"tokenwire demo: {message}", file=sys.stderr, flush=True)


def run_tour(api_url: str, engine_socket: str, settings: DemoSettings, workdir: Path,
             sidecar_log: Path | None, *, echo: bool) -> dict[str, Any]:
    """Run sections 1-4 against a running sidecar and engine; return the report data."""
    match = re.fullmatch(r"http://([^/:]+|\[[^]]+\]):(\d+)/?", api_url)
    if match is None:
        raise DemoError(f"--url must be http://HOST:PORT (plain HTTP), got {api_url!r}")
    api = tcp_connector(match.group(1).strip("[]"), int(match.group(2)))
    if not Path(engine_socket).exists():
        raise DemoError(f"no engine socket at {engine_socket}")
    model = engine_model_name(engine_socket)
    report: dict[str, Any] = {"api_url": api_url, "engine_socket": engine_socket, "model": model,
                              "settings": asdict(settings)}
    started = time.perf_counter()
    _progress("[1/5] the wire: one streamed answer as bytes")
    report["wire"] = section_wire(api, model)
    _progress(f"[2/5] timing: {settings.timing_requests} streams, "
              f"{settings.timing_concurrency} at a time")
    report["timing"] = section_timing(api_url, model, settings)
    _progress("[3/5] a slow reader under coalesce / block / drop, and direct")
    report["slow_reader"] = section_slow_reader(engine_socket, model, settings, workdir, echo=echo)
    _progress("[4/5] a dropped connection")
    report["drop"] = section_drop(api, engine_socket, model, settings, sidecar_log)
    _progress("[5/5] resume: a cut answer resumed with Last-Event-ID, and an idempotent repeat")
    report["resume"] = section_resume(engine_socket, model, settings, workdir, echo=echo)
    report["tour_s"] = round(time.perf_counter() - started, 1)
    report["failures"] = _checks(report)
    return report


def write_report(report: dict[str, Any], out_dir: Path) -> str:
    """Write report.json, the PNGs and report.html; return the terminal text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = render_text(report)
    plots = write_plots(report, out_dir)
    report["plots"] = plots
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.html").write_text(render_html(report, text, plots))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire demo`` flags."""
    parser.description = "The guided tour of tokenwire, live over real sockets."
    parser.add_argument("--url", help="a running sidecar (http://HOST:PORT); default: start `up`")
    parser.add_argument("--engine-socket", metavar="PATH",
                        help="the engine's Unix socket behind --url (for the slow-reader sidecars "
                             "and the engine's metrics)")
    parser.add_argument("--model", default="tiny", help="model for the started engine: tiny or a folder")
    parser.add_argument("--out", default="tokenwire-demo", help="report folder (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter streams")
    parser.add_argument("--verbose", action="store_true", help="echo the children's logs")


def main(argv: Sequence[str] | None = None) -> int:
    """``tokenwire demo``: run the tour, print the report, write the HTML; 0 if all checks held."""
    parser = argparse.ArgumentParser(prog="tokenwire demo")
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if bool(args.url) != bool(args.engine_socket):
        parser.error("--url and --engine-socket go together")
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    out_dir = Path(args.out)
    # SIGTERM unwinds like Ctrl-C, so every child started here is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="tokenwire-demo-") as tmp:
            workdir = Path(tmp)
            if args.url:
                report = run_tour(args.url, args.engine_socket, settings, workdir, None,
                                  echo=args.verbose)
            else:
                _progress("starting tokenwire up on free ports")
                sidecar_log = workdir / "sidecar.jsonl"
                with up.running(listen=_free_address(), admin_listen=_free_address(),
                                model=args.model, echo=args.verbose, announce=True,
                                sidecar_args=["--log-file", str(sidecar_log)]) as endpoints:
                    report = run_tour(endpoints.api_url, endpoints.engine_socket, settings,
                                      workdir, sidecar_log, echo=args.verbose)
    except (up.UpError, DemoError) as error:
        print(f"tokenwire demo: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"tokenwire demo: network error: {error}", file=sys.stderr)
        return 1
    except subprocess.SubprocessError as error:
        print(f"tokenwire demo: could not run a child process: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenwire demo: interrupted", file=sys.stderr)
        return 130
    report["total_s"] = round(time.perf_counter() - started, 1)
    text = write_report(report, out_dir)
    print(text, end="")
    print(f"report: {out_dir / 'report.html'} (tour {report['tour_s']} s, "
          f"total {report['total_s']} s)")
    if report["failures"]:
        print(f"tokenwire demo: {len(report['failures'])} check(s) failed", file=sys.stderr)
        return 1
    return 0
