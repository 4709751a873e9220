"""``tokenwire.v1``: the gRPC API (``streaming.proto``) and its generated code.

``streaming_pb2`` holds the messages, ``streaming_pb2_grpc`` the client stubs
(it needs ``grpcio``). Both are generated from ``streaming.proto`` by
``grpcio-tools`` and committed; ``tests/sidecar/test_grpc_codegen.py`` checks
that they match it. To regenerate, from the repository root::

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \\
        tokenwire/v1/streaming.proto
"""
