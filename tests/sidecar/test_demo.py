"""``tokenwire demo`` end to end: a real engine, real sidecars, real sockets.

The tiny model is built into a pytest temp dir (``TOKENWIRE_CACHE_DIR``), with a
short training run: the tour needs a model that streams tokens, not prose, and
nothing here may depend on what happens to sit in ``~/.cache``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenwire.tools.demo_sections import split_wire

pytestmark = pytest.mark.slow

_DEMO_TIMEOUT_S = 420  # a loaded two-core machine; the tour itself takes ~20 s


def _run_demo(args: list[str], cache_dir: Path | None = None,
              timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    if cache_dir is not None:
        env["TOKENWIRE_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "tokenwire.sidecar", "demo", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.slow
@pytest.mark.timeout(_DEMO_TIMEOUT_S + 60)
def test_demo_runs_the_whole_tour_and_writes_the_report(tiny_cache: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    cache_dir, model_dir = tiny_cache
    out_dir = tmp_path / "report"
    result = _run_demo(["--quick", "--model", str(model_dir), "--out", str(out_dir)],
                       cache_dir, timeout_s=_DEMO_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stdout = result.stdout
    for heading in ("1. The wire", "2. Timing", "3. A slow reader", "4. A dropped connection",
                    "5. Resume", "all checks passed"):
        assert heading in stdout
    assert "text/event-stream" in stdout and "\\n\\n\\r\\n" in stdout  # bytes shown escaped
    assert "Last-Event-ID" in stdout

    report: dict[str, Any] = json.loads((out_dir / "report.json").read_text())
    assert report["wire"]["complete"] and report["wire"]["answer"]["saw_done"]
    assert report["timing"]["ok"] == report["timing"]["requests"]
    rows = {row["policy"]: row for row in report["slow_reader"]["rows"]}
    assert set(rows) == {"coalesce", "block", "drop", "direct"}
    for policy in ("coalesce", "block"):
        row = rows[policy]
        assert row["complete"], row
        assert row["text_chars"] > 0 and row["tokens_generated"] == report["settings"]["slow_max_tokens"]
        assert row["end_reason"] == "complete"
        assert row["pending_high_water_bytes"] is not None
    # Whether block stopped reading the upstream is measured (the sidecar's ``paused``
    # milestones), and it is the one figure that may tell block from coalesce: the
    # table has its column, and the words under it say what this run's figures show.
    slow_header = next(line for line in stdout.splitlines() if line.strip().startswith("reader "))
    assert "upstream paused" in slow_header
    for policy in ("coalesce", "block", "drop"):
        assert isinstance(rows[policy]["upstream_pauses"], int), rows[policy]
    assert rows["coalesce"]["upstream_pauses"] == 0  # coalesce never pauses a plain stream
    block = rows["block"]
    assert block["coalesced_events"] == 0, block  # block merges nothing: the engine waits instead
    assert isinstance(block["producer_wait_s"], float) and rows["coalesce"]["producer_wait_s"] == 0.0
    if block["upstream_pauses"]:
        assert f"it paused the upstream {block['upstream_pauses']} time(s)" in stdout
        assert block["producer_wait_s"] > 0 and "the engine waited" in stdout
    else:
        assert "so it never paused (upstream paused 0): the reader kept up" in stdout
    # drop is described by what it does: answer text is never dropped, and here it was not.
    assert "keeps only the newest event" not in stdout
    assert rows["drop"]["same_text_as_direct"] and rows["drop"]["dropped_events"] == 0
    assert "answer text is never dropped, so it delivered the whole text (0 dropped)" in stdout
    drop = report["drop"]
    assert drop["dropped"], drop
    # Counts are whole numbers everywhere: in report.json, on the terminal, in the HTML
    # (the engine's Prometheus text writes every sample as a float, ``8.0``).
    counts = [drop["running_before"], drop["running_during"], drop["running_after"],
              drop["tokens_generated"], *(running for _, running in drop["timeline_ms"]),
              report["resume"]["engine_tokens_for_interrupted_run"],
              report["resume"]["idempotent_second_engine_tokens"]]
    assert all(type(count) is int for count in counts), counts
    assert (f"engine running sequences: before {drop['running_before']}, while streaming "
            f"{drop['running_during']}, after reset {drop['running_after']}") in stdout
    assert f"the engine generated {drop['tokens_generated']} of {drop['max_tokens']} tokens" in stdout
    resume_tokens = report["resume"]["engine_tokens_for_interrupted_run"]
    assert f"the engine generated {resume_tokens} tokens for the interrupted answer" in stdout
    assert "engine tokens for the second: 0\n" in stdout
    assert drop["running_during"] >= 1 and drop["running_after"] < drop["running_during"]
    assert drop["tokens_generated"] < drop["max_tokens"]
    assert drop["sidecar_end_reason"] == "client_gone"
    resume = report["resume"]
    assert resume["text_identical"] and resume["ids_contiguous"] and resume["duplicate_ids"] == 0
    assert resume["resumed_complete"] and resume["resumed_status"] == 200
    # One generation for the interrupted answer, none for the idempotent repeat.
    assert resume["engine_tokens_for_interrupted_run"] == resume["max_tokens"]
    assert resume["idempotent_same_text"] and resume["idempotent_second_engine_tokens"] == 0
    assert resume["first_request_end_reason"] == "detached"

    html = (out_dir / "report.html").read_text()
    assert (f"<tr><td>{drop['running_before']}</td><td>{drop['running_during']}</td>"
            f"<td>{drop['running_after']}</td><td>{drop['reset_to_drop_ms']}</td>"
            f"<td>{drop['tokens_generated']}</td></tr>") in html
    assert "<th>upstream paused</th>" in html and "answer text is never dropped" in html
    for plot in ("gaps.png", "policies.png", "drop.png"):
        assert (out_dir / plot).stat().st_size > 1000
        assert plot in html


def test_demo_wants_url_and_engine_socket_together() -> None:
    result = _run_demo(["--url", "http://127.0.0.1:9"])
    assert result.returncode == 2
    assert "--url and --engine-socket go together" in result.stderr


def test_demo_fails_clearly_without_an_engine(tmp_path: Path) -> None:
    result = _run_demo(["--url", "http://127.0.0.1:9", "--engine-socket", str(tmp_path / "none.sock"),
                        "--out", str(tmp_path / "out")])
    assert result.returncode == 1
    assert "no engine socket at" in result.stderr
    assert not (tmp_path / "out").exists()


def test_split_wire_keeps_the_chunked_framing_of_each_event() -> None:
    raw = (b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n\r\n"
           b"d\r\ndata: hello\n\n\r\n" b"e\r\ndata: [DONE]\n\n\r\n" b"0\r\n\r\n")
    head, chunks = split_wire(raw)
    assert head == [b"HTTP/1.1 200 \r\n", b"content-type: text/event-stream\r\n", b"\r\n"]
    assert chunks == [(b"d\r\n", b"data: hello\n\n\r\n"), (b"e\r\n", b"data: [DONE]\n\n\r\n"),
                      (b"0\r\n", b"\r\n")]
