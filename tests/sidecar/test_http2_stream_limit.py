"""The HTTP/2 concurrent-stream limit holds for a client that never opens its window.

A stream counts until its last frame has left, not until its exchange ended:
a short answer made upstream and held here for a window that never opens is
still an open stream. Without that, such a client had an answer generated
for every stream it opened (issue 36: 256 forwarded at a limit of 128).
"""

from __future__ import annotations

from collections.abc import Callable

import h2.errors
import h2.settings
from conftest import RunningSidecar
from h2client import H2Client, chat_headers
from upstreams import FakeUpstream

LIMIT = 8
OPENED = 3 * LIMIT


def test_zero_window_client_never_gets_more_than_the_limit_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(http2_max_concurrent_streams=LIMIT)
    initial_window = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
    with H2Client(sidecar.port, settings={initial_window: 0}) as client:
        client.credits = lambda stream_id: False  # and never a WINDOW_UPDATE
        assert client.read_until(lambda: client.conn.remote_settings.max_concurrent_streams == LIMIT)
        # The attacker's client ignores the limit it was told (h2 would refuse to open more).
        client.conn.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 10 * OPENED
        client.conn.remote_settings.acknowledge()
        streams = []
        for i in range(OPENED):
            streams.append(client.request("/normal/v1/chat/completions", method="POST", body=b"{}",
                                          headers=[*chat_headers(5), (b"x-request-id", f"zw-{i}".encode())]))
            # Each answer is made and held before the next stream opens: its
            # head comes (HEADERS need no window), or the stream is refused.
            state = client.streams[streams[-1]]
            assert client.read_until(lambda state=state: state.status is not None
                                     or state.reset_code is not None)
        refused = [s for s in streams if client.streams[s].reset_code == h2.errors.ErrorCodes.REFUSED_STREAM]
        forwarded = [r for r in upstream.requests
                     if r.headers.get("x-client-request-id", "").startswith("zw-")]
    assert len(forwarded) <= LIMIT, len(forwarded)
    assert len(refused) >= OPENED - LIMIT
