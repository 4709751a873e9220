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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..core.events import EndReason

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
        if not await self._redis.publish(CHANNEL, stream_id):
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
            pubsub = self._redis.pubsub()
            try:
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
            finally:
                with contextlib.suppress(*self._outages):
                    await pubsub.aclose()
            await asyncio.sleep(_RETRY_S)

    async def aclose(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
