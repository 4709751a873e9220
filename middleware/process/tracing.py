"""OpenTelemetry traces: one span per stream, W3C ``traceparent`` in and out.

``opentelemetry-api`` is a base dependency (a few pure-Python modules); the SDK
and the OTLP exporter are the ``otel`` extra. Tracing is off unless the
standard variables ask for it (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_TRACES_EXPORTER=otlp``, and
not ``OTEL_SDK_DISABLED=true``): :func:`tracer_provider_from_env` then builds
an SDK provider that exports over OTLP/HTTP, which the programs pass in where
they need one (no global provider is set). Off, nothing is created per stream
and a client's ``traceparent`` is forwarded unchanged, so a traced engine
behind an untraced sidecar still joins the client's trace.

On, the sidecar's span is a child of the client's ``traceparent`` and the
upstream request carries the sidecar span's own, so the engine's spans (queue,
prefill, decode) hang under it. The propagator is W3C Trace Context itself,
not the API's global one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer, TracerProvider, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("tokenwire.tracing")

TRACE_HEADERS = (b"traceparent", b"tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


def tracing_requested(environ: Mapping[str, str]) -> bool:
    """Whether the standard ``OTEL_*`` variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter == "otlp" or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def tracer_provider_from_env(environ: Mapping[str, str], service_name: str) -> TracerProvider | None:
    """An SDK provider exporting over OTLP/HTTP if the variables ask for it, else None.

    ``OTEL_SERVICE_NAME`` overrides ``service_name``; the exporter reads its own
    ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, timeout).
    """
    if not tracing_requested(environ):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("OTEL_* asks for traces, but the SDK is not installed (the otel extra): "
                       "pip install '.[otel]' in tokenwire's clone (README: Install)")
        return None
    name = environ.get("OTEL_SERVICE_NAME") or service_name
    provider = SdkTracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def get_tracer(provider: TracerProvider | None) -> Tracer | None:
    """tokenwire's tracer from ``provider``; None (no tracing) without one."""
    return None if provider is None else provider.get_tracer("tokenwire")


def extract(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    """The trace context a request's ``traceparent``/``tracestate`` carry (empty if none)."""
    carrier: dict[str, str] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered in TRACE_HEADERS:
            carrier[lowered.decode("latin-1")] = value.decode("latin-1")
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def extract_text(headers: Mapping[str, str]) -> Context:
    """:func:`extract` for a string mapping (a Starlette request's headers)."""
    carrier = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def with_span_headers(headers: Iterable[tuple[bytes, bytes]], span: Span) -> list[tuple[bytes, bytes]]:
    """``headers`` with the client's trace headers replaced by ``span``'s own."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    kept = [(name, value) for name, value in headers if name.lower() not in TRACE_HEADERS]
    return kept + [(name.encode(), value.encode()) for name, value in carrier.items()]


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as Unix nanoseconds (what span times are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def loop_wall_ns(loop_time_s: float, loop_now_s: float) -> int:
    """An event-loop clock reading (the core's ``now``) as Unix nanoseconds."""
    return time.time_ns() - int((loop_now_s - loop_time_s) * 1e9)


def set_attributes(span: Span, attributes: Mapping[str, Any]) -> None:
    """Set the attributes whose value is not None."""
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


__all__ = ["extract", "extract_text", "get_tracer", "loop_wall_ns", "set_attributes",
           "tracer_provider_from_env", "wall_ns", "with_span_headers"]
