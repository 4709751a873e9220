"""Flood limits of one HTTP/2 connection, sans-IO: frames counted per second.

HTTP/2 lets a client make the server work without asking for anything: cancel
streams as fast as it opens them (rapid reset, CVE-2023-44487), make it answer
SETTINGS and PING frames (CVE-2019-9512, -9515), reorder the priority tree
(CVE-2019-9513, -9516), send DATA frames with nothing in them (CVE-2019-9518),
or WINDOW_UPDATE frames, each of which has the server look at every stream its
window holds back. Each costs the client a few bytes and the server a parse, an
event and maybe a reply. :class:`FloodGuard` counts each kind in fixed
one-second windows; past a kind's limit the connection is over (the driver
sends GOAWAY ENHANCE_YOUR_CALM and closes). The frames are counted one by one
as their headers arrive, before h2 parses them (http2_frames.py). The clock is
passed in, so it is tested without sleeping.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Flood(enum.Enum):
    """The frame kinds counted against a limit."""

    RESET = "reset"
    """RST_STREAM from the client."""
    CONTROL = "control"
    """SETTINGS, PING and PRIORITY frames."""
    EMPTY = "empty"
    """DATA frames that carry no payload and do not end the stream."""
    WINDOW = "window_update"
    """WINDOW_UPDATE frames, the connection's and the streams'."""


class FloodGuard:
    """Counts frames by kind; :meth:`count` says when a kind went past its limit."""

    __slots__ = ("_counts", "_limits", "_window_s", "_window_start", "tripped")

    def __init__(self, limits_per_s: Mapping[Flood, int], *, now: float, window_s: float = 1.0) -> None:
        self._limits = dict(limits_per_s)
        self._window_s = window_s
        self._window_start = now
        self._counts = dict.fromkeys(Flood, 0)
        self.tripped: Flood | None = None
        """The first kind that went past its limit (then the connection is over)."""

    def count(self, kind: Flood, now: float, frames: int = 1) -> bool:
        """Count ``frames`` of ``kind`` at ``now``; True once its limit for the
        current window is passed."""
        if now - self._window_start >= self._window_s:
            self._window_start = now
            self._counts = dict.fromkeys(Flood, 0)
        self._counts[kind] += frames
        if self._counts[kind] > self._limits[kind]:
            self.tripped = self.tripped or kind
            return True
        return False

    def counted(self, kind: Flood) -> int:
        """Frames of ``kind`` counted in the current window."""
        return self._counts[kind]
