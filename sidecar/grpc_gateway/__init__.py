"""gRPC server streaming in front of an OpenAI-compatible engine.

The sidecar's HTTP/2 listener hands each request with ``content-type:
application/grpc`` on a gRPC path to this package. A call to one of the
``tokenwire.v1`` services (``tokenwire/v1/streaming.proto``) is transcoded to
the engine's OpenAI request and proxied through the same
:class:`~tokenwire.sidecar.exchange.loop.Exchange` and wire core as an SSE request,
so every wire rule holds per gRPC call; the transcoder only turns the core's
SSE events into protobuf messages and its endings into gRPC statuses.
``tokenwire.v1.Streams/CancelStream`` is the HTTP cancel by id
(``DELETE /v1/streams/{id}``) as a unary call, made as that very request.
``grpc.health.v1.Health`` and server reflection are answered here.

Modules, one idea each; all but ``driver`` and ``replies`` are sans-IO:

- ``framing``: length-prefixed messages, ``grpc-timeout``, content types;
- ``metadata``: statuses and trailers (the mapping lives in ``middleware/core/errors.py``);
- ``transcode``: protobuf request → OpenAI request; SSE events → messages;
- ``call``: one call's response side: what to send for each core output;
- ``health``: the health service's state and its watchers;
- ``reflection``: server reflection answers;
- ``routing``: which path is which method;
- ``cancel``: the unary cancel by id: its request as the HTTP cancel's, its answer as a reply;
- ``replies``: what every handler does with its HTTP/2 stream (read messages, end the call);
- ``driver``: the glue to an HTTP/2 stream and to the exchange.

Requires the ``grpc`` extra (``protobuf``, ``grpcio-health-checking``,
``grpcio-reflection`` for their message types).
"""
