"""An HTTP/2 connection's socket pauses for what its streams together hold back,
not at one stream's high-water mark (which would pause all of them at once)."""

from __future__ import annotations

from collections.abc import Callable

from clients import chat_body, wait_for
from conftest import LoopThread, RunningSidecar
from h2client import H2Client
from tokenwire.sidecar.downstream.http2 import Http2Connection
from upstreams import FakeUpstream

SILENT_PATH = "/silent/v1/chat/completions"


def _connection(sidecar: RunningSidecar) -> Http2Connection:
    context = sidecar.sidecar.context
    assert context is not None
    found = [c for c in context.connections if isinstance(c, Http2Connection)]
    assert len(found) == 1
    return found[0]


def test_http2_write_high_water_grows_and_shrinks_with_the_open_streams(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream,
        loop_thread: LoopThread) -> None:
    sidecar = start_sidecar()
    per_stream = sidecar.sidecar.config.wire.write_high_water_bytes

    def high_water() -> int:
        connection = _connection(sidecar)
        transport = connection._transport  # what the socket pauses at
        assert transport is not None
        return int(loop_thread.call(lambda: transport.get_write_buffer_limits()[1]))

    with H2Client(sidecar.port) as client:
        streams = [client.request(SILENT_PATH, method="POST", body=chat_body(), flush=False,
                                  headers=[(b"content-type", b"application/json"),
                                           (b"x-fake-silence-s", b"60"),
                                           (b"x-request-id", f"hw-{i}".encode())])
                   for i in range(10)]
        client.flush()
        assert client.read_until(lambda: all(client.streams[s].status == 200 for s in streams))
        assert high_water() == 10 * per_stream
        for stream_id in streams[:6]:
            client.conn.reset_stream(stream_id, 8)
        client.flush()
        wait_for(lambda: len(_connection(sidecar).streams) == 4, timeout_s=10)
        assert high_water() == 4 * per_stream
        for stream_id in streams[6:]:
            assert not client.streams[stream_id].ended
