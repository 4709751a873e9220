"""``grpc.health.v1.Health``: the sidecar's readiness as gRPC health.

The server (service ``""``) and each ``tokenwire.v1`` service are ``SERVING``
while ``/readyz`` answers 200 and ``NOT_SERVING`` while it answers 503 (no
upstream can take a stream, the resume store is unreachable, the sidecar
drains: ``sidecar/process/readiness.py``); Kubernetes' gRPC probes and
``grpc_health_probe`` read it. A ``Watch`` is sent the status at its start and
when the sidecar drains. ``Check`` of an unknown service is ``NOT_FOUND``; ``Watch`` of one
answers ``SERVICE_UNKNOWN`` and stays open, as the protocol says.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from tokenwire.middleware.core.errors import GrpcStatus

from .framing import GrpcCallError
from .routing import SERVICE_NAMES

# HealthCheckResponse.ServingStatus values.
SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

_KNOWN = frozenset({"", *SERVICE_NAMES})


def serving_status(service: str, *, serving: bool) -> int:
    """The status ``Watch`` reports for ``service`` (a ``ServingStatus`` value)."""
    if service not in _KNOWN:
        return SERVICE_UNKNOWN
    return SERVING if serving else NOT_SERVING


def check(request: bytes, *, serving: bool) -> bytes:
    """``Check``: the serialized response, or ``GrpcCallError`` (NOT_FOUND) for an unknown service."""
    service = parse_request(request)
    status = serving_status(service, serving=serving)
    if status == SERVICE_UNKNOWN:
        raise GrpcCallError(GrpcStatus.NOT_FOUND, f"unknown service {service[:100]!r}")
    return response(status)


def parse_request(request: bytes) -> str:
    message = health_pb2.HealthCheckRequest()
    try:
        message.ParseFromString(request)
    except Exception:  # protobuf's DecodeError; any failure is a malformed message
        raise GrpcCallError(GrpcStatus.INTERNAL, "malformed HealthCheckRequest") from None
    return str(message.service)


def response(status: int) -> bytes:
    data: bytes = health_pb2.HealthCheckResponse(status=status).SerializeToString()
    return data


class Watcher:
    """One ``Watch`` call: sends its service's status at first and on every change."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._sent: int | None = None

    def update(self, *, serving: bool) -> bytes | None:
        """The response to send now, or None when the status is unchanged."""
        status = serving_status(self.service, serving=serving)
        if status == self._sent:
            return None
        self._sent = status
        return response(status)
