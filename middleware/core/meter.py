"""Time to first token and the gaps between tokens, as the client's socket sees them.

Theory of operation
-------------------
An engine's answer usually opens with a chunk that carries no token: OpenAI's
``{"delta": {"role": "assistant", "content": ""}}``, sent the moment the
request is accepted, long before prefill ends. Timing the first *byte* times
that chunk (0.1 s where the engine's own time to first token was 0.8 s), and
every gap after it then includes the prefill wait. So the core keeps two
clocks: ``ttfb_s`` (the first event of any kind, as before) and, here, the
first event that carries a token, by which every gap is measured from then on.

A token event is one whose data is not a JSON object (a plain SSE stream has no
role chunk: its first event is its content), or a JSON chunk with a non-empty
text (``content``, ``reasoning_content``, ``reasoning``, a completion's
``text``) or a tool call (``chunks.carries_token``: the chunk format is known
there); in another dialect, its own deltas (``Dialect.carries_token``). The
role-only chunk, a finish reason alone, a usage chunk, an error and the
terminal marker are not. The test is one regex search
of the queued bytes, made only until the first token is queued: after that the
meter costs a subtraction and a few comparisons per write.

A write is the unit of timing, as the client sees it: merged events (a slow
reader's coalesced text) are one arrival. ``content_events`` counts the events
written from the first token on (the terminal marker and in-band errors
excluded by the caller):
one per token for engines that send one chunk per token, the fallback count of
tokens when the upstream reports no ``usage``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

LATENCY_BUCKETS_S: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))
"""Time to first token/byte buckets of the sidecar's and the engine's histograms (the same,
so the two can be compared)."""
GAP_BUCKETS_S: Final[tuple[float, ...]] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                           float("inf"))
"""Upper bounds of the inter-token gap histogram carried in each record
(:func:`gap_bucket` has them written out: change both)."""


def gap_bucket(gap_s: float) -> int:
    """The index of the first ``GAP_BUCKETS_S`` bound >= ``gap_s`` (what
    ``bisect_left`` answers; the last bound is inf, so there always is one).

    The bounds written out, not a scan of the tuple or ``bisect_left``:
    compiled, each test is one comparison of C doubles, where a scan unboxed a
    Python float per bound and the call to ``bisect`` boxed the gap and
    compared Python floats (docs/perf/compiled-core.md).
    ``test_gapBucket_isBisectLeft_forEveryGap`` holds them to ``GAP_BUCKETS_S``,
    NaN (index 0, as ``bisect_left`` puts it) included."""
    if not gap_s > 0.005:
        return 0
    if not gap_s > 0.01:
        return 1
    if not gap_s > 0.025:
        return 2
    if not gap_s > 0.05:
        return 3
    if not gap_s > 0.1:
        return 4
    if not gap_s > 0.25:
        return 5
    if not gap_s > 0.5:
        return 6
    if not gap_s > 1.0:
        return 7
    if not gap_s > 2.5:
        return 8
    if not gap_s > 5.0:
        return 9
    if not gap_s > 10.0:
        return 10
    return 11


class TokenMeter:
    """Per-stream token timing; the core calls ``queued`` and ``wrote``."""

    __slots__ = ("_carries_token", "content_events", "first_token_at", "gap_buckets", "gap_count",
                 "gap_sum_s", "last_write_at", "max_gap_s", "started_at", "token_queued")

    def __init__(self, started_at: float, carries_token: Callable[[bytes], bool]) -> None:
        """``carries_token``: whether an event's data holds a token (the dialect's rule)."""
        self.started_at = started_at
        self._carries_token = carries_token
        self.token_queued = False
        """A token event is queued (or being written) and not yet counted as written."""
        self.first_token_at: float | None = None
        self.gap_buckets = [0] * len(GAP_BUCKETS_S)
        self.gap_sum_s = 0.0
        self.gap_count = 0
        self.max_gap_s = 0.0
        self.content_events = 0
        self.last_write_at = 0.0
        """When the last write from the first token on left (0 before)."""

    @property
    def awaiting_token(self) -> bool:
        """True until a token event has been queued: only then is ``queued`` needed."""
        return not self.token_queued

    @property
    def ttft_s(self) -> float | None:
        """Start to the write that carried the first token."""
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    def queued(self, data: bytes | str) -> None:
        """Events about to go to the client (data of one event, or whole frames)."""
        if not self.token_queued and self._carries_token(data.encode() if isinstance(data, str) else data):
            self.token_queued = True

    def terminal_queued(self) -> None:
        """The terminal marker (``[DONE]``) or an in-band error event is queued:
        no token, so it is taken off the count its write will add (when that
        write counts)."""
        if self.token_queued:
            self.content_events -= 1

    def wrote(self, events: int, now: float) -> None:
        """A write of ``events`` events left for the socket at ``now``."""
        if self.first_token_at is None:
            if not self.token_queued:
                return
            self.first_token_at = now
        else:
            gap_s = now - self.last_write_at
            self.gap_sum_s += gap_s
            self.gap_count += 1
            if gap_s > self.max_gap_s:
                self.max_gap_s = gap_s
            buckets = self.gap_buckets
            index = gap_bucket(gap_s)
            buckets[index] = buckets[index] + 1  # not +=: compiled, that adds Python objects
        self.content_events += events
        self.last_write_at = now
