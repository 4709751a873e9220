"""Received HTTP/2 bytes cut at frame boundaries, each frame counted before h2 parses it.

Theory of operation
-------------------
h2's ``receive_data`` parses all it is given and returns every event at once.
One 64 KiB read holds some 2,000 HEADERS+RST_STREAM pairs or 5,000 SETTINGS
frames, so a flood limit checked on the events trips only after h2 has parsed,
decoded and answered the whole read: 10,000 SETTINGS frames drew 2,200 ACKs
against a limit of 500 a second, and a rapid-reset flood had 9,700 streams
opened before its GOAWAY, stalling every other connection of the loop meanwhile.

:class:`FrameGate` stands between the socket and h2. It reads only the 9-byte
frame headers (RFC 9113 section 4.1: a 24-bit payload length, the type, the
flags, the stream id) and steps over the payloads, and so:

* It counts each frame in the connection's
  :class:`~tokenwire.sidecar.downstream.http2_guard.FloodGuard` by its header,
  before h2 has seen it: RST_STREAM as ``RESET``; SETTINGS, PING and PRIORITY
  as ``CONTROL``; WINDOW_UPDATE as ``WINDOW``; DATA with no payload and no
  END_STREAM as ``EMPTY``. The frame that crosses a limit is never handed to
  h2, nor anything after it (nor the rest of its piece: the connection is
  over): h2 parses (and answers) at most the limit's worth of each kind, per
  frame and not per read.
* It cuts the bytes into pieces of at most ``frames_per_piece`` frames, which
  the driver hands to ``receive_data`` one at a time, handling each piece's
  events before the next: whatever ends the connection on an event (an h2
  error, the keepalive policy, a padded empty DATA frame past its limit) stops
  the parsing within a piece, not at the end of the read.

The bytes pass through unchanged and in order, as slices of the read (no copy):
a frame split across reads reaches h2 in parts, which h2 reassembles as it
always did; only a header split across reads is kept here (at most 8 bytes)
until it can be read whole. The 24-byte connection preface before the first
frame passes uncounted (h2 checks it). h2 stays the protocol's authority: it
validates every frame (sizes, stream ids, states), decodes HPACK and keeps
flow control. The gate only counts and cuts; bytes it misreads as headers (a
wrong preface, garbage) h2 refuses with a GOAWAY of its own.

A DATA frame whose padding is all it holds cannot be told from its header (its
pad length is in the payload); the driver counts it as ``EMPTY`` when h2
yields it with no data.
"""

from __future__ import annotations

import struct

from .http2_guard import Flood, FloodGuard

PREFACE_BYTES = 24
"""The client's connection preface, ``PRI * HTTP/2.0...`` (RFC 9113 section 3.4)."""
FRAMES_PER_PIECE = 16
"""Frames handed to h2 at a time: a read of big DATA frames (4 of 16 KiB in
64 KiB) stays one piece; a read of small frames costs one more
``receive_data`` call per 16 frames, a few percent of what h2 spends on them."""

_HEADER_BYTES = 9
# The first 4 bytes read as one word hold the length (high 24 bits) and the type.
_HEAD = struct.Struct(">IB")
_DATA = 0x0
_END_STREAM = 0x1
# Frame types counted by their type alone (RFC 9113 section 6).
_COUNTED = {0x2: Flood.CONTROL, 0x3: Flood.RESET, 0x4: Flood.CONTROL, 0x6: Flood.CONTROL,
            0x8: Flood.WINDOW}


class FrameGate:
    """Where to cut one connection's received bytes for h2, each frame counted on
    the way. See the module docstring."""

    __slots__ = ("_guard", "_header", "_payload_left", "_per_piece", "_preface_left")

    def __init__(self, guard: FloodGuard, *, preface_bytes: int = PREFACE_BYTES,
                 frames_per_piece: int = FRAMES_PER_PIECE) -> None:
        self._guard = guard
        self._per_piece = frames_per_piece
        self._preface_left = preface_bytes
        self._payload_left = 0
        """Payload bytes of the current frame that have not arrived yet."""
        self._header = b""
        """The first bytes of a frame header the last read ended in."""

    def cut(self, data: memoryview, start: int, now: float) -> int:
        """The end of the next piece of ``data`` from ``start``: it holds the
        starts of at most ``frames_per_piece`` frames, each counted at ``now``.
        A frame that crosses a limit ends the piece before it, and the guard's
        ``tripped`` says so: the connection is then over, and the driver hands
        h2 neither that piece nor anything after it."""
        end = len(data)
        pos = start
        if self._preface_left:
            step = min(self._preface_left, end - pos)
            self._preface_left -= step
            pos += step
        # Locals, not attributes, in the loop: it runs once per frame of every read.
        left = self._payload_left
        frames_left = self._per_piece
        count = self._guard.count
        while True:
            if left:
                if left >= end - pos:
                    self._payload_left = left - (end - pos)
                    return end
                pos += left
                left = 0
            if pos == end or not frames_left:
                break
            frames_left -= 1
            if self._header or end - pos < _HEADER_BYTES:
                # A header split across reads: kept until it is whole (its bytes
                # go on to h2 all the same, which holds them as a partial frame).
                taken = data[pos:pos + _HEADER_BYTES - len(self._header)]
                header = self._header + bytes(taken)
                if len(header) < _HEADER_BYTES:
                    self._header = header
                    self._payload_left = 0
                    return end
                self._header = b""
                if self._enter(header, 0, now):
                    return pos
                pos += len(taken)
                left = self._payload_left
                continue
            word, flags = _HEAD.unpack_from(data, pos)
            left = word >> 8
            kind = _COUNTED.get(word & 0xFF)
            if kind is None:
                if word & 0xFF != _DATA or left or flags & _END_STREAM:
                    pos += _HEADER_BYTES
                    continue
                kind = Flood.EMPTY
            if count(kind, now):
                return pos
            pos += _HEADER_BYTES
        self._payload_left = left
        return pos

    def _enter(self, buffer: bytes, offset: int, now: float) -> bool:
        """Read a header split across reads (``cut`` reads a whole one itself)
        and count its frame; True once a limit is crossed."""
        word, flags = _HEAD.unpack_from(buffer, offset)
        length = word >> 8
        self._payload_left = length
        kind = _COUNTED.get(word & 0xFF)
        if kind is None:
            if word & 0xFF != _DATA or length or flags & _END_STREAM:
                return False
            kind = Flood.EMPTY
        return self._guard.count(kind, now)
