"""Server reflection (``grpc.reflection.v1`` and ``v1alpha``), for grpcurl-style tools.

Answers ``list_services``, ``file_containing_symbol`` and ``file_by_filename``
from the descriptors this process has loaded (the ``tokenwire.v1`` services,
health, reflection itself), each file with its dependencies. v1 and v1alpha
messages are the same on the wire, so one set of message classes serves both.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from tokenwire.middleware.core.errors import GrpcStatus

from tokenwire.v1 import streaming_pb2

from .framing import GrpcCallError
from .routing import SERVICE_NAMES

REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
LISTED_SERVICES = (*SERVICE_NAMES, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                   REFLECTION_SERVICE)
# Imported for their side effect too: their files are in the default pool.
_FILES = (streaming_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR, rpb.DESCRIPTOR)


def _with_dependencies(file: FileDescriptor) -> list[bytes]:
    seen: set[str] = set()
    out: list[bytes] = []

    def visit(f: FileDescriptor) -> None:
        if f.name in seen:
            return
        seen.add(f.name)
        out.append(f.serialized_pb)
        for dependency in f.dependencies:
            visit(dependency)

    visit(file)
    return out


def answer(request_bytes: bytes) -> bytes:
    """The serialized ``ServerReflectionResponse`` for one request message."""
    request = rpb.ServerReflectionRequest()
    try:
        request.ParseFromString(request_bytes)
    except Exception:  # protobuf's DecodeError
        raise GrpcCallError(GrpcStatus.INTERNAL, "malformed ServerReflectionRequest") from None
    response = rpb.ServerReflectionResponse(valid_host=request.host, original_request=request)
    pool = descriptor_pool.Default()
    kind = request.WhichOneof("message_request")
    try:
        if kind == "list_services":
            response.list_services_response.service.extend(
                rpb.ServiceResponse(name=name) for name in LISTED_SERVICES)
        elif kind == "file_containing_symbol":
            file = pool.FindFileContainingSymbol(request.file_containing_symbol)
            response.file_descriptor_response.file_descriptor_proto.extend(_with_dependencies(file))
        elif kind == "file_by_filename":
            file = pool.FindFileByName(request.file_by_filename)
            response.file_descriptor_response.file_descriptor_proto.extend(_with_dependencies(file))
        else:
            response.error_response.error_code = GrpcStatus.UNIMPLEMENTED
            response.error_response.error_message = f"{kind} is not supported"
    except KeyError:
        response.error_response.error_code = GrpcStatus.NOT_FOUND
        response.error_response.error_message = "not found"
    data: bytes = response.SerializeToString()
    return data
