"""Bursts of departing clients: each stream is still recorded and counted
exactly once, with its pod, although its record is now built after its
upstream was closed (``Finished`` builds it when the bookkeeping reads it)."""

from __future__ import annotations

import time
from collections.abc import Callable

from clients import open_silent_streams, reset, wait_for
from conftest import RunningSidecar
from prometheus_client.parser import text_string_to_metric_families
from upstreams import FakeUpstream

BURST = 30


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and labels.items() <= found.labels.items():
                return float(found.value)
    return 0.0


def _settled(sidecar: RunningSidecar) -> bool:
    context = sidecar.sidecar.context
    assert context is not None
    return len(context.registry) == 0 and len(context.departures) == 0


def _burst(sidecar: RunningSidecar, upstream: FakeUpstream, prefix: str) -> tuple[list[str], float]:
    """BURST clients open a silent stream each, then all reset back to back:
    their ids and when the first was sent."""
    ids = [f"{prefix}-{i}" for i in range(BURST)]
    started = time.monotonic()
    socks = open_silent_streams(sidecar.port, ids)
    wait_for(lambda: all(upstream.requests_with(request_id) for request_id in ids))
    for sock in socks:
        reset(sock)
    return ids, started


def test_reset_bursts_record_and_count_each_stream_once_with_its_pod(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    context = sidecar.sidecar.context
    assert context is not None
    for round_index in (1, 2):  # the second burst counts on the label sets the first made
        ids, started = _burst(sidecar, upstream, f"rec{round_index}")
        wait_for(lambda: _settled(sidecar), timeout_s=10)
        ended = time.monotonic()
        records = list(sidecar.log.records)
        for request_id in ids:
            mine = [record for record in records if record.request_id == request_id]
            assert len(mine) == 1, f"{request_id}: {len(mine)} records"
            record = mine[0]
            assert record.end_reason.value == "client_gone"
            assert record.upstream == upstream.url
            assert record.status == 200
            # As of the departure: never longer than the test, never negative.
            assert 0 < record.duration_s <= ended - started
            extra = sidecar.log.extras[request_id]
            assert extra["http_version"] == "1.1"
            assert extra["upstream_request_id"] != request_id  # the client's id stays the client's
            assert "started_at" in extra
        text = context.metrics.render().decode()
        labels = {"upstream": upstream.url, "status_class": "2xx", "http_version": "1.1"}
        assert _sample(text, "tokenwire_streams_ended_total", reason="client_gone",
                       **labels) == BURST * round_index
        assert _sample(text, "tokenwire_stream_duration_seconds_count", reason="client_gone",
                       **labels) == BURST * round_index
        assert _sample(text, "tokenwire_client_requests_total", protocol="http/1.1") == BURST * round_index
