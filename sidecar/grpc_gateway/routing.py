"""Which gRPC path is which method, and which paths are gRPC's at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from tokenwire.v1 import streaming_pb2 as pb

from .transcode import (
    Chunk,
    TextCarry,
    chat_chunk,
    chat_request_body,
    completion_chunk,
    completion_request_body,
)

CANCEL_STREAM = b"/tokenwire.v1.Streams/CancelStream"
"""The unary cancel by id: ``DELETE /v1/streams/{id}`` made over gRPC (``cancel.py``)."""
HEALTH_CHECK = b"/grpc.health.v1.Health/Check"
HEALTH_WATCH = b"/grpc.health.v1.Health/Watch"
REFLECTION_PATHS = frozenset({
    b"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    b"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
})
# Requests on these paths are gRPC's whatever their content type: one that is
# not application/grpc is refused here (415), never forwarded to the engine.
_GRPC_PREFIXES = (b"/tokenwire.v1.", b"/grpc.health.v1.", b"/grpc.reflection.")


@dataclass(frozen=True, slots=True)
class StreamMethod:
    """A server-streaming method transcoded to an OpenAI endpoint."""

    path: bytes
    request_type: type[Message]
    upstream_target: bytes
    to_body: Callable[[Any], dict[str, Any]]
    to_message: Callable[[str, str | None, TextCarry | None], Chunk]
    """(SSE data, event id, the call's text carry) → the response message."""


STREAM_METHODS: dict[bytes, StreamMethod] = {
    method.path: method for method in (
        StreamMethod(b"/tokenwire.v1.ChatCompletions/Create", pb.ChatCompletionRequest,
                     b"/v1/chat/completions", chat_request_body, chat_chunk),
        StreamMethod(b"/tokenwire.v1.Completions/Create", pb.CompletionRequest,
                     b"/v1/completions", completion_request_body, completion_chunk),
    )
}

SERVICE_NAMES = ("tokenwire.v1.ChatCompletions", "tokenwire.v1.Completions", "tokenwire.v1.Streams")


def is_grpc_path(path: bytes) -> bool:
    """True for a path of a service this sidecar serves over gRPC (or of its namespaces)."""
    return path.startswith(_GRPC_PREFIXES)
