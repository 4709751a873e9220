"""The sidecar's resume glue: a replay store read as if it were an upstream.

Policy (ids, what is recorded, grace, 204 after the end) is the wire core's;
this module only turns a store read into the inputs an upstream attempt would
feed (``UpstreamHeaders``, ``UpstreamData``, ``UpstreamEnded``, or
``Rejected`` for an unknown or incomplete stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenwire.middleware import Input, Rejected, UpstreamData, UpstreamEnded, UpstreamHeaders
from tokenwire.middleware.headers import SSE_HEADERS
from tokenwire.middleware.replay_store import ReplayStore, ReplayUnavailable, StreamNotFound
from tokenwire.middleware.resume import replay_unavailable, stream_not_found

_FRAMES_PER_FEED = 64


async def run_replay(store: ReplayStore, stream_id: str, after_seq: int, *,
                     readable: asyncio.Event, feed: Callable[[Input], None]) -> None:
    """Feed stream ``stream_id`` after ``after_seq`` to the core, live tail included."""
    feed(UpstreamHeaders(200, SSE_HEADERS))
    try:
        async for frames in store.read(stream_id, after_seq):
            # A long backlog goes in slices, so the core can pause us (it
            # reads a replay under the block policy) before its cap is near.
            for start in range(0, len(frames), _FRAMES_PER_FEED):
                if not readable.is_set():
                    await readable.wait()
                feed(UpstreamData(b"".join(frames[start:start + _FRAMES_PER_FEED])))
    except StreamNotFound:
        feed(Rejected(stream_not_found(stream_id)))
        return
    except ReplayUnavailable:
        feed(Rejected(replay_unavailable(stream_id)))
        return
    feed(UpstreamEnded())
