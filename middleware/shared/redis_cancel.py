"""Cancels across the processes sharing a Redis replay store.

Theory of operation
-------------------
Only the process writing a live stream can stop its upstream. A cancel that
reaches another replica, or another worker of ``--workers N``, is passed on
over Redis pub/sub: the process the cancel reached publishes the stream id on
:data:`CHANNEL`; every process that writes streams listens there and feeds
its writer of that id, if it has one, ``StopRequested(CANCELLED)`` (the same
``stop_writer`` a local cancel calls). The writer's core then ends the
stored stream with the in-band ``cancelled`` error, so the cancelling process
knows the cancel took effect when the stream's end appears in the store, and
answers then. Nobody listening, or no end within ``wait_s``, means nobody
could stop it: the caller gets ``stream_elsewhere`` as before (a writer that
died is issue-35 work: its lease, not this channel, says so).

The message carries only the stream id. The cancelling process checked the
caller's ownership against the store before publishing (``admit``); the
channel is as trusted as the store itself.

On a Redis Cluster, PUBLISH's reply counts only the subscribers of the node it
reached, so every process publishes and subscribes on one node, the primary of
the channel's slot (``redis_client.channel_node``), through a client of its own
to that node, asked again after a failure (a failover moves the slot). While a
cluster's processes disagree on that node (a failover, seconds), a cancel may be
told ``stream_elsewhere`` and the client asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..core.record import EndReason
from .redis_client import channel_node, node_client

logger = logging.getLogger("tokenwire.resume")

CHANNEL = "tw:cancel"
"""The pub/sub channel cancels are passed on over."""

_RETRY_S = 1.0


class RedisCancelRelay:
    """One process's side of :data:`CHANNEL`: it passes cancels on, and listens
    for those of the streams it writes (see the module docstring)."""

    def __init__(self, redis: Any, outages: tuple[type[BaseException], ...],
                 end_reason: Callable[[str], Awaitable[EndReason | None]], *,
                 wait_s: float = 2.0, poll_s: float = 0.02) -> None:
        """``redis``: the store's client; ``end_reason``: the store's own; ``wait_s``:
        how long a passed-on cancel waits for the stream's end to be stored."""
        self._redis = redis
        self._outages = outages
        self._end_reason = end_reason
        self._wait_s = wait_s
        self._poll_s = poll_s
        self._stop: Callable[[str], bool] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._node: tuple[tuple[str, int], Any] | None = None  # a cluster's: (its address, a client to it)
        self._refresh = False  # a cluster's slots to be read again (the channel's node failed)

    def serve(self, stop: Callable[[str], bool]) -> None:
        """Listen for cancels of this process's streams: ``stop(stream_id)`` stops
        its writer here, if any. Idempotent; call it from a running loop."""
        if self._stop is None:
            self._stop = stop
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def relay(self, stream_id: str) -> bool:
        """Pass a cancel of ``stream_id`` on; True once its end is stored (it was
        stopped), False if no process stopped it in ``wait_s``. Raises the
        store's outages."""
        channel = await self._channel()
        try:
            heard = await channel.publish(CHANNEL, stream_id)
        except self._outages:
            self._refresh = True
            raise
        if not heard:
            return False  # nobody listens: no process writes streams right now
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        while True:
            if await self._end_reason(stream_id) is not None:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self._poll_s)

    async def _listen(self) -> None:
        heard = True  # since the last failure: an outage is said once, not every retry
        while True:
            pubsub: Any = None
            try:
                pubsub = (await self._channel()).pubsub()
                await pubsub.subscribe(CHANNEL)
                heard = True
                async for message in pubsub.listen():
                    if message.get("type") == "message" and self._stop is not None:
                        data = message.get("data")
                        self._stop(bytes(data).decode("ascii", "replace") if data is not None else "")
            except self._outages as error:
                if heard:
                    logger.warning("resume store: cannot hear cancels from other processes: %s", error)
                heard = False
                self._refresh = True
            finally:
                if pubsub is not None:
                    with contextlib.suppress(*self._outages):
                        await pubsub.aclose()
            await asyncio.sleep(_RETRY_S)

    async def _channel(self) -> Any:
        """The client to publish and subscribe with: the store's own, or on a
        cluster a client to the channel's node (see the module docstring)."""
        refresh, self._refresh = self._refresh, False
        try:
            address = await channel_node(self._redis, CHANNEL, refresh=refresh)
        except self._outages:
            self._refresh = True
            raise
        if address is None:
            return self._redis
        held = self._node
        if held is not None and held[0] == address:
            return held[1]
        client = node_client(self._redis, *address)
        self._node = (address, client)
        if held is not None:  # the slot moved: the old node's client goes
            with contextlib.suppress(*self._outages):
                await held[1].aclose()
        return client

    async def aclose(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
        held, self._node = self._node, None
        if held is not None:
            with contextlib.suppress(*self._outages):
                await held[1].aclose()
