"""What counts against a pod: the rule by which an attempt's outcome reaches its health.

Passive health (outlier ejection, :class:`~tokenwire.sidecar.balance.pods.PodState`)
counts an attempt's outcome before its first byte, once. An answer's head is
the pod's success unless its status is a 5xx: a 4xx is the request's fault,
not the pod's, and ejecting a pod for a client's bad request would let one
client empty the set. A connection or read failure, and the wire core's
retry, are the pod's failure. When the core aborts an attempt, only the
reasons that are the pod's doing count (it timed out or broke its stream); a
client that left, a stop or a slow reader say nothing about the pod.
"""

from __future__ import annotations

from typing import Final

from tokenwire.middleware import EndReason

_POD_FAILURE_ENDS: Final = frozenset({EndReason.UPSTREAM_TIMEOUT, EndReason.UPSTREAM_ERROR})


def head_is_pod_success(status: int) -> bool:
    """Whether an answer's head with ``status`` counts as the pod's success."""
    return status < 500


def abort_is_pod_failure(reason: EndReason) -> bool:
    """Whether the core's abort of an attempt for ``reason`` counts as the pod's failure."""
    return reason in _POD_FAILURE_ENDS
