"""Small statistics for the tools' reports: percentiles and a paired difference with its interval.

Percentiles are nearest-rank (a value that was actually observed, never an
interpolation between two). The difference of two targets is taken pair by
pair (the same request, sent to each target back to back), so a machine that
gets busier halfway through shifts both sides of a pair alike and cancels out;
its 95 % interval is a percentile bootstrap of the median (no normality
assumed: latency differences are skewed), with a fixed seed so one run's
report is reproducible from its samples.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

_BOOTSTRAP_RESAMPLES = 2000
_BOOTSTRAP_SEED = 20_240_601


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile of ``values`` (None if empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(value: float | None) -> float | None:
    """Seconds as milliseconds, rounded to 10 µs (None stays None)."""
    return None if value is None else round(value * 1000, 2)


def percentiles_ms(values: Sequence[float],
                   quantiles: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of ``values`` (seconds) in ms."""
    return {f"p{q:g}": ms(percentile(values, q)) for q in quantiles}


def paired_difference(pairs: Sequence[tuple[float, float]], *, scale: float = 1.0) -> dict[str, Any]:
    """How much larger the second of each pair is than the first: the median
    and mean of ``b - a`` and a 95 % bootstrap interval of the median, times
    ``scale`` (1000 for seconds shown as ms)."""
    diffs = [b - a for a, b in pairs]
    if not diffs:
        return {"pairs": 0, "median": None, "mean": None, "ci95": None}
    rng = random.Random(_BOOTSTRAP_SEED)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs)))
                     for _ in range(_BOOTSTRAP_RESAMPLES))
    low = medians[int(0.025 * _BOOTSTRAP_RESAMPLES)]
    high = medians[int(0.975 * _BOOTSTRAP_RESAMPLES) - 1]
    return {"pairs": len(diffs), "median": round(statistics.median(diffs) * scale, 2),
            "mean": round(statistics.fmean(diffs) * scale, 2),
            "ci95": [round(low * scale, 2), round(high * scale, 2)]}
