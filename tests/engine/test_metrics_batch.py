"""``observe_many``: the step's gaps in one update, the same histogram as one ``observe`` each."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from tokenwire.engine.metrics import observe_many
from tokenwire.middleware.core.meter import GAP_BUCKETS_S


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gaps_seconds", "gaps", buckets=GAP_BUCKETS_S, registry=registry)


def _exposition(registry: CollectorRegistry) -> list[str]:
    # Everything but the creation time, which differs between the two histograms.
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_observe_many_matches_one_observe_per_amount() -> None:
    bounds = list(GAP_BUCKETS_S)
    # On every bound (le is inclusive), just above each, below the first, past the last.
    amounts = [*bounds, *(bound * 1.0001 for bound in bounds), 0.0, -0.5, bounds[-1] * 10, 0.0123] * 3
    one_by_one, histogram = _histogram()
    for amount in amounts:
        histogram.observe(amount)
    batched, batched_histogram = _histogram()
    observe_many(batched_histogram, amounts[:7])
    observe_many(batched_histogram, [])
    observe_many(batched_histogram, amounts[7:])
    assert _exposition(batched) == _exposition(one_by_one)
    assert any(line.startswith("gaps_seconds_count ") and not line.endswith(" 0.0")
               for line in _exposition(batched))
