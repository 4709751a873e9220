"""Load-aware balancing over a set of engine pods, sans-IO.

``balancer`` (the set, the queue, the answers), ``policies`` (who gets the
next stream), ``pods`` (one pod's health rules), ``load`` (reading an
engine's ``/metrics``), ``prefix`` (a request's affinity key), ``members``
(the ``upstream`` entries). The driver is ``tokenwire.sidecar.upstream.pools``.
"""

from .balancer import QUEUED, Balancer, BalanceSettings, Pick, Refusal, RefusalReason
from .load import PRESETS, LoadMetricNames, LoadSample, metric_names, parse_load
from .members import SourceKind, UpstreamSpec, parse_address_file, parse_spec
from .pods import HealthSettings, PodState
from .policies import POLICIES
from .prefix import BYTES_PER_TOKEN, prefix_key

__all__ = [
    "BYTES_PER_TOKEN",
    "POLICIES",
    "PRESETS",
    "QUEUED",
    "BalanceSettings",
    "Balancer",
    "HealthSettings",
    "LoadMetricNames",
    "LoadSample",
    "Pick",
    "PodState",
    "Refusal",
    "RefusalReason",
    "SourceKind",
    "UpstreamSpec",
    "metric_names",
    "parse_address_file",
    "parse_load",
    "parse_spec",
    "prefix_key",
]
