"""``tokenwire probe``: client-side figures, truncation and errors, over real sockets.

The targets are real servers: the fake engine on TCP or on a Unix socket (as
``tokenwire up`` runs the engine), and a sidecar in front of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from clients import tls_server_files
from conftest import LoopThread
from tokenwire.middleware.core.chunks import read_chunk
from upstreams import DONE, FakeUpstream, ScriptedUpstream, chunk

from tokenwire.tools.probe import main
from tokenwire.tools.stats import paired_difference, percentile


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def unix_upstream(loop_thread: LoopThread) -> Iterator[tuple[FakeUpstream, str]]:
    """The fake engine on a Unix socket: (the fake, its socket path)."""
    with tempfile.TemporaryDirectory(prefix="tokenwire-probe-") as folder:
        path = os.path.join(folder, "engine.sock")
        fake = FakeUpstream()
        loop_thread.run(fake.start_unix(path))
        yield fake, path
        loop_thread.run(fake.stop())


def test_probe_when_streams_complete_then_counts_them_and_exits_zero(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/normal/v1"
    code, report = _run(capsys, url, "--requests", "6", "--concurrency", "3")
    summary = report[url]["summary"]
    assert code == 0
    assert (summary["requests"], summary["ok"], summary["truncated"], summary["errors"]) == (6, 6, 0, 0)
    assert summary["ttft_ms"]["p50"] is not None and summary["events"] > 0
    assert all(s["saw_done"] and s["finish_reason"] for s in report[url]["streams"])
    # The fake sends 5 tokens after a role-only chunk, then a finish and a usage chunk.
    assert summary["tokens"] == 30 and summary["content_events"] == 30 and summary["tokens_from"] == "usage"
    assert all(len(s["itl_s"]) == 4 and len(s["gaps_s"]) == 7 for s in report[url]["streams"])
    assert summary["duration_ms"]["p50"] >= summary["ttft_ms"]["p50"]
    assert summary["tokens_per_s"]["p50"] > 0 and report["run"]["tokens_per_s"] > 0


def test_probe_when_warmup_asked_then_warmup_streams_are_sent_but_not_counted(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/normal/v1"
    before = len(upstream.requests)
    code, report = _run(capsys, url, "--requests", "3", "--warmup", "2", "--concurrency", "1")
    assert code == 0
    assert len(upstream.requests) - before == 5
    assert report[url]["summary"]["requests"] == 3 and report["run"]["warmup"] == 2


def test_probe_when_engine_prefills_slowly_then_prefill_is_in_ttft_and_never_in_the_inter_token_gap(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    # The role-only chunk comes at once, the first token 0.5 s later, then one every 10 ms.
    url = upstream.url + "/normal/v1"
    code, report = _run(capsys, url, "--requests", "3", "--concurrency", "3", "--warmup", "0",
                        "--header", "x-fake-prefill-s: 0.5", "--header", "x-fake-delay-s: 0.01",
                        "--header", "x-fake-tokens: 10")
    summary = report[url]["summary"]
    assert code == 0
    assert summary["ttft_ms"]["p50"] >= 500
    assert summary["event_gap_ms"]["max"] >= 500, "all-event gaps include the wait after the role chunk"
    assert summary["itl_ms"]["max"] < 250, "inter-token gaps start at the first token"


def test_probe_when_api_is_completions_then_posts_prompt_to_completions_and_reads_text_chunks(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/normal/v1"
    before = len(upstream.requests)
    code, report = _run(capsys, url, "--api", "completions", "--requests", "2", "--warmup", "0")
    seen = upstream.requests[before:]
    assert code == 0
    assert [r.path for r in seen] == ["/normal/v1/completions"] * 2
    assert all("prompt" in json.loads(r.body) and "messages" not in json.loads(r.body) for r in seen)
    summary = report[url]["summary"]
    assert summary["ok"] == 2 and summary["content_events"] == 10 and summary["tokens"] == 10
    # No role chunk on this API: every data event but the finish and usage ones carries a token.
    assert all(s["events"] == 7 and s["ttft_s"] is not None for s in report[url]["streams"])


def test_probe_when_upstream_dies_mid_stream_then_reports_truncation_and_exits_one(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/die/v1"
    code, report = _run(capsys, url, "--requests", "2", "--concurrency", "2", "--warmup", "0")
    summary = report[url]["summary"]
    assert code == 1
    assert summary["ok"] == 0
    # A body that just stops is reported, never counted as a finished answer.
    assert summary["truncated"] + summary["errors"] == 2


def test_probe_when_target_is_unix_socket_then_streams_over_it(
        unix_upstream: tuple[FakeUpstream, str], capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = unix_upstream
    target = f"unix:{path}"
    code, report = _run(capsys, target, "--requests", "4", "--concurrency", "2", "--warmup", "1")
    assert code == 0
    assert report[target]["summary"]["ok"] == 4
    assert len(fake.requests) == 5 and {r.path for r in fake.requests} == {"/v1/chat/completions"}
    # Keep-alive: two workers, two connections, reused for every request.
    assert len(fake.connections) == 2


@pytest.mark.slow
def test_probe_compare_when_engine_socket_direct_and_through_sidecar_then_interleaved_pairs_after_warmup(
        unix_upstream: tuple[FakeUpstream, str], start_sidecar: Callable[..., Any]) -> None:
    """What ``tokenwire up`` allows: the engine's socket against the sidecar in front of it,
    with the ``tokenwire`` command as a user runs it."""
    fake, path = unix_upstream
    sidecar = start_sidecar(f"unix:{path}")
    direct = f"unix:{path}"
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire", "probe", direct, "--compare", sidecar.url, "--requests", "4",
         "--concurrency", "1", "--warmup", "1", "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # The sidecar adds its request id upstream; the direct requests carry none.
    order = "".join("S" if "x-request-id" in r.headers else "D" for r in fake.requests)
    assert order == "DS" + "DS" "SD" "DS" "SD", "one warm-up pair, then pairs alternating AB, BA"
    assert report[direct]["summary"]["ok"] == report[sidecar.url]["summary"]["ok"] == 4
    compared = report["compare"]
    assert (compared["first"], compared["second"]) == (direct, sidecar.url)
    for figure in ("ttft_ms", "itl_p50_ms", "duration_ms", "tokens_per_s"):
        diff = compared[figure]
        assert diff["pairs"] == 4
        assert diff["ci95"][0] <= diff["median"] <= diff["ci95"][1]
    assert isinstance(report["ttft_gap_p50_ms"], float)


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
def test_probe_compare_when_one_target_prefills_longer_then_the_interval_holds_the_difference(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = upstream.url + "/normal/v1", upstream.url + "/prefill/v1"  # /prefill: +0.5 s
    code, report = _run(capsys, fast, "--compare", slow, "--requests", "6", "--concurrency", "2",
                        "--warmup", "1")
    assert code == 0
    ttft = report["compare"]["ttft_ms"]
    assert ttft["pairs"] == 6
    assert 250 <= ttft["ci95"][0] <= ttft["median"] <= ttft["ci95"][1]
    assert report["ttft_gap_p50_ms"] >= 250


def test_probe_when_server_closes_its_kept_alive_connection_then_the_next_request_goes_on_a_new_one(
        recorder: ScriptedUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine closes an idle keep-alive connection (uvicorn after 5 s) with no
    ``Connection: close`` to say so: that is no failed stream."""
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        events = chunk(role="assistant") + chunk("hi") + chunk(finish="stop") + DONE
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(events), events))
        await writer.drain()
        writer.close()

    recorder.respond = answer_then_close
    code, report = _run(capsys, recorder.url, "--requests", "3", "--concurrency", "1", "--warmup", "0")
    assert code == 0, report[recorder.url]["summary"]["error_samples"]
    assert report[recorder.url]["summary"]["ok"] == 3 and recorder.connections == 3


def test_probe_when_target_is_https_then_verifies_it_with_the_given_ca(
        start_sidecar: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = tls_server_files(trustme.CA(), tmp_path)
    sidecar = start_sidecar(tls_cert=files["tls_cert"], tls_key=files["tls_key"])
    url = f"https://localhost:{sidecar.port}/normal/v1"
    code, report = _run(capsys, url, "--ca-file", files["ca"], "--requests", "2", "--warmup", "0")
    assert code == 0 and report[url]["summary"]["ok"] == 2
    # Without the CA the certificate is refused, and every stream says so.
    code, report = _run(capsys, url, "--requests", "1", "--warmup", "0")
    assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in report[url]["summary"]["error_samples"][0]


def test_probe_when_url_is_not_http_then_usage_error_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ftp://example", "--requests", "1"])
    assert exit_info.value.code == 2
    assert "ftp://example" in capsys.readouterr().err


def test_probe_when_text_report_then_names_each_figure(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/normal/v1"
    assert main([url, "--requests", "2", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    for figure in ("TTFT ms", "inter-token ms", "event gap ms", "whole answer ms", "tokens/s"):
        assert figure in out


def test_probe_compare_when_text_report_then_each_figure_has_its_difference_and_interval(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = upstream.url + "/normal/v1", upstream.url + "/prefill/v1"
    assert main([first, "--compare", second, "--requests", "3", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{second} minus {first}, pair by pair" in out
    for figure in ("ttft_ms", "itl_p50_ms", "duration_ms", "tokens_per_s"):
        line = next(line for line in out.splitlines() if line.strip().startswith(figure))
        assert "[" in line and "(3 pairs)" in line, line


def test_stats_paired_difference_is_the_median_of_pair_differences_with_an_interval_around_it() -> None:
    pairs = [(1.0, 1.5), (2.0, 2.4), (1.0, 1.6), (3.0, 3.5), (1.0, 1.45)]
    diff = paired_difference(pairs, scale=1000)
    assert diff["pairs"] == 5 and diff["median"] == 500.0
    assert 400.0 <= diff["ci95"][0] <= 500.0 <= diff["ci95"][1] <= 600.0
    assert paired_difference([])["median"] is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 99) is None


def test_read_chunk_text_reasoning_and_tool_calls_are_tokens_the_role_finish_and_usage_chunks_are_not() -> None:  # noqa: E501
    def chunk_with(delta: dict[str, Any], **extra: Any) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}], **extra})

    tokens = [chunk_with({"content": "hi"}), chunk_with({"reasoning_content": "hm"}),
              chunk_with({"reasoning": "hm"}), json.dumps({"choices": [{"index": 0, "text": "x"}]}),
              chunk_with({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})]
    not_tokens = [chunk_with({"role": "assistant", "content": ""}),
                  json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                  json.dumps({"choices": [], "usage": {"completion_tokens": 3}})]
    assert all(read_chunk(data).carries_token for data in tokens)
    assert not any(read_chunk(data).carries_token for data in not_tokens)
    assert read_chunk(not_tokens[2]).completion_tokens == 3
