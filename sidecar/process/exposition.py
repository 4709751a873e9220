"""Several processes' Prometheus expositions as one: the ``--workers`` supervisor's ``/metrics``.

Each worker's ``/metrics`` counts only its own streams. The supervisor reads
every worker's at each scrape of its own (and every ``_METRICS_POLL_S`` in workers.py
between scrapes) and keeps the last answer of each; a worker that does not
answer in time counts with its last one. Its ``/metrics`` is then, family by
family (the ``# TYPE`` lines say which):

* counters and histograms: the sum of the workers' samples, plus the last
  totals of every worker that died (kept by the supervisor when it sees the
  death), so a sum never goes down when a worker is killed and its restarted
  successor counts from zero. What a dead worker counted after the
  supervisor's last read of it (``_METRICS_POLL_S`` at most) is lost, never
  counted twice. ``*_created`` samples are the earliest.
* gauges: a process's own figures add up (open streams, connections, memory:
  ``PROCESS_GAUGES`` in process/metrics.py and upstream/metrics.py); a pod's figures,
  which every worker reads of the same pod (``tokenwire_upstream_up``, the
  load readings: ``POD_GAUGES``), are reported once, the highest; start times
  and limits are the earliest and the lowest, ``*_info`` stays 1. A dead
  worker's gauges go with it.
* the supervisor's own: ``tokenwire_streams_lost_total{reason="worker_lost"}``,
  ``tokenwire_worker_restarts_total``.

Why not prometheus-client's multiprocess mode (one mmap file per process,
read by the supervisor): the stream figures are computed at scrape time from
the open streams' records (metrics.py), which a collector cannot write to a
file, and the per-pod figures are read from each worker's balancer the same
way; the supervisor keeping each dead worker's last totals gives the same
never-decreasing sums without a per-event write.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..upstream import metrics as upstream_metrics
from . import metrics as sidecar_metrics


@dataclass
class Family:
    """One metric family of a Prometheus text exposition."""

    name: bytes
    kind: bytes = b"untyped"
    comments: list[bytes] = field(default_factory=list)
    """Its ``# HELP`` and ``# TYPE`` lines."""
    samples: dict[bytes, float] = field(default_factory=dict)
    """``name{labels}`` -> value, in the order they came."""


Exposition = dict[bytes, Family]
"""A text exposition's families by name, in the order they came."""

_SAMPLE_SUFFIXES = (b"_total", b"_bucket", b"_count", b"_sum", b"_created", b"_gcount", b"_gsum")
_TOTAL_KINDS = frozenset({b"counter", b"histogram", b"gaugehistogram", b"summary", b"untyped"})
_HIGHEST_GAUGES = frozenset(name.encode() for name in upstream_metrics.POD_GAUGES)
_LOWEST_GAUGES = frozenset(name.encode() for name in sidecar_metrics.EARLIEST_GAUGES)


def parse_exposition(text: bytes) -> Exposition:
    """The families of a Prometheus text exposition (format 0.0.4, as
    prometheus-client writes it: a family's samples follow its TYPE line)."""
    families: Exposition = {}
    current: Family | None = None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith(b"#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in (b"HELP", b"TYPE"):
                current = families.get(parts[2])
                if current is None:
                    current = families[parts[2]] = Family(parts[2])
                if parts[1] == b"TYPE" and len(parts) == 4:
                    current.kind = parts[3].strip()
                if line not in current.comments:
                    current.comments.append(line)
            continue
        key, _, value = line.rpartition(b" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name = key.partition(b"{")[0]
        if current is None or (name != current.name and not any(
                name == current.name + suffix for suffix in _SAMPLE_SUFFIXES)):
            current = families.get(name)
            if current is None:
                current = families[name] = Family(name)
        current.samples[key] = number
    return families


def _is_total(family: Family) -> bool:
    """Counts that only grow while a process lives (kept across a worker's death)."""
    return family.kind in _TOTAL_KINDS or family.name.endswith(b"_created")


def _combine(family: Family) -> Callable[[float, float], float]:
    """How the workers' samples of ``family`` make one (see the module docstring):
    the gauges named in neither set add up, like ``PROCESS_GAUGES``."""
    name = family.name
    if family.kind == b"gauge":
        if name.endswith(b"_created") or name in _LOWEST_GAUGES:
            return min
        if name.endswith(b"_info") or name in _HIGHEST_GAUGES:
            return max
    return operator.add


def merge_expositions(expositions: Sequence[Exposition]) -> Exposition:
    """Several processes' families as one (see the module docstring)."""
    merged: Exposition = {}
    for exposition in expositions:
        for name, family in exposition.items():
            into = merged.get(name)
            if into is None:
                merged[name] = Family(name, family.kind, list(family.comments), dict(family.samples))
                continue
            combine = _combine(into)
            for key, value in family.samples.items():
                old = into.samples.get(key)
                into.samples[key] = value if old is None else combine(old, value)
    return merged


def _number(value: float) -> bytes:
    if math.isnan(value):
        return b"NaN"
    if math.isinf(value):
        return b"+Inf" if value > 0 else b"-Inf"
    return repr(value).encode()


def render_exposition(families: Exposition) -> bytes:
    out: list[bytes] = []
    for family in families.values():
        out += family.comments
        out += [key + b" " + _number(value) for key, value in family.samples.items()]
    return b"\n".join(out) + b"\n"


def totals_of(exposition: Exposition) -> Exposition:
    """The families of ``exposition`` that only grow (counters, histograms, their ``_created``)."""
    return {name: family for name, family in exposition.items() if _is_total(family)}


def sum_metrics(texts: Sequence[bytes]) -> bytes:
    """Several processes' ``/metrics`` as one: counters and histograms add up,
    a process's own gauges add up, a pod's are the highest, ``*_info`` stays
    1, start times and limits are the earliest and lowest."""
    return render_exposition(merge_expositions([parse_exposition(text) for text in texts]))
