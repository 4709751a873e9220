"""An answer's DATA frames, written beside h2 where h2 would take them as they are.

Theory of operation
-------------------
h2 stays the protocol's authority: every frame it is asked for goes through
its state machines, and so does every DATA frame that is not plain. But an
answer's events are plain DATA frames on an open stream, one per event, and
h2's ``send_data`` spends ~10 us of interpreted Python on each (the
connection's and the stream's state machines, a hyperframe object and its
serialisation, debug-log calls) for what is a 9-byte header and the payload:
most of what HTTP/2 cost per event beyond HTTP/1.1 (bench/h2_bench.py,
docs/perf/http2-grpc.md).

:meth:`DataWriter.send` writes such a frame itself exactly when h2's own
``send_data(stream_id, data)`` would succeed and change nothing but its send
windows and its output:

* the connection is open (``SERVER_OPEN``: h2's ``SEND_DATA`` input leaves it so);
* the stream is ``OPEN`` or ``HALF_CLOSED_REMOTE`` (the two states whose
  ``SEND_DATA`` transition has no side effect and keeps the state);
* the payload fits the connection's and the stream's send windows and the
  peer's maximum frame size;
* no END_STREAM, no padding (those always go through h2).

It then takes the bytes off both of h2's send windows, as h2 would, so h2's
flow control (WINDOW_UPDATE, a SETTINGS change of the initial window, its
``local_flow_control_window``) stays exact. Anything else is h2's own
``send_data``, which raises what it raises.

The frames keep their order with h2's: before a frame is written here, what h2
holds to send is moved into the same buffer, and :meth:`take` returns the
buffer followed by what h2 produced since. tests/sidecar/test_http2_data.py
holds the bytes and h2's state to h2's own for any sequence of sends, window
updates, settings and resets. :func:`supported` checks at start-up that h2 has
the state this relies on (h2 4.x); where it does not, every frame goes
through h2.
"""

from __future__ import annotations

import struct

import h2.connection
import h2.stream

_HEADER = struct.Struct(">HBBBL")  # 24-bit length (as 16 + 8), type, flags, stream id
_DATA = 0x0
_SENDABLE = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE})
_OPEN = h2.connection.ConnectionState.SERVER_OPEN


def supported(conn: h2.connection.H2Connection) -> bool:
    """Whether this h2 keeps the state :class:`DataWriter` reads and writes."""
    return (isinstance(getattr(conn, "outbound_flow_control_window", None), int)
            and isinstance(getattr(conn, "streams", None), dict)
            and getattr(getattr(conn, "state_machine", None), "state", None) is not None
            and hasattr(h2.stream.H2Stream, "send_data"))


class DataWriter:
    """A connection's outbound bytes: h2's, and the DATA frames written here."""

    __slots__ = ("_conn", "_fast", "_out")

    def __init__(self, conn: h2.connection.H2Connection) -> None:
        self._conn = conn
        self._out = bytearray()
        self._fast = supported(conn)

    def window(self, stream_id: int) -> int:
        """How many bytes ``stream_id`` may send now (h2's ``local_flow_control_window``, same errors)."""
        conn = self._conn
        stream = conn.streams.get(stream_id) if self._fast else None
        if stream is None:
            return conn.local_flow_control_window(stream_id)
        return min(conn.outbound_flow_control_window, stream.outbound_flow_control_window)

    def send(self, stream_id: int, data: bytes) -> None:
        """Send ``data`` on ``stream_id`` as one DATA frame (h2's ``send_data``, same errors)."""
        conn = self._conn
        size = len(data)
        if self._fast and conn.state_machine.state is _OPEN:
            stream = conn.streams.get(stream_id)
            if (stream is not None and stream.state_machine.state in _SENDABLE
                    and size <= conn.outbound_flow_control_window
                    and size <= stream.outbound_flow_control_window
                    and size <= conn.max_outbound_frame_size):
                out = self._out
                out += conn.data_to_send()
                out += _HEADER.pack(size >> 8, size & 0xFF, _DATA, 0, stream_id)
                out += data
                conn.outbound_flow_control_window -= size
                stream.outbound_flow_control_window -= size
                return
        conn.send_data(stream_id, data)

    def take(self) -> bytes:
        """Everything to write, in order; the buffer is emptied."""
        out = self._out
        if not out:
            return self._conn.data_to_send()
        out += self._conn.data_to_send()
        data = bytes(out)
        out.clear()
        return data
