"""``tokenwire probe URL``: what a client actually experiences on a stream.

Runs ``--requests`` streamed chat completions, ``--concurrency`` at a time,
against an OpenAI-compatible base URL and reports, per run: time to first
token, inter-event gaps (p50/p99, between SSE *events* as the client reads
them), events vs tokens (tokens from the usage block, asked for with
``stream_options.include_usage``), truncation (a stream with no finish reason
or no ``[DONE]`` is truncated, whatever the status said) and in-band errors.
``--compare URL2`` runs the same load against a second URL (say, the engine
direct and through an ingress) and prints the TTFT gap.

It measures the client side only, so it needs nothing from the server but the
OpenAI wire format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpcore
from tokenwire.middleware.chunks import read_chunk
from tokenwire.middleware.sse import SSEParser


@dataclass
class StreamOutcome:
    """One probed stream, as the client saw it."""

    status: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    events: int = 0
    content_chars: int = 0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    error: str | None = None

    @property
    def truncated(self) -> bool:
        return self.error is None and (self.finish_reason is None or not self.saw_done)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


async def probe_one(pool: httpcore.AsyncConnectionPool, url: str, body: bytes,
                    timeout_s: float) -> StreamOutcome:
    """Stream one completion and record what arrived, and when."""
    outcome = StreamOutcome()
    started = time.perf_counter()
    last_event_at: float | None = None
    parser = SSEParser()
    headers = [(b"content-type", b"application/json"), (b"accept", b"text/event-stream")]
    timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
    try:
        async with pool.stream("POST", url, headers=headers, content=body,
                               extensions={"timeout": timeouts}) as response:
            outcome.status = response.status
            if response.status != 200:
                raw = b"".join([chunk async for chunk in response.aiter_stream()])
                outcome.error = f"HTTP {response.status}: {raw[:300].decode('utf-8', 'replace')}"
                return outcome
            async for chunk in response.aiter_stream():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    if event.data is None:
                        continue
                    if event.data == "[DONE]":
                        outcome.saw_done = True
                        continue
                    outcome.events += 1
                    if last_event_at is not None:
                        outcome.gaps_s.append(now - last_event_at)
                    last_event_at = now
                    _read_chunk(event.data, outcome, now - started)
    except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
        outcome.error = outcome.error or f"{type(exc).__name__}: {exc}"
    return outcome


def _read_chunk(data: str, outcome: StreamOutcome, elapsed_s: float) -> None:
    facts = read_chunk(data)
    if facts.error is not None:
        outcome.error = facts.error
        return
    if facts.completion_tokens is not None:
        outcome.completion_tokens = facts.completion_tokens
    if facts.text:
        outcome.content_chars += len(facts.text)
        if outcome.ttft_s is None:
            outcome.ttft_s = elapsed_s
    if facts.finish_reason is not None:
        outcome.finish_reason = facts.finish_reason


async def run_load(base_url: str, *, requests: int, concurrency: int, model: str, prompt: str,
                   max_tokens: int, timeout_s: float, progress: bool) -> list[StreamOutcome]:
    """Run ``requests`` streams against ``base_url``, ``concurrency`` at a time."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"URL must be http(s)://host[:port][/prefix], got {base_url!r}")
    url = base_url.rstrip("/") + ("" if parts.path.rstrip("/").endswith("/v1") else "/v1")
    url += "/chat/completions"
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }).encode()
    gate = asyncio.Semaphore(concurrency)
    outcomes: list[StreamOutcome] = []

    async with httpcore.AsyncConnectionPool(max_connections=concurrency) as pool:
        async def one() -> None:
            async with gate:
                outcomes.append(await probe_one(pool, url, body, timeout_s))
                if progress:
                    done = len(outcomes)
                    bar = "#" * (30 * done // requests)
                    print(f"\r  [{bar:<30}] {done}/{requests}", end="", file=sys.stderr, flush=True)

        await asyncio.gather(*(one() for _ in range(requests)))
    if progress:
        print(file=sys.stderr)
    return outcomes


def summarize(outcomes: list[StreamOutcome]) -> dict[str, Any]:
    """Aggregate figures over all probed streams."""
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [g for o in outcomes for g in o.gaps_s]
    tokens = [o.completion_tokens for o in outcomes if o.completion_tokens is not None]
    return {
        "requests": len(outcomes),
        "ok": sum(o.error is None and not o.truncated for o in outcomes),
        "truncated": sum(o.truncated for o in outcomes),
        "errors": sum(o.error is not None for o in outcomes),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:5],
        "ttft_ms": {"p50": _ms(_percentile(ttfts, 50)), "p99": _ms(_percentile(ttfts, 99)),
                    "mean": _ms(statistics.fmean(ttfts)) if ttfts else None},
        "event_gap_ms": {"p50": _ms(_percentile(gaps, 50)), "p99": _ms(_percentile(gaps, 99)),
                         "max": _ms(max(gaps)) if gaps else None},
        "events": sum(o.events for o in outcomes),
        "tokens": sum(tokens) if tokens else None,
    }


def _print_summary(label: str, summary: dict[str, Any]) -> None:
    print(f"{label}: {summary['ok']}/{summary['requests']} complete, "
          f"{summary['truncated']} truncated, {summary['errors']} errors")
    ttft, gap = summary["ttft_ms"], summary["event_gap_ms"]
    print(f"  TTFT ms        p50 {ttft['p50']}  p99 {ttft['p99']}")
    print(f"  event gap ms   p50 {gap['p50']}  p99 {gap['p99']}  max {gap['max']}")
    print(f"  events {summary['events']} vs tokens {summary['tokens']}")
    for sample in summary["error_samples"]:
        print(f"  error: {sample}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire probe`` flags."""
    parser.description = ("What a client experiences on a stream: time to first token, gaps between "
                          "events, events vs tokens, truncation and in-band errors.")
    parser.add_argument("url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="streams open at once (default %(default)s)")
    parser.add_argument("--requests", type=int, default=32,
                        help="streamed chat completions in all (default %(default)s)")
    parser.add_argument("--compare", metavar="URL2", help="run the same load against URL2 too")
    parser.add_argument("--model", default="tiny", help="the request's model field (default %(default)s)")
    parser.add_argument("--prompt", default="Tell me about the sea.",
                        help="the user message of every request (default %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of every request (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="connect, read and write timeout: a stream silent this long fails "
                             "(default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv: list[str] | None = None) -> int:
    """``tokenwire probe``: run the load, print the summary; 0 if every stream completed."""
    parser = argparse.ArgumentParser(prog="tokenwire probe")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be >= 1")
    urls = [args.url] + ([args.compare] if args.compare else [])
    report: dict[str, Any] = {}
    for url in urls:
        try:
            outcomes = asyncio.run(run_load(
                url, requests=args.requests, concurrency=args.concurrency, model=args.model,
                prompt=args.prompt, max_tokens=args.max_tokens, timeout_s=args.timeout_s,
                progress=not args.json and args.requests >= 20))
        except ValueError as exc:
            parser.error(str(exc))
        report[url] = {"summary": summarize(outcomes), "streams": [asdict(o) for o in outcomes]}
    if args.compare:
        a, b = (report[u]["summary"]["ttft_ms"]["p50"] for u in urls)
        report["ttft_gap_p50_ms"] = None if a is None or b is None else round(b - a, 2)
    if args.json:
        print(json.dumps(report))
    else:
        for url in urls:
            _print_summary(url, report[url]["summary"])
        if args.compare:
            print(f"TTFT gap (p50, {urls[1]} minus {urls[0]}): {report['ttft_gap_p50_ms']} ms")
    failed = any(report[u]["summary"]["ok"] < report[u]["summary"]["requests"] for u in urls)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
