"""``--workers N`` metrics: the supervisor's ``/metrics`` adds up its workers'
counters and never lets them go down (a dead worker's last totals are kept),
reports a pod's gauges once, and counts the streams lost with a worker.

The first tests merge expositions in-process; the last ones run the real
supervisor and its workers (real processes, real sockets) and SIGKILL a worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from clients import ResponseReader, chat_body, connect, read_response, request_bytes, wait_for
from conftest import make_config
from processes import SidecarProcess, spawn
from prometheus_client.parser import text_string_to_metric_families
from test_telemetry import promtool_check, sample
from tokenwire.sidecar.balance.load import LoadSample
from tokenwire.sidecar.balance.pods import PodState
from tokenwire.sidecar.process import metrics as sidecar_metrics
from tokenwire.sidecar.process.exposition import parse_exposition, sum_metrics
from tokenwire.sidecar.process.metrics import SidecarMetrics
from tokenwire.sidecar.process.workers import Supervisor, Worker
from tokenwire.sidecar.upstream import metrics as upstream_metrics
from tokenwire.sidecar.upstream.metrics import UpstreamCollector
from upstreams import FakeUpstream

from testbed.fake_pods import FakePod, spawn_pod  # testbed/fake_pods.py

_POD_A, _POD_B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def _worker_metrics(*, up_b: bool = True, waiting_a: float = 3.0, open_a: int = 0, queued: int = 0,
                    ended: int = 0, extra_status: str = "") -> SidecarMetrics:
    """One worker's registry, with the per-pod families over two pods (no sockets)."""
    metrics = SidecarMetrics()
    pods = [PodState(_POD_A, open_streams=open_a, requests=ended, load=LoadSample(waiting_a, 1.0, 0.5)),
            PodState(_POD_B, healthy=up_b)]
    balancer = SimpleNamespace(pods=pods, queue_depth=queued, queue_timeouts=0)
    metrics.registry.register(UpstreamCollector(SimpleNamespace(balancer=balancer,  # type: ignore[arg-type]
                                                                resent=lambda address: 0)))
    metrics.active_streams.set(open_a)
    for _ in range(ended):
        metrics.rejected_requests.labels("503").inc()
    if extra_status:
        metrics.rejected_requests.labels(extra_status).inc()
    return metrics


def test_sum_metrics_pod_gauges_once_process_gauges_and_counters_add() -> None:
    first = _worker_metrics(waiting_a=3, open_a=2, queued=1, ended=4)
    second = _worker_metrics(up_b=False, waiting_a=2, open_a=5, queued=2, ended=3, extra_status="413")
    summed = sum_metrics([first.render(), second.render()]).decode()
    # A pod's figures: once (the highest of the workers' readings).
    assert sample(summed, "tokenwire_upstream_up", upstream=_POD_A) == 1
    assert sample(summed, "tokenwire_upstream_up", upstream=_POD_B) == 1  # one worker may still send there
    assert sample(summed, "tokenwire_upstream_load_waiting", upstream=_POD_A) == 3
    assert sample(summed, "tokenwire_upstream_load_running", upstream=_POD_A) == 1
    assert sample(summed, "tokenwire_upstream_load_cache_use", upstream=_POD_A) == 0.5
    # A process's own figures and every counter: added up.
    assert sample(summed, "tokenwire_upstream_open_streams", upstream=_POD_A) == 7
    assert sample(summed, "tokenwire_active_streams") == 7
    assert sample(summed, "tokenwire_upstream_queue_depth") == 3
    assert sample(summed, "tokenwire_upstream_requests_total", upstream=_POD_A) == 7
    assert sample(summed, "tokenwire_rejected_requests_total", status="503") == 7
    # A label set only the second worker has stays within its family (promtool wants them together).
    assert sample(summed, "tokenwire_rejected_requests_total", status="413") == 1
    lines = [line for line in summed.splitlines() if line.startswith("tokenwire_rejected_requests_total")]
    first_at = summed.splitlines().index(lines[0])
    assert summed.splitlines()[first_at:first_at + len(lines)] == lines
    promtool_check(summed)


def test_sum_metrics_creation_times_are_the_earliest_not_a_sum_of_two_timestamps() -> None:
    def text(created: float) -> bytes:
        return (b"# HELP x_total X.\n# TYPE x_total counter\nx_total{a=\"1\"} 2.0\n"
                b"# HELP x_created X.\n# TYPE x_created gauge\nx_created{a=\"1\"} %r\n" % created)

    summed = sum_metrics([text(200.0), text(100.0)]).decode()
    assert sample(summed, "x_total", a="1") == 4
    assert sample(summed, "x_created", a="1") == 100.0


def test_every_gauge_a_worker_exports_has_a_merge_rule() -> None:
    """A new gauge must say how N workers report it: add up (a process's own
    figure) or once (a pod's), in PROCESS_GAUGES / POD_GAUGES / EARLIEST_GAUGES."""
    ruled = (sidecar_metrics.PROCESS_GAUGES | sidecar_metrics.EARLIEST_GAUGES
             | upstream_metrics.PROCESS_GAUGES | upstream_metrics.POD_GAUGES)
    gauges = [family.name.decode() for family in parse_exposition(_worker_metrics().render()).values()
              if family.kind == b"gauge"]
    assert "tokenwire_upstream_up" in gauges and "tokenwire_active_streams" in gauges
    unruled = [name for name in gauges if name not in ruled and not name.endswith(("_info", "_created"))]
    assert not unruled, f"say how --workers reports these gauges: {unruled}"
    summed = sidecar_metrics.PROCESS_GAUGES | upstream_metrics.PROCESS_GAUGES
    assert not upstream_metrics.POD_GAUGES & summed


def _fake_worker(index: int, metrics: SidecarMetrics, streams: int = 0) -> Worker:
    process: Any = SimpleNamespace(returncode=None, pid=1000 + index)
    worker = Worker(index, process, ("127.0.0.1", 0), 0.0,
                    streams=[{"request_id": f"w{index}-{i}", "upstream": _POD_A} for i in range(streams)])
    worker.metrics = parse_exposition(metrics.render())
    return worker


def test_supervisor_when_a_worker_dies_keeps_its_totals_and_counts_its_streams_lost(tmp_path: Any) -> None:
    supervisor = Supervisor(make_config(_POD_A, log_file=str(tmp_path / "streams.jsonl")), [])
    supervisor.workers = {0: _fake_worker(0, _worker_metrics(ended=5, open_a=3), streams=3),
                          1: _fake_worker(1, _worker_metrics(ended=2, open_a=1), streams=1)}
    before = supervisor.render_metrics().decode()
    assert sample(before, "tokenwire_rejected_requests_total", status="503") == 7
    assert sample(before, "tokenwire_active_streams") == 4
    assert sample(before, "tokenwire_streams_lost_total", reason="worker_lost") == 0
    dead = supervisor.workers[0]
    dead.process.returncode = -9
    # Dead but not yet seen dead: it counts with its last figures, as it did.
    dying = supervisor.render_metrics().decode()
    assert sample(dying, "tokenwire_rejected_requests_total", status="503") == 7
    supervisor._retire(dead)
    supervisor._record_lost(dead)
    gone = supervisor.render_metrics().decode()
    assert sample(gone, "tokenwire_rejected_requests_total", status="503") == 7  # kept
    assert sample(gone, "tokenwire_active_streams") == 1  # its open streams went with it
    assert sample(gone, "tokenwire_upstream_up", upstream=_POD_A) == 1
    assert sample(gone, "tokenwire_streams_lost_total", reason="worker_lost") == 3
    assert sample(gone, "tokenwire_worker_restarts_total") == 1
    # Its successor counts from zero: the sums go on from the kept totals.
    supervisor.workers[0] = _fake_worker(0, _worker_metrics(ended=1))
    after = supervisor.render_metrics().decode()
    assert sample(after, "tokenwire_rejected_requests_total", status="503") == 8
    assert sample(after, "tokenwire_upstream_requests_total", upstream=_POD_A) == 8
    promtool_check(after)
    records = [json.loads(line) for line in (tmp_path / "streams.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in records if r["end_reason"] == "worker_lost") == \
        ["w0-0", "w0-1", "w0-2"]


# ------------------------------------------------------------ real processes

_TOKEN = "metrics-admin-token"
_STREAMS = 20  # enough that the kernel puts some on each worker (see test_workers.py)


def _get(process: SidecarProcess, path: str, token: str = "") -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{process.admin_port}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return bytes(response.read())


def _scrape(process: SidecarProcess, token: str = "") -> str:
    return _get(process, "/metrics", token).decode()


def _total(text: str, name: str, **labels: str) -> float:
    return sum(found.value for family in text_string_to_metric_families(text) for found in family.samples
               if found.name == name and labels.items() <= found.labels.items())


def _complete_one(process: SidecarProcess) -> None:
    with connect(process.port) as sock:
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
        response = read_response(sock)
    assert response.datas()[-1:] == ["[DONE]"], (response.status, response.error, response.body[-300:])


def _pod_request(pod: FakePod) -> socket.socket:
    """A stream on ``pod`` itself, behind the sidecar's back (left open)."""
    sock = connect(pod.port)
    payload = {"model": "fake", "stream": True, "max_tokens": 10_000,
               "messages": [{"role": "user", "content": "hi"}]}
    sock.sendall(request_bytes("POST", "/v1/chat/completions", body=json.dumps(payload).encode()))
    return sock


@pytest.fixture
def two_pods() -> Iterator[tuple[FakePod, FakePod]]:
    started: list[FakePod] = []
    try:
        started.append(spawn_pod("busy", "--concurrency", "1", "--token-s", "0.5"))
        started.append(spawn_pod("idle"))
        yield started[0], started[1]
    finally:
        for pod in started:
            pod.stop()


@pytest.mark.slow
def test_two_workers_report_each_pod_once(two_pods: tuple[FakePod, FakePod]) -> None:
    """``--workers 2``: up is 1 per healthy pod (not 2), and an engine's queue
    is the engine's own (not twice it), while the workers' own figures add up."""
    busy, idle = two_pods
    process = spawn(["--upstream", busy.url, "--upstream", idle.url, "--workers", "2", "--drain-s", "0",
                     "--balance", "queue-aware", "--load-poll-s", "0.05"], timeout_s=60)
    backlog = [_pod_request(busy) for _ in range(6)]  # one runs (10 000 tokens, 0.5 s each), five wait
    try:
        wait_for(lambda: busy.stats()["waiting"] == 5, timeout_s=20)

        def both_workers_read_the_backlog() -> bool:
            views = json.loads(_get(process, "/upstreams"))["workers"]
            readings = [entry["load"] for view in views for entry in view["upstreams"]
                        if entry["address"] == busy.url]
            return len(readings) == 2 and all(r and r["waiting"] == 5 for r in readings)

        wait_for(both_workers_read_the_backlog, timeout_s=20)
        text = _scrape(process)
        assert sample(text, "tokenwire_upstream_up", upstream=busy.url) == 1
        assert sample(text, "tokenwire_upstream_up", upstream=idle.url) == 1
        assert sample(text, "tokenwire_upstream_load_waiting", upstream=busy.url) == 5
        assert sample(text, "tokenwire_upstream_load_running", upstream=busy.url) == 1
        assert sample(text, "tokenwire_build_info", program="sidecar") == 1
        promtool_check(text)
    finally:
        for sock in backlog:
            sock.close()
        assert process.stop() == 0


class _Scraper(threading.Thread):
    """Scrapes the supervisor's /metrics back to back; notes any counter
    sample that went down from one scrape to the next."""

    def __init__(self, process: SidecarProcess, token: str) -> None:
        super().__init__(daemon=True)
        self._process, self._token = process, token
        self._stop_event = threading.Event()
        self.scrapes = 0
        self.decreases: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        while not self._stop_event.is_set():
            try:
                text = _scrape(self._process, self._token)
            except (OSError, urllib.error.URLError) as error:
                self.errors.append(repr(error))
                continue
            self.scrapes += 1
            for family in text_string_to_metric_families(text):
                if family.type not in ("counter", "histogram"):
                    continue
                for found in family.samples:
                    if found.name.endswith("_created"):
                        continue
                    key = (found.name, tuple(sorted(found.labels.items())))
                    if found.value < last.get(key, 0.0):
                        self.decreases.append(f"{key}: {last[key]} -> {found.value}")
                    last[key] = found.value
            self._stop_event.wait(0.02)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


@pytest.mark.slow
def test_two_workers_when_one_is_killed_mid_stream_counters_never_go_down_and_its_streams_count_as_lost(
        upstream: FakeUpstream) -> None:
    # With an admin token: the supervisor's own reads of its workers carry it.
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--drain-s", "0",
                     "--admin-token", _TOKEN], timeout_s=60)
    scraper = _Scraper(process, _TOKEN)
    opened: list[socket.socket] = []
    try:
        for _ in range(6):
            _complete_one(process)
        for i in range(_STREAMS):
            sock = connect(process.port)
            opened.append(sock)
            sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                       headers={"x-fake-silence-s": "60", "X-Request-Id": f"held-{i}"}))
            assert ResponseReader(sock).read(head_only=True).status == 200

        def workers() -> list[dict[str, Any]]:
            return list(json.loads(_get(process, "/workers", _TOKEN)))

        # The supervisor knows each worker's open streams once it has polled them all.
        wait_for(lambda: sum(w["streams"] for w in workers()) == _STREAMS, timeout_s=20)
        scraper.start()
        text = _scrape(process, _TOKEN)
        assert _total(text, "tokenwire_streams_ended_total") == 6
        assert sample(text, "tokenwire_active_streams") == _STREAMS
        victim = workers()[0]
        assert victim["streams"] > 0  # 2 in a million that the kernel gave it none
        os.kill(victim["pid"], signal.SIGKILL)

        wait_for(lambda: sample(_scrape(process, _TOKEN), "tokenwire_streams_lost_total",
                                reason="worker_lost") == victim["streams"], timeout_s=20)
        wait_for(lambda: workers()[0]["alive"] and workers()[0]["restarts"] == 1, timeout_s=60)
        text = _scrape(process, _TOKEN)
        # The dead worker's completions are still counted; its open streams are not open any more.
        assert _total(text, "tokenwire_streams_ended_total") == 6
        assert sample(text, "tokenwire_active_streams") == _STREAMS - victim["streams"]
        assert sample(text, "tokenwire_worker_restarts_total") == 1
        for _ in range(8):
            _complete_one(process)
        wait_for(lambda: _total(_scrape(process, _TOKEN), "tokenwire_streams_ended_total") == 14,
                 timeout_s=10)
        wait_for(lambda: scraper.scrapes >= 10, timeout_s=30)
        scraper.stop()
        assert not scraper.decreases, scraper.decreases[:10]
        final = _scrape(process, _TOKEN)
        assert sample(final, "tokenwire_streams_lost_total", reason="worker_lost") == victim["streams"]
        promtool_check(final)
    finally:
        if scraper.is_alive():
            scraper.stop()
        for sock in opened:
            sock.close()
        assert process.stop() == 0
