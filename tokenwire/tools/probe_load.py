"""The probe's client: streamed completions against one or two targets, timed at the socket.

A target is an OpenAI-compatible base URL (``http(s)://host:port[/prefix]``)
or an engine's Unix socket (``unix:PATH``, the API at ``/v1``, as ``tokenwire
up`` runs it). Each of ``concurrency`` workers keeps one keep-alive connection
per target and sends one request at a time; every read off the socket is
stamped when it returns, and the events it completes share that stamp.

Two targets are compared pair by pair: a pair is the same request sent to
each target by the same worker, one after the other, the order alternating
(AB, BA, AB, ...) so neither target always goes first onto a warm batch.
Warm-up requests (not counted) go to every target before the measured ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import h11

from tokenwire.middleware.core.chunks import read_chunk
from tokenwire.middleware.core.sse import SSEEvent

from .sse_client import END, NEED_DATA, ResponseParser, request_bytes

Api = Literal["chat", "completions"]
_READ_BYTES = 65536


@dataclass(frozen=True, slots=True)
class Target:
    """Where to send the requests: TCP (``host``, ``port``, TLS) or a Unix socket (``unix_path``)."""

    label: str
    """The target as given on the command line (the report's key)."""
    base_path: str
    """The path the API's routes hang off, ``/v1`` or ``/prefix/v1``."""
    host: str = ""
    port: int = 0
    tls: bool = False
    unix_path: str = ""
    ca_file: str = ""
    """CA bundle to verify an ``https`` target with (empty: the system's)."""

    @classmethod
    def parse(cls, text: str, *, ca_file: str = "") -> Target:
        """``http(s)://host[:port][/prefix]`` or ``unix:PATH``; a ValueError names a bad one."""
        if text.startswith("unix:"):
            path = text[len("unix:"):]
            if not path:
                raise ValueError(f"unix: needs a socket path, got {text!r}")
            return cls(text, "/v1", unix_path=path)
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"URL must be http(s)://host[:port][/prefix] or unix:PATH, got {text!r}")
        prefix = parts.path.rstrip("/")
        base = prefix if prefix.endswith("/v1") else prefix + "/v1"
        tls = parts.scheme == "https"
        return cls(text, base, host=parts.hostname, port=parts.port or (443 if tls else 80), tls=tls,
                   ca_file=ca_file)

    @property
    def host_header(self) -> str:
        if self.unix_path:
            return "localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port in (80, 443) else f"{host}:{self.port}"

    async def connect(self, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.unix_path:
            opening = asyncio.open_unix_connection(self.unix_path, limit=_READ_BYTES)
        else:
            context = ssl.create_default_context(cafile=self.ca_file or None) if self.tls else None
            opening = asyncio.open_connection(self.host, self.port, ssl=context, limit=_READ_BYTES)
        return await asyncio.wait_for(opening, timeout_s)


@dataclass(frozen=True, slots=True)
class Workload:
    """What every request asks for."""

    model: str = "tiny"
    prompt: str = "Tell me about the sea."
    max_tokens: int = 64
    api: Api = "chat"
    headers: tuple[tuple[str, str], ...] = ()
    """Extra request headers (``Authorization``, ...)."""

    @property
    def route(self) -> str:
        return "/chat/completions" if self.api == "chat" else "/completions"

    def body(self) -> bytes:
        request: dict[str, Any] = {"model": self.model, "stream": True, "max_tokens": self.max_tokens,
                                   "stream_options": {"include_usage": True}}
        if self.api == "chat":
            request["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            request["prompt"] = self.prompt
        return json.dumps(request).encode()


@dataclass
class StreamOutcome:
    """One probed stream, as the client saw it. Times are seconds from the request's start."""

    target: str = ""
    pair: int | None = None
    """The pair (or request) number: the same number on each target is one comparison."""
    status: int = 0
    ttft_s: float | None = None
    """Until the first event that carries a token (text, reasoning or a tool call): an
    engine's role-only first chunk comes before prefill ends and is not one."""
    duration_s: float | None = None
    """Until the body's last byte: the whole answer."""
    gaps_s: list[float] = field(default_factory=list)
    """Between consecutive data events, the role-only chunk included."""
    itl_s: list[float] = field(default_factory=list)
    """Between consecutive token-carrying events, from the first on (no prefill in it)."""
    events: int = 0
    content_events: int = 0
    content_chars: int = 0
    completion_tokens: int | None = None
    """From the usage block (asked for with ``stream_options.include_usage``)."""
    finish_reason: str | None = None
    saw_done: bool = False
    error: str | None = None

    @property
    def truncated(self) -> bool:
        return self.error is None and (self.finish_reason is None or not self.saw_done)

    @property
    def tokens(self) -> int:
        """Tokens of the answer: the usage block's count, else the token-carrying events."""
        return self.completion_tokens if self.completion_tokens is not None else self.content_events

    @property
    def tokens_per_s(self) -> float | None:
        """Answer tokens over the whole answer's time, as its reader experienced it."""
        if not self.duration_s or self.error is not None or not self.tokens:
            return None
        return self.tokens / self.duration_s


class _Tally:
    """Turns the SSE events of one stream into its :class:`StreamOutcome`."""

    def __init__(self, outcome: StreamOutcome, started: float) -> None:
        self.outcome = outcome
        self.started = started
        self.last_event_at: float | None = None
        self.last_token_at: float | None = None

    def take(self, event: SSEEvent, now: float) -> None:
        outcome = self.outcome
        if event.data is None:  # a comment (heartbeat) or an id-only event
            return
        if event.data == "[DONE]":
            outcome.saw_done = True
            return
        outcome.events += 1
        if self.last_event_at is not None:
            outcome.gaps_s.append(now - self.last_event_at)
        self.last_event_at = now
        facts = read_chunk(event.data)
        if facts.error is not None:
            outcome.error = facts.error
            return
        if facts.completion_tokens is not None:
            outcome.completion_tokens = facts.completion_tokens
        if facts.carries_token:
            outcome.content_events += 1
            outcome.content_chars += len(facts.text)
            if self.last_token_at is None:
                outcome.ttft_s = now - self.started
            else:
                outcome.itl_s.append(now - self.last_token_at)
            self.last_token_at = now
        if facts.finish_reason is not None:
            outcome.finish_reason = facts.finish_reason


class KeepAlive:
    """One worker's connection to one target, reused while the server allows."""

    def __init__(self, target: Target, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()

    async def stream(self, workload: Workload, body: bytes) -> StreamOutcome:
        """Send one request (connecting if need be) and read its answer.

        A kept-alive connection the server closed while idle (uvicorn does
        after 5 s) fails before any answer: the request goes once more, on a
        new connection and with a new clock, as any HTTP client's pool does."""
        if self._streams is not None and self._streams[0].at_eof():
            await self.close()
        reused = self._streams is not None
        outcome = await self._attempt(workload, body)
        if reused and outcome.error is not None and outcome.status == 0:
            outcome = await self._attempt(workload, body)
        return outcome

    async def _attempt(self, workload: Workload, body: bytes) -> StreamOutcome:
        target, timeout_s = self.target, self.timeout_s
        outcome = StreamOutcome(target=target.label)
        started = time.perf_counter()  # a new connection's setup is part of what the client waits for
        try:
            if self._streams is None:
                self._streams = await target.connect(timeout_s)
                self._conn = h11.Connection(h11.CLIENT)
            reader, writer = self._streams
            writer.write(request_bytes(self._conn, "POST", target.base_path + workload.route, body,
                                       headers=[("accept", "text/event-stream"), *workload.headers],
                                       host=target.host_header))
            await asyncio.wait_for(writer.drain(), timeout_s)
            await self._read(reader, outcome, started)
        except TimeoutError:  # (an OSError: caught first)
            outcome.error = outcome.error or f"timeout: nothing for {timeout_s:g} s"
        except (OSError, ssl.SSLError, h11.LocalProtocolError) as error:
            outcome.error = outcome.error or f"{type(error).__name__}: {error}"
        if outcome.error is not None or not self._reusable():
            await self.close()
        return outcome

    async def _read(self, reader: asyncio.StreamReader, outcome: StreamOutcome, started: float) -> None:
        parser = ResponseParser(self._conn)
        tally = _Tally(outcome, started)
        now = started
        while (event := parser.next_event()) is not END:
            if event is NEED_DATA:
                data = await asyncio.wait_for(reader.read(_READ_BYTES), self.timeout_s)
                now = time.perf_counter()
                parser.receive_data(data)
            elif isinstance(event, SSEEvent) and parser.response.status == 200:
                tally.take(event, now)
        response = parser.current()
        outcome.status = response.status
        outcome.duration_s = now - started
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {response.body[:300].decode('utf-8', 'replace')}"
        elif response.error and outcome.error is None:
            outcome.error = response.error
        elif not response.clean_end and outcome.error is None:
            outcome.error = "the connection closed before the body's end"

    def _reusable(self) -> bool:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False


@dataclass
class LoadResult:
    """What a run measured: the streams per target, and how long the measured part took."""

    outcomes: dict[str, list[StreamOutcome]]
    wall_s: float
    warmup: int


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            bar = "#" * (30 * self.done // self.total)
            print(f"\r  [{bar:<30}] {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


async def run_targets(targets: Sequence[Target], workload: Workload, *, requests: int, concurrency: int,
                      warmup: int = 0, timeout_s: float = 60.0, progress: bool = False) -> LoadResult:
    """``warmup`` unmeasured requests per target, then ``requests`` per target,
    ``concurrency`` at a time; with two targets, in alternating pairs (module docstring)."""
    body = workload.body()
    outcomes: dict[str, list[StreamOutcome]] = {t.label: [] for t in targets}
    meter = _Progress(requests * len(targets), progress)

    async def worker(units: asyncio.Queue[tuple[int, bool]], links: dict[str, KeepAlive]) -> None:
        while not units.empty():
            index, measured = units.get_nowait()
            # Pair ``index`` goes AB when even, BA when odd.
            order = targets if index % 2 == 0 else list(reversed(targets))
            for target in order:
                outcome = await links[target.label].stream(workload, body)
                if measured:
                    outcome.pair = index
                    outcomes[target.label].append(outcome)
                    meter.step()

    async def phase(count: int, measured: bool, links: list[dict[str, KeepAlive]]) -> None:
        units: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        for index in range(count):
            units.put_nowait((index, measured))
        await asyncio.gather(*(worker(units, own) for own in links))

    links = [{t.label: KeepAlive(t, timeout_s) for t in targets} for _ in range(concurrency)]
    try:
        await phase(warmup, False, links)
        started = time.perf_counter()
        await phase(requests, True, links)
        wall_s = time.perf_counter() - started
    finally:
        await asyncio.gather(*(link.close() for own in links for link in own.values()))
        meter.end()
    return LoadResult(outcomes, wall_s, warmup)


async def run_load(base_url: str, *, requests: int, concurrency: int, model: str, prompt: str,
                   max_tokens: int, timeout_s: float, progress: bool, warmup: int = 0,
                   api: Api = "chat") -> list[StreamOutcome]:
    """Run ``requests`` streams against one target, ``concurrency`` at a time."""
    target = Target.parse(base_url)
    result = await run_targets([target], Workload(model, prompt, max_tokens, api), requests=requests,
                               concurrency=concurrency, warmup=warmup, timeout_s=timeout_s,
                               progress=progress)
    return result.outcomes[target.label]
