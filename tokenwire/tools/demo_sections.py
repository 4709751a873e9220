"""The tour's five sections, each against real processes (see ``demo``'s docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

from . import up
from .demo_client import (
    PROMPT,
    Answer,
    Connect,
    DemoError,
    chat_body,
    engine_metrics,
    read_all,
    reset,
    stream_chat,
    tcp_connector,
    unix_connector,
)
from .probe import run_load, summarize
from .stats import percentiles_ms

POLICIES = ("coalesce", "block", "drop")

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
# At debug, a sidecar logs a ``paused`` milestone each time its core stops
# reading the upstream (``PauseUpstream``, sidecar/exchange/milestones.py):
# the one place that says whether ``block`` engaged, which the stream record
# does not carry. The per-policy sidecars serve one stream each, so the few
# lines cost nothing.
SLOW_SIDECAR_LOG_ARGS = ("--log-level", "debug")
# ``block`` stops reading the upstream once a slow client has ``block_window_bytes``
# waiting (middleware/core/decisions.py, ``_after_queue``); the per-policy
# sidecars run with the sidecar's default.
BLOCK_PAUSE_AT_BYTES = min(SIDECAR_WIRE_DEFAULTS.block_window_bytes, SIDECAR_WIRE_DEFAULTS.max_pending_bytes)

_RUNNING_GAUGE = "tokenwire_engine_running"
_GENERATED_COUNTER = "tokenwire_engine_generated_tokens_total"
_SIDECAR_START_TIMEOUT_S = 30.0
_DROP_WAIT_S = 10.0
# The resumable sidecar of section 5: a grace long enough for the demo's own
# reconnect, which comes at once.
RESUME_SIDECAR_ARGS = ("--resume", "--resume-grace-s", "5")


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



def _escaped(data: bytes) -> str:
    """``repr``-style escapes (``\\r\\n``, ``\\n\\n`` visible), without the ``b'...'``."""
    return repr(data)[2:-1]


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


def section_timing(api_url: str, model: str, settings: DemoSettings) -> dict[str, Any]:
    """2. Parallel streams through the sidecar with the probe's client. The gaps
    are inter-token gaps from each stream's first token on (prefill is in TTFT)."""
    outcomes = asyncio.run(run_load(
        api_url, requests=settings.timing_requests, concurrency=settings.timing_concurrency,
        model=model, prompt=PROMPT, max_tokens=settings.timing_max_tokens, timeout_s=60.0,
        progress=False, warmup=1))
    summary = summarize(outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [gap for o in outcomes for gap in o.itl_s]
    return {"requests": settings.timing_requests, "concurrency": settings.timing_concurrency,
            "max_tokens": settings.timing_max_tokens, "ok": summary["ok"],
            "truncated": summary["truncated"], "errors": summary["errors"],
            "error_samples": summary["error_samples"],
            "ttft_ms": percentiles_ms(ttfts), "gap_ms": percentiles_ms(gaps),
            "events": summary["events"], "tokens": summary["tokens"],
            "gap_samples_ms": [round(g * 1000, 3) for g in gaps],
            "ttft_samples_ms": [round(t * 1000, 3) for t in ttfts]}


class _Milestones:
    """Counts a sidecar's ``paused`` milestones (debug log lines) and says when
    its stream has ``ended``: lines a child's bounded ``lines`` may lose."""

    def __init__(self) -> None:
        self.upstream_pauses = 0
        self.stream_ended = threading.Event()

    def see(self, line: str) -> None:
        """``up.Child``'s ``on_line``: each line of the sidecar's output."""
        if '"tokenwire.lifecycle"' not in line:
            return
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            if fields.get("logger") == "tokenwire.lifecycle":
                if fields.get("msg") == "paused":
                    self.upstream_pauses += 1
                elif fields.get("msg") == "ended":
                    self.stream_ended.set()


@dataclass
class ExtraSidecar:
    """One extra sidecar in front of the same engine (a policy, resume), and its stream log."""

    policy: str
    child: up.Child
    log_file: Path
    milestones: _Milestones
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

    def upstream_pauses(self, timeout_s: float = 10.0) -> int | None:
        """How often the sidecar stopped reading the upstream for its stream: its
        ``paused`` milestones, counted once its ``ended`` one came (None if that
        never did, e.g. a sidecar not run at debug)."""
        if not self.milestones.stream_ended.wait(timeout_s):
            return None
        return self.milestones.upstream_pauses


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
            milestones = _Milestones()
            child = up.Child(f"sidecar ({name})", argv, echo=echo, on_line=milestones.see)
            sidecars.append(ExtraSidecar(name, child, log_file, milestones))
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
    flavours = {policy: ("--slow-client-policy", policy, *SLOW_SIDECAR_ARGS, *SLOW_SIDECAR_LOG_ARGS)
                for policy in POLICIES}
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
        pauses = {s.policy: s.upstream_pauses() for s in sidecars}
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
            "upstream_pauses": pauses.get(name),
            "producer_wait_s": record.get("producer_wait_s"),
            "end_reason": record.get("end_reason"),
            "wall_s": round(answer.wall_s, 2), "error": answer.error})
    return {"max_tokens": settings.slow_max_tokens, "receive_buffer_bytes": SLOW_RECEIVE_BUFFER_BYTES,
            "read_bytes": SLOW_READ_BYTES, "read_interval_ms": SLOW_READ_INTERVAL_S * 1000,
            "rows": rows, "block_pause_at_bytes": BLOCK_PAUSE_AT_BYTES,
            "engine_generation_s": round(engine_s, 2),
            "engine_bytes_per_s": round(engine_bytes / engine_s) if engine_s else None,
            "reader_bytes_per_s": round(SLOW_READ_BYTES / SLOW_READ_INTERVAL_S)}


def _count(samples: Mapping[str, float], name: str) -> int | None:
    """A gauge or counter of whole things (sequences, tokens) as the integer it is:
    Prometheus' text format writes every sample as a float (``1.0``)."""
    value = samples.get(name)
    return None if value is None or math.isnan(value) else round(value)


def _counted_between(before: Mapping[str, float], after: Mapping[str, float], name: str) -> int:
    """How much the counter ``name`` grew from ``before`` to ``after`` (0 if absent)."""
    return (_count(after, name) or 0) - (_count(before, name) or 0)


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
    timeline: list[tuple[float, int | None]] = [(0.0, _count(during, _RUNNING_GAUGE))]
    reset_at = time.perf_counter()
    reset(reader.sock)
    dropped_after_s: float | None = None
    after = during
    while time.perf_counter() - reset_at < _DROP_WAIT_S:
        after = engine_metrics(engine_socket)
        elapsed = time.perf_counter() - reset_at
        timeline.append((round(elapsed * 1000, 2), _count(after, _RUNNING_GAUGE)))
        if dropped_after_s is None and after.get(_RUNNING_GAUGE, 0) < during.get(_RUNNING_GAUGE, 0):
            dropped_after_s = elapsed
        if dropped_after_s is not None and elapsed > dropped_after_s + 0.2:
            break
        time.sleep(0.005)
    generated = _counted_between(before, after, _GENERATED_COUNTER)
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
            "running_before": _count(before, _RUNNING_GAUGE),
            "running_during": _count(during, _RUNNING_GAUGE),
            "running_after": _count(after, _RUNNING_GAUGE),
            "dropped": dropped_after_s is not None,
            "reset_to_drop_ms": None if dropped_after_s is None else round(dropped_after_s * 1000, 1),
            "tokens_generated": generated, "timeline_ms": timeline,
            "sidecar_end_reason": None if record is None else record.get("end_reason")}


def section_resume(engine_socket: str, model: str, settings: DemoSettings, workdir: Path,
                   *, echo: bool) -> dict[str, Any]:
    """5. Cut an answer mid-stream, resume it with Last-Event-ID, prove it identical."""
    body = chat_body(model, settings.resume_max_tokens)
    with extra_sidecars(engine_socket, workdir, {"resume": RESUME_SIDECAR_ARGS}, echo=echo) as sidecars:
        sidecar = sidecars[0]
        api = tcp_connector("127.0.0.1", sidecar.port)
        # The uninterrupted run (greedy decoding: the same prompt gives the same text).
        reference = read_all(api, "/v1/chat/completions", body)
        if not reference.complete:
            raise DemoError(f"the uninterrupted answer did not complete: {reference.error}")
        # The interrupted run: read some events, then the "phone" loses its network.
        before = engine_metrics(engine_socket)
        reader = stream_chat(api, body)
        first = reader.read(lambda a: a.events < settings.resume_read_events)
        if not first.stream_id or not first.ids:
            reader.sock.close()
            raise DemoError("the resumable sidecar sent no stream id or event ids")
        reset(reader.sock)
        last_id = first.ids[-1]
        rest = read_all(api, f"/v1/streams/{first.stream_id}", method="GET",
                         headers=[("last-event-id", last_id)])
        after = engine_metrics(engine_socket)
        # An idempotent repeat: the second request gets the first one's answer.
        key = [("idempotency-key", f"demo-{first.stream_id}")]
        one = read_all(api, "/v1/chat/completions", body, headers=key)
        between = engine_metrics(engine_socket)
        two = read_all(api, "/v1/chat/completions", body, headers=key)
        last = engine_metrics(engine_socket)
        records = [json.loads(line) for line in sidecar.log_file.read_text().splitlines()
                   if line.strip()] if sidecar.log_file.exists() else []
    ids = first.ids + rest.ids
    seqs = [int(i.rpartition(".")[2]) for i in ids]
    generated = _counted_between(before, after, _GENERATED_COUNTER)
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
        "idempotent_second_engine_tokens": _counted_between(between, last, _GENERATED_COUNTER),
        "idempotent_same_ids": one.ids == two.ids,
    }

