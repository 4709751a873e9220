"""The sidecar's telemetry over real sockets: TTFT from the first token, live
metrics while a stream runs, and /metrics clean under ``promtool check metrics``."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
from clients import ResponseReader, chat_body, connect, exchange, request_bytes, wait_for
from prometheus_client.parser import text_string_to_metric_families
from upstreams import FakeUpstream


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and labels.items() <= found.labels.items():
                return float(found.value)
    return None


def promtool_check(text: str) -> None:
    """``promtool check metrics`` finds nothing to say: no error, no lint warning.
    promtool ships in Debian's prometheus package (scripts/system-deps.sh prometheus)."""
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool missing: run scripts/system-deps.sh prometheus"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def test_ttft_when_role_chunk_comes_first_then_timed_at_the_first_token(start_sidecar) -> None:
    """The fake engine sends its role chunk at once and each token 0.5 s later:
    the first byte is the role chunk, the first token comes at least 0.5 s in."""
    sidecar = start_sidecar()
    exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
             headers={"x-fake-tokens": "2", "x-fake-delay-s": "0.5", "X-Request-Id": "ttft-1"})
    record = sidecar.record("ttft-1")
    assert record.ttft_s is not None and record.ttfb_s is not None
    # (0.499: the loop's clock counts whole milliseconds.)
    assert record.ttft_s >= 0.499 and record.ttfb_s < record.ttft_s - 0.4
    # One gap between the two tokens (>= 0.5 s), then the finish, usage and [DONE] chunks.
    assert record.event_gap_sum_s >= 0.499 and sum(record.event_gap_buckets) == 4
    assert record.tokens_out == (2, "usage")


def test_metrics_while_a_stream_runs_then_its_first_token_and_bytes_are_counted_live(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    labels = {"upstream": upstream.url, "status_class": "2xx", "http_version": "1.1"}

    def scrape() -> str:
        return httpx.get(sidecar.admin_url + "/metrics").text

    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": "30", "X-Request-Id": "live-m"}))
        reader = ResponseReader(sock)
        assert reader.read(head_only=True).status == 200
        # The role chunk and token 0 came; the stream is silent for 30 s and has not ended.
        wait_for(lambda: sample(scrape(), "tokenwire_time_to_first_token_seconds_count", **labels) == 1)
        text = scrape()
        assert (sample(text, "tokenwire_bytes_out_total", **labels) or 0) > 0
        assert sample(text, "tokenwire_content_events_total", **labels) == 1
        assert sample(text, "tokenwire_active_streams") == 1
        assert sample(text, "tokenwire_streams_ended_total", **labels) is None
        assert httpx.delete(sidecar.admin_url + "/streams/live-m").status_code == 200
        reader.read()
    sidecar.record("live-m")
    text = scrape()
    # Its end replaced its live figures: nothing counted twice, nothing went down.
    assert sample(text, "tokenwire_time_to_first_token_seconds_count", **labels) == 1
    assert sample(text, "tokenwire_content_events_total", **labels) == 1
    assert sample(text, "tokenwire_streams_ended_total", reason="cancelled", **labels) == 1
    assert sample(text, "tokenwire_stream_errors_total", number="E7301", code="cancelled") == 1
    assert sample(text, "tokenwire_active_streams") == 0


@pytest.mark.slow
def test_metrics_pass_promtool_check(start_sidecar) -> None:
    sidecar = start_sidecar()
    exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
             headers={"X-Request-Id": "p-1"})
    exchange(sidecar.port, "POST", "/die/v1/chat/completions", body=chat_body(),
             headers={"X-Request-Id": "p-2"})
    sidecar.record("p-1")
    sidecar.record("p-2")
    text = httpx.get(sidecar.admin_url + "/metrics").text
    assert sample(text, "tokenwire_stream_errors_total", number="E7307", code="upstream_failed") == 1
    promtool_check(text)


@pytest.mark.slow
@pytest.mark.parametrize("rules", ["tokenwire-alerts.yml"])
def test_alert_rules_pass_promtool_check_rules(rules: str) -> None:
    from pathlib import Path

    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool missing: run scripts/system-deps.sh prometheus"
    path = Path(__file__).resolve().parents[2] / "conf" / "examples" / rules
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_sum_metrics_when_workers_add_then_info_and_start_times_are_not_summed() -> None:
    """The --workers admin port sums its workers' /metrics: counters and
    histograms add up, but a build-info sample stays 1 and a start time is the
    earliest, and the sum still passes promtool."""
    from tokenwire.sidecar.process.exposition import sum_metrics
    from tokenwire.sidecar.process.metrics import SidecarMetrics

    texts = []
    for started_at in (200.0, 100.0):
        metrics = SidecarMetrics()
        metrics.start_time.set(started_at)
        metrics.rejected_requests.labels("503").inc()
        texts.append(metrics.render())
    summed = sum_metrics(texts).decode()
    assert sample(summed, "tokenwire_build_info", program="sidecar") == 1
    assert sample(summed, "tokenwire_start_time_seconds") == 100.0
    assert sample(summed, "tokenwire_rejected_requests_total", status="503") == 2
    promtool_check(summed)


def test_metrics_when_http2_client_then_its_streams_have_their_own_label(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    with httpx.Client(http1=False, http2=True, base_url=sidecar.url) as client:
        response = client.post("/normal/v1/chat/completions", content=chat_body(),
                               headers={"content-type": "application/json", "x-request-id": "h2-m"})
    assert response.http_version == "HTTP/2" and response.status_code == 200
    sidecar.record("h2-m")
    text = httpx.get(sidecar.admin_url + "/metrics").text
    labels = {"upstream": upstream.url, "status_class": "2xx"}
    assert sample(text, "tokenwire_time_to_first_token_seconds_count", http_version="2", **labels) == 1
    assert sample(text, "tokenwire_streams_ended_total", http_version="2", reason="complete", **labels) == 1
    assert sample(text, "tokenwire_time_to_first_token_seconds_count", http_version="1.1", **labels) is None


def test_logs_at_debug_hold_no_authorization_cookie_prompt_or_completion(
        loop_thread, upstream: FakeUpstream) -> None:
    """Every line the sidecar logs for a stream (its lifecycle at debug, its end
    line), as JSON: none holds the credential, the cookie, the prompt or the answer."""
    import io
    import json as jsonlib
    import logging

    from conftest import make_config
    from tokenwire.middleware.process.logs import JsonFormatter
    from tokenwire.sidecar import Sidecar, StreamLog
    from upstreams import expected_text

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tokenwire")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    sidecar = Sidecar(make_config(upstream.url), log=StreamLog(logging.getLogger("tokenwire.streams")))
    try:
        loop_thread.run(sidecar.start())
        host, port = sidecar.address
        secrets = ("Bearer sk-SECRET-1f2e", "sid=COOKIE-SECRET-77", "PROMPT-SECRET-3d")
        body = jsonlib.dumps({"stream": True, "messages": [{"role": "user", "content": secrets[2]}]})
        response = httpx.post(f"http://{host}:{port}/normal/v1/chat/completions?key=QUERY-SECRET",
                              content=body, headers={"Authorization": secrets[0], "Cookie": secrets[1],
                                                     "x-fake-tokens": "12", "x-request-id": "quiet-1"})
        assert response.status_code == 200 and expected_text(12) in "".join(
            jsonlib.loads(line[6:])["choices"][0]["delta"].get("content", "")
            for line in response.text.splitlines() if line.startswith("data: {"))
        wait_for(lambda: '"stream ended"' in out.getvalue())
    finally:
        loop_thread.run(sidecar.shutdown())
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    logged = out.getvalue()
    lines = [jsonlib.loads(line) for line in logged.splitlines()]
    assert {"accepted", "committed", "first token", "ended", "stream ended"} <= {e["msg"] for e in lines}
    assert all(e.get("request_id") == "quiet-1" for e in lines if e["logger"] != "tokenwire.sidecar")
    for secret in (*secrets, "sk-SECRET", "COOKIE-SECRET", "QUERY-SECRET", expected_text(12)):
        assert secret not in logged
