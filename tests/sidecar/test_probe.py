"""``tokenwire probe``: client-side figures, truncation and errors, over real sockets."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from tokenwire.sidecar.tools.probe import main
from upstreams import FakeUpstream


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_probe_whenStreamsComplete_thenCountsThemAndExitsZero(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/normal/v1"
    code, report = _run(capsys, url, "--requests", "6", "--concurrency", "3")
    summary = report[url]["summary"]
    assert code == 0
    assert (summary["requests"], summary["ok"], summary["truncated"], summary["errors"]) == (6, 6, 0, 0)
    assert summary["ttft_ms"]["p50"] is not None and summary["events"] > 0
    assert all(s["saw_done"] and s["finish_reason"] for s in report[url]["streams"])


def test_probe_whenUpstreamDiesMidStream_thenReportsTruncationAndExitsOne(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    url = upstream.url + "/die/v1"
    code, report = _run(capsys, url, "--requests", "2", "--concurrency", "2")
    summary = report[url]["summary"]
    assert code == 1
    assert summary["ok"] == 0
    # A body that just stops is reported, never counted as a finished answer.
    assert summary["truncated"] + summary["errors"] == 2


def test_probe_compare_whenSameLoadDirectAndThroughSidecar_thenGapReported(
        upstream: FakeUpstream, start_sidecar: Callable[..., Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    sidecar = start_sidecar()
    direct, proxied = upstream.url + "/normal/v1", sidecar.url + "/normal/v1"
    code, report = _run(capsys, direct, "--compare", proxied, "--requests", "4")
    assert code == 0
    assert report[direct]["summary"]["ok"] == report[proxied]["summary"]["ok"] == 4
    assert isinstance(report["ttft_gap_p50_ms"], float)


def test_probe_whenUrlIsNotHttp_thenUsageErrorNamesIt(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ftp://example", "--requests", "1"])
    assert exit_info.value.code == 2
    assert "ftp://example" in capsys.readouterr().err
