"""The load an engine reports: its Prometheus ``/metrics``, read for three figures.

``queue-aware`` balancing picks by *waiting* requests (queued for admission),
then *running* ones (admitted: prefilling or decoding), then *KV-cache use*
(0..1). Every engine names them differently; a preset holds each one's names,
and a figure may list several names, the first present wins (vLLM renamed its
cache gauge). ``load_metric_waiting`` / ``_running`` / ``_cache`` override a
preset's names.

A metric with labels (``model_name=...``, one series per model or rank) is
summed over its series. Only the plain exposition format is read: a sample
line is ``name[{labels}] value [timestamp]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class LoadMetricNames:
    """Which metric names carry each figure (first present wins)."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    cache: tuple[str, ...] = ()


PRESETS: Final[dict[str, LoadMetricNames]] = {
    "tokenwire": LoadMetricNames(("tokenwire_engine_waiting",), ("tokenwire_engine_running",)),
    "vllm": LoadMetricNames(("vllm:num_requests_waiting",), ("vllm:num_requests_running",),
                            ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": LoadMetricNames(("sglang:num_queue_reqs",), ("sglang:num_running_reqs",),
                              ("sglang:token_usage",)),
    "tgi": LoadMetricNames(("tgi_queue_size",), ("tgi_batch_current_size",)),
}
"""The ``load_metrics`` presets."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One reading of an engine's load."""

    waiting: float
    running: float
    cache_use: float | None = None
    """KV-cache use 0..1, where the engine reports it."""


def metric_names(preset: str, waiting: str = "", running: str = "", cache: str = "") -> LoadMetricNames:
    """The preset's names with any given override (a comma list) in place."""
    base = PRESETS[preset]

    def pick(override: str, default: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(part.strip() for part in override.split(",") if part.strip())
        return names or default

    return LoadMetricNames(pick(waiting, base.waiting), pick(running, base.running), pick(cache, base.cache))


def parse_load(text: str, names: LoadMetricNames) -> LoadSample | None:
    """The load in a ``/metrics`` body; None when the waiting or running figure is missing."""
    wanted = set(names.waiting) | set(names.running) | set(names.cache)
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            close = line.rfind("}")
            if close < 0:
                continue
            rest = line[close + 1:].split()
        else:
            name = line[:space]
            rest = line[space + 1:].split()
        if name not in wanted or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value

    def first(candidates: tuple[str, ...]) -> float | None:
        for name in candidates:
            if name in sums:
                return sums[name]
        return None

    waiting, running = first(names.waiting), first(names.running)
    if waiting is None or running is None:
        return None
    return LoadSample(waiting, running, first(names.cache))
