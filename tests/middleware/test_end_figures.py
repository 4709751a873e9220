"""The end's figures folded as plain numbers (``figures.EndFigures``, the sidecar's)
export exactly what ``prometheus_client`` metrics updated once a stream (``EndMetrics``,
the middleware's) export for the same records: names, help, types, labels,
buckets, sums and counts; only the ``_created`` samples are not there."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from tokenwire.middleware import EndReason, ErrorCode, StreamRecord
from tokenwire.middleware.process.figures import EndFigures
from tokenwire.middleware.process.prometheus import REQUESTS, EndMetrics, end_families

BASE = StreamRecord(
    request_id="r", upstream="http://pod-a", status=200, end_reason=EndReason.COMPLETE, error_code=None,
    started_at=0.0, duration_s=1.0, ttfb_s=0.1, max_event_gap_s=0.0, event_gap_buckets=(),
    events_in=1, events_out=1, bytes_out=10, heartbeats=0, coalesced_events=0, dropped_events=0,
    retries=0, refused_retries=0, pending_high_water_bytes=0)

_RECORDS = st.builds(
    lambda upstream, status, reason, error, duration, usage, counted: dataclasses.replace(
        BASE, upstream=upstream, status=status, end_reason=reason, error_code=error, duration_s=duration,
        usage=None if usage is None else {"completion_tokens": usage}, tokens_counted=counted),
    st.sampled_from(["http://pod-a", "http://pod-b", "replay"]),
    st.sampled_from([0, 200, 429, 502]),
    st.sampled_from(list(EndReason)),
    st.none() | st.sampled_from(list(ErrorCode)),
    st.floats(min_value=0.0, max_value=4000.0, allow_nan=False) | st.sampled_from([0.1, 2.5, 1800.0]),
    st.none() | st.integers(min_value=0, max_value=5000),
    st.integers(min_value=0, max_value=50),
)


def _folded(records: list[StreamRecord], versions: list[str], protocols: list[str]) -> str:
    ends = EndFigures()
    for record, version in zip(records, versions, strict=True):
        ends.fold(record, version)
    for protocol in protocols:
        ends.count_request(protocol)

    class Ends(Collector):
        def collect(self) -> list[Metric]:
            return list(end_families(ends))

    registry = CollectorRegistry()
    registry.register(Ends())
    return generate_latest(registry).decode()


def _updated(records: list[StreamRecord], versions: list[str], protocols: list[str]) -> str:
    """The middleware's per-stream updates (the sidecar's before the fold)."""
    registry = CollectorRegistry()
    metrics = EndMetrics.on(registry)
    requests = Counter(*REQUESTS, registry=registry)
    for record, version in zip(records, versions, strict=True):
        metrics.count(record, version)
    for protocol in protocols:
        requests.labels(protocol).inc()
    return generate_latest(registry).decode()


def _lines(exposition: str) -> list[str]:
    """The exposition's lines but ``_created``'s, in order within each family's
    header and as a set among its samples (the fold lists them sorted)."""
    return sorted(line for line in exposition.splitlines() if "_created" not in line)


@settings(max_examples=150, deadline=None)
@given(st.lists(_RECORDS, max_size=12), st.data())
def test_the_folded_end_figures_export_what_the_per_stream_metrics_did(
        records: list[StreamRecord], data: st.DataObject) -> None:
    count = len(records)
    versions = data.draw(st.lists(st.sampled_from(["1.1", "2"]), min_size=count, max_size=count))
    protocols = data.draw(st.lists(st.sampled_from(["http/1.1", "h2"]), max_size=5))
    assert _lines(_folded(records, versions, protocols)) == _lines(_updated(records, versions, protocols))


def test_a_negative_usage_count_never_takes_the_tokens_counter_down() -> None:
    ends = EndFigures()
    ends.fold(dataclasses.replace(BASE, usage={"completion_tokens": 5}), "1.1")
    ends.fold(dataclasses.replace(BASE, usage={"completion_tokens": -3}), "1.1")
    assert ends.tokens == {("http://pod-a", "usage"): 5}
