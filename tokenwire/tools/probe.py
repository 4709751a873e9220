"""``tokenwire probe TARGET``: what a client actually experiences on a stream.

Runs ``--requests`` streamed chat completions (or text completions, ``--api
completions``), ``--concurrency`` at a time, against an OpenAI-compatible
base URL or an engine's Unix socket (``unix:PATH``), after ``--warmup``
unmeasured ones, and reports per target: time to first token (the first event
that carries one: an engine's role-only first chunk is not a token), the
inter-token gap from the first token on (so prefill is in TTFT, never in the
gaps), the gaps between all events, the whole answer's time, tokens per
second, events vs tokens (tokens from the usage block, asked for with
``stream_options.include_usage``), truncation (a stream with no finish reason
or no ``[DONE]`` is truncated, whatever the status said) and in-band errors.

``--compare TARGET2`` sends the same requests to a second target, interleaved
pair by pair (see ``probe_load``), and reports each figure's difference, pair
by pair, with a 95 % interval: say, the engine's socket direct against the
sidecar in front of it.

It measures the client side only, so it needs nothing from the server but the
OpenAI wire format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from .probe_load import StreamOutcome, Target, Workload, run_load, run_targets
from .stats import ms, paired_difference, percentile

__all__ = ["main", "run_load", "summarize"]


def _spread_ms(values: list[float], *tails: str) -> dict[str, float | None]:
    figures = {"p50": ms(percentile(values, 50)), "p99": ms(percentile(values, 99))}
    if "mean" in tails:
        figures["mean"] = ms(statistics.fmean(values)) if values else None
    if "max" in tails:
        figures["max"] = ms(max(values)) if values else None
    return figures


def summarize(outcomes: list[StreamOutcome]) -> dict[str, Any]:
    """Aggregate figures over all probed streams of one target."""
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [g for o in outcomes for g in o.gaps_s]
    itls = [g for o in outcomes for g in o.itl_s]
    durations = [o.duration_s for o in outcomes if o.duration_s is not None and o.error is None]
    tokens = [o.completion_tokens for o in outcomes if o.completion_tokens is not None]
    rates = [rate for o in outcomes if (rate := o.tokens_per_s) is not None]
    return {
        "requests": len(outcomes),
        "ok": sum(o.error is None and not o.truncated for o in outcomes),
        "truncated": sum(o.truncated for o in outcomes),
        "errors": sum(o.error is not None for o in outcomes),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:5],
        "ttft_ms": _spread_ms(ttfts, "mean"),
        "event_gap_ms": _spread_ms(gaps, "max"),
        "events": sum(o.events for o in outcomes),
        "tokens": sum(tokens) if tokens else None,
        "itl_ms": _spread_ms(itls, "max"),
        "duration_ms": _spread_ms(durations, "mean"),
        "tokens_per_s": {"p50": _round(percentile(rates, 50)), "min": _round(min(rates) if rates else None)},
        "content_events": sum(o.content_events for o in outcomes),
        "tokens_from": "usage" if len(tokens) == len(outcomes) and tokens else "events",
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


_COMPARED: tuple[tuple[str, Callable[[StreamOutcome], float | None], float], ...] = (
    ("ttft_ms", lambda o: o.ttft_s, 1000.0),
    ("itl_p50_ms", lambda o: percentile(o.itl_s, 50), 1000.0),
    ("duration_ms", lambda o: o.duration_s, 1000.0),
    ("tokens_per_s", lambda o: o.tokens_per_s, 1.0),
)
"""Per-stream figures compared pair by pair, and the scale they are shown at."""


def compare(first: list[StreamOutcome], second: list[StreamOutcome]) -> dict[str, Any]:
    """Each figure's difference (second minus first) over the pairs where both streams completed."""
    mates = {o.pair: o for o in first if o.error is None and not o.truncated}
    pairs = [(mates[o.pair], o) for o in second if o.error is None and not o.truncated and o.pair in mates]
    out: dict[str, Any] = {}
    for name, figure, scale in _COMPARED:
        values = [(a_value, b_value) for a, b in pairs
                  if (a_value := figure(a)) is not None and (b_value := figure(b)) is not None]
        out[name] = paired_difference(values, scale=scale)
    return out


def _print_summary(label: str, summary: dict[str, Any]) -> None:
    print(f"{label}: {summary['ok']}/{summary['requests']} complete, "
          f"{summary['truncated']} truncated, {summary['errors']} errors")
    ttft, itl, gap = summary["ttft_ms"], summary["itl_ms"], summary["event_gap_ms"]
    whole, rate = summary["duration_ms"], summary["tokens_per_s"]
    print(f"  TTFT ms            p50 {ttft['p50']}  p99 {ttft['p99']}  (first token, not the role chunk)")
    print(f"  inter-token ms     p50 {itl['p50']}  p99 {itl['p99']}  max {itl['max']}  "
          "(from the first token)")
    print(f"  event gap ms       p50 {gap['p50']}  p99 {gap['p99']}  max {gap['max']}  (all events)")
    print(f"  whole answer ms    p50 {whole['p50']}  p99 {whole['p99']}")
    print(f"  tokens/s a stream  p50 {rate['p50']}  min {rate['min']}")
    print(f"  events {summary['events']} ({summary['content_events']} with a token) "
          f"vs tokens {summary['tokens']}")
    for sample in summary["error_samples"]:
        print(f"  error: {sample}")


def _print_compare(first: str, second: str, diffs: dict[str, Any]) -> None:
    print(f"{second} minus {first}, pair by pair (median [95% interval], pairs):")
    for name, diff in diffs.items():
        if diff["median"] is None:
            print(f"  {name:<14} no complete pairs")
            continue
        low, high = diff["ci95"]
        print(f"  {name:<14} {diff['median']:+} [{low:+}, {high:+}]  ({diff['pairs']} pairs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire probe`` flags."""
    parser.description = ("What a client experiences on a stream: time to first token, inter-token gaps, "
                          "whole-answer time, tokens per second, truncation and in-band errors; "
                          "--compare measures the difference between two targets.")
    parser.add_argument("url", metavar="TARGET",
                        help="OpenAI-compatible base URL (http://127.0.0.1:8080) or an engine's "
                             "Unix socket (unix:/run/engine.sock)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="streams open at once (default %(default)s)")
    parser.add_argument("--requests", type=int, default=32,
                        help="measured streams per target (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="unmeasured streams per target first (default %(default)s)")
    parser.add_argument("--compare", metavar="TARGET2",
                        help="a second target: the same requests, interleaved pair by pair")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions or /v1/completions (default %(default)s)")
    parser.add_argument("--model", default="tiny", help="the request's model field (default %(default)s)")
    parser.add_argument("--prompt", default="Tell me about the sea.",
                        help="the user message (or prompt) of every request (default %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of every request (default %(default)s)")
    parser.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                        help="an extra request header, e.g. 'Authorization: Bearer KEY' (repeatable)")
    parser.add_argument("--ca-file", metavar="PEM", default="",
                        help="CA bundle to verify https targets with (default: the system's)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="connect, read and write timeout: a stream silent this long fails "
                             "(default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _headers(given: Sequence[str], parser: argparse.ArgumentParser) -> tuple[tuple[str, str], ...]:
    headers = []
    for text in given:
        name, sep, value = text.partition(":")
        if not sep or not name.strip():
            parser.error(f"--header must be 'NAME: VALUE', got {text!r}")
        headers.append((name.strip(), value.strip()))
    return tuple(headers)


def main(argv: list[str] | None = None) -> int:
    """``tokenwire probe``: run the load, print the summary; 0 if every stream completed."""
    parser = argparse.ArgumentParser(prog="tokenwire probe", allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.warmup < 0:
        parser.error("--concurrency and --requests must be >= 1, --warmup >= 0")
    labels = [args.url] + ([args.compare] if args.compare else [])
    if len(set(labels)) != len(labels):
        parser.error("--compare needs a second, different target")
    try:
        targets = [Target.parse(label, ca_file=args.ca_file) for label in labels]
    except ValueError as exc:
        parser.error(str(exc))
    workload = Workload(args.model, args.prompt, args.max_tokens, args.api, _headers(args.header, parser))
    result = asyncio.run(run_targets(
        targets, workload, requests=args.requests, concurrency=args.concurrency, warmup=args.warmup,
        timeout_s=args.timeout_s, progress=not args.json and args.requests * len(targets) >= 20))
    report: dict[str, Any] = {}
    for label in labels:
        outcomes = result.outcomes[label]
        report[label] = {"summary": summarize(outcomes), "streams": [asdict(o) for o in outcomes]}
    tokens = sum(o.tokens for outcomes in result.outcomes.values() for o in outcomes)
    report["run"] = {"api": args.api, "concurrency": args.concurrency, "warmup": args.warmup,
                     "wall_s": round(result.wall_s, 3),
                     "tokens_per_s": round(tokens / result.wall_s, 2) if result.wall_s else None,
                     "order": "pairs, AB then BA" if args.compare else "one target"}
    if args.compare:
        a, b = (report[label]["summary"]["ttft_ms"]["p50"] for label in labels)
        report["ttft_gap_p50_ms"] = None if a is None or b is None else round(b - a, 2)
        report["compare"] = {"first": labels[0], "second": labels[1],
                             **compare(result.outcomes[labels[0]], result.outcomes[labels[1]])}
    if args.json:
        print(json.dumps(report))
    else:
        for label in labels:
            _print_summary(label, report[label]["summary"])
        print(f"all streams: {report['run']['tokens_per_s']} tokens/s in {report['run']['wall_s']} s")
        if args.compare:
            _print_compare(labels[0], labels[1], {k: v for k, v in report["compare"].items()
                                                  if k not in ("first", "second")})
    failed = any(report[label]["summary"]["ok"] < report[label]["summary"]["requests"] for label in labels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
