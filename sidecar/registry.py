"""The open streams of one sidecar, for the admin API (list, cancel) and shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tokenwire.middleware import EndReason, HandOff, StopRequested, StreamRecord

if TYPE_CHECKING:
    from .exchange.loop import Exchange


class StreamRegistry:
    """Exchanges that have a wire stream and have not finished yet."""

    def __init__(self) -> None:
        self._open: dict[int, Exchange] = {}

    def add(self, exchange: Exchange) -> None:
        self._open[id(exchange)] = exchange

    def remove(self, exchange: Exchange) -> None:
        self._open.pop(id(exchange), None)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Exchange]:
        return iter(list(self._open.values()))

    def describe(self, now: float) -> list[dict[str, Any]]:
        """One JSON-ready dict per open stream (``GET /streams``)."""
        return [exchange.describe(now) for exchange in self]

    def live_records(self) -> list[tuple[StreamRecord, str]]:
        """Each open stream's record as of now, with its client's HTTP version (live metrics)."""
        return [exchange.live_record() for exchange in self._open.values()]

    def stop(self, request_id: str, reason: EndReason) -> int:
        """Feed ``StopRequested(reason)`` to every open stream with ``request_id``
        (the client's id, or the upstream's, which is unique); how many."""
        matched = [e for e in self if request_id in (e.request_id, e.upstream_request_id)]
        for exchange in matched:
            exchange.feed(StopRequested(reason))
        return len(matched)

    def stop_writer(self, stream_id: str, reason: EndReason) -> bool:
        """Feed ``StopRequested(reason)`` to the exchange that writes resume stream
        ``stream_id`` (not its readers: they end with what it stores); whether
        this process has one."""
        writer = next((e for e in self if e.stream_id == stream_id and not e.replaying and not e.over), None)
        if writer is None:
            return False
        writer.feed(StopRequested(reason))
        return True

    def hand_off(self, until: float) -> int:
        """Feed ``HandOff(until)`` to every open stream whose client reconnects by
        itself (a drain, with a store other replicas share); how many. The core
        decides which it can hand off (resumable, its client holding an id) and
        when; the rest are ended by the drain's ``stop_all`` as before."""
        exchanges = [e for e in self if e.hands_off and not e.over]
        for exchange in exchanges:
            exchange.feed(HandOff(until))
        return len(exchanges)

    def stop_all(self, reason: EndReason) -> int:
        exchanges = list(self)
        for exchange in exchanges:
            exchange.feed(StopRequested(reason))
        return len(exchanges)
