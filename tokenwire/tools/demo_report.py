"""The demo's reports: the terminal text, the HTML page with its plots, ``report.json``."""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any

from .demo_sections import RESUME_SIDECAR_ARGS


def _elide(text: str, keep: int = 150) -> str:
    if len(text) <= keep:
        return text
    return text[:40] + " … " + text[-(keep - 40):]


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
                ("upstream_pauses", "upstream paused"), ("producer_wait_s", "engine waited s"),
                ("end_reason", "end reason"),
                ("wall_s", "wall s")]


def policy_lines(slow: dict[str, Any]) -> list[str]:
    """What each policy did to this answer, in words, from the rows' own figures:
    the three rows are often alike, and these lines say which figure tells them
    apart and why (middleware/core/pending.py and decisions.py say what each does)."""
    rows = {row["policy"]: row for row in slow["rows"]}
    lines: list[str] = []
    coalesce = rows.get("coalesce")
    if coalesce:
        lines.append(f"coalesce: text that waits for the reader merges into fewer, larger events "
                     f"({_fmt(coalesce['coalesced_events'])} merged away, the text exact); "
                     f"the reader got {_fmt(coalesce['events_received'])} events for "
                     f"{_fmt(coalesce['tokens_generated'])} tokens")
    block = rows.get("block")
    if block:
        pause_at = slow["block_pause_at_bytes"]
        line = (f"block: merges nothing (every event as the engine sent it) and stops reading the "
                f"upstream once {pause_at} B wait (block_window_bytes), so the engine waits for the reader")
        pauses = block["upstream_pauses"]
        if pauses is None:
            line += "; its log did not say whether it paused"
        elif pauses:
            line += (f"; it paused the upstream {pauses} time(s), pending at most "
                     f"{_fmt(block['pending_high_water_bytes'])} B, and the engine waited "
                     f"{_fmt(block['producer_wait_s'])} s")
        else:
            line += (f"; pending peaked at {_fmt(block['pending_high_water_bytes'])} B, so it never "
                     f"paused (upstream paused 0): the reader kept up with this answer")
        lines.append(line)
    drop = rows.get("drop")
    if drop:
        line = ("drop: merges the same way, and also lets a newer event of a "
                "--droppable-event-types type replace a queued one (an `event: tokenwire.dropped` "
                "says how many); none is set here, and answer text is never dropped")
        if drop["same_text_as_direct"]:
            line += f", so it delivered the whole text ({_fmt(drop['dropped_events'])} dropped)"
        lines.append(line)
    return lines


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
                       ["inter-token gap ms", _fmt(gap["p50"]), _fmt(gap["p95"]), _fmt(gap["p99"])]])
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
        out += [f"  {line}" for line in policy_lines(slow)]
    drop = report.get("drop")
    if drop:
        out += ["", f"4. A dropped connection: a {drop['max_tokens']}-token answer, "
                    f"{drop['events_read']} events read, then RST (SO_LINGER 0)"]
        out.append(f"  engine running sequences: before {_fmt(drop['running_before'])}, "
                   f"while streaming {_fmt(drop['running_during'])}, "
                   f"after reset {_fmt(drop['running_after'])}")
        if drop["dropped"]:
            out.append(f"  the count dropped {drop['reset_to_drop_ms']} ms after the reset; the engine "
                       f"generated {_fmt(drop['tokens_generated'])} of {drop['max_tokens']} tokens")
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
                f"  the engine generated {_fmt(resume['engine_tokens_for_interrupted_run'])} tokens for "
                f"the interrupted answer ({_fmt(resume['completion_tokens'])} in it): one generation; "
                f"first request's record: end_reason={resume['first_request_end_reason']}",
                f"  Idempotency-Key sent twice: same text={_fmt(resume['idempotent_same_text'])}, "
                f"same ids={_fmt(resume['idempotent_same_ids'])}, engine tokens for the second: "
                f"{_fmt(resume['idempotent_second_engine_tokens'])}"]
    if report.get("failures"):
        out += ["", "checks failed:"] + [f"  - {failure}" for failure in report["failures"]]
    else:
        out += ["", "all checks passed"]
    return "\n".join(out) + "\n"



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
        ax.set_xlabel("gap between tokens at the client, from the first token on (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"Inter-token gaps, {timing['requests']} streams x{timing['concurrency']}")
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
    # A reading without the gauge (None) has no point to draw.
    timeline = [(at, running) for at, running in (drop or {}).get("timeline_ms", []) if running is not None]
    if timeline:
        fig, ax = plt.subplots(figsize=(7, 3))
        xs, ys = zip(*timeline, strict=True)
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
                               ["inter-token gap ms"] + [_fmt(gap[q]) for q in ("p50", "p95", "p99")]])]
        if "gaps.png" in plots:
            parts.append("<img src='gaps.png' alt='inter-token gap histogram'>")
    slow = report.get("slow_reader")
    if slow:
        parts += ["<h2>3. A slow reader under each policy</h2>",
                  f"<p>SO_RCVBUF {slow['receive_buffer_bytes']}, recv({slow['read_bytes']}) every "
                  f"{slow['read_interval_ms']:g} ms; the engine generated the answer in "
                  f"{slow['engine_generation_s']} s.</p>",
                  _html_table([label for _, label in SLOW_COLUMNS],
                              [[_fmt(row[key]) for key, _ in SLOW_COLUMNS] for row in slow["rows"]]),
                  "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in policy_lines(slow))
                  + "</ul>"]
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



def write_report(report: dict[str, Any], out_dir: Path) -> str:
    """Write report.json, the PNGs and report.html; return the terminal text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = render_text(report)
    plots = write_plots(report, out_dir)
    report["plots"] = plots
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.html").write_text(render_html(report, text, plots))
    return text

