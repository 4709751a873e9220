"""FrameGate, sans-IO: received bytes cut at frame boundaries for h2, every frame
counted before h2 parses it, a flood stopped at the frame past its limit. The
clock is passed in (no sleeping); h2 is a real server-side H2Connection fed the
pieces, as the driver feeds it."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
from h2client import PREFACE, STATIC_GET_BLOCK, frame
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.downstream.http2_frames import FRAMES_PER_PIECE, FrameGate
from tokenwire.sidecar.downstream.http2_guard import Flood, FloodGuard

BIG = {kind: 1_000_000 for kind in Flood}
CANCEL = b"\x00\x00\x00\x08"


def _server() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    conn.data_to_send()
    return conn


def _pieces(gate: FrameGate, guard: FloodGuard, reads: list[bytes], now: float = 0.0) -> list[bytes]:
    """What the driver hands h2: each read cut by the gate, until a limit is
    crossed (the piece that crossed it dropped, as the driver drops it)."""
    pieces: list[bytes] = []
    for read in reads:
        view, start = memoryview(read), 0
        while start < len(view):
            end = gate.cut(view, start, now)
            if guard.tripped is not None:
                return pieces
            pieces.append(bytes(view[start:end]))
            start = end
    return pieces


def _frames_in(data: bytes) -> list[tuple[int, int]]:
    """(type, flags) of each frame h2 wrote."""
    found = []
    while data:
        length = int.from_bytes(data[:3], "big")
        found.append((data[3], data[4]))
        data = data[9 + length:]
    return found


def _mixed_stream() -> bytes:
    """A connection's worth of ordinary frames: requests with and without bodies,
    a header block in CONTINUATIONs, big and padded DATA, PING, WINDOW_UPDATE, resets."""
    out = PREFACE + frame(0x4, 0, 0, b"\x00\x04\x00\x10\x00\x00")
    for i in range(30):
        stream_id = 1 + 2 * i
        if i % 3 == 0:
            out += frame(0x1, 0x5, stream_id, STATIC_GET_BLOCK)
            out += frame(0x2, 0, stream_id, b"\x00\x00\x00\x00\x20")  # PRIORITY on a closed stream
        elif i % 3 == 1:
            out += frame(0x1, 0x0, stream_id, STATIC_GET_BLOCK[:5])
            out += frame(0x9, 0x4, stream_id, STATIC_GET_BLOCK[5:])  # CONTINUATION
            out += frame(0x0, 0x0, stream_id, b"x" * 4_000)
            out += frame(0x0, 0x9, stream_id, b"\x03abc\x00\x00\x00")  # padded, END_STREAM
        else:
            out += frame(0x1, 0x4, stream_id, STATIC_GET_BLOCK) + frame(0x3, 0, stream_id, CANCEL)
        out += frame(0x6, 0, 0, i.to_bytes(8, "big")) + frame(0x8, 0, 0, b"\x00\x00\x01\x00")
    return out


def _events(pieces: list[bytes]) -> list[str]:
    conn = _server()
    return [repr(event) for piece in pieces for event in conn.receive_data(piece)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40_000), max_size=40))
@example(cuts=[1, 1, 1, 70, 14])  # a header split after a payload that ended in the same read
def test_gate_when_reads_split_anywhere_then_pieces_are_the_bytes_in_order_and_h2_sees_the_same_events(
        cuts: list[int]) -> None:
    """Reads split at any byte (inside the preface, a header, a payload): the
    pieces join back into the bytes, each holds at most FRAMES_PER_PIECE frame
    starts, h2 yields what it yields for the bytes in one go, and every frame
    is counted once, by its kind."""
    stream = _mixed_stream()
    reads, at = [], 0
    for size in cuts:
        reads.append(stream[at:at + size])
        at += size
    reads = [read for read in [*reads, stream[at:]] if read]
    guard = FloodGuard(BIG, now=0.0)
    gate = FrameGate(guard)
    pieces = _pieces(gate, guard, reads)
    assert b"".join(pieces) == stream
    assert _events(pieces) == _events([stream])
    assert guard.counted(Flood.RESET) == 10
    assert guard.counted(Flood.CONTROL) == 1 + 10 + 30  # the SETTINGS, the PRIORITY frames, the PINGs
    assert guard.counted(Flood.WINDOW) == 30
    assert guard.counted(Flood.EMPTY) == 0  # the padded one carries 3 bytes


def test_gate_when_a_read_is_all_small_frames_then_pieces_of_sixteen() -> None:
    guard = FloodGuard(BIG, now=0.0)
    gate = FrameGate(guard)
    read = PREFACE + b"".join(frame(0x8, 0, 0, b"\x00\x00\x00\x01") for _ in range(100))
    pieces = _pieces(gate, guard, [read])
    assert [len(p) for p in pieces] == [24 + 13 * 16, *[13 * 16] * 5, 13 * 4]
    assert FRAMES_PER_PIECE == 16


def test_gate_when_ten_thousand_settings_in_one_read_then_h2_answers_no_more_than_the_limit() -> None:
    """The issue's figure: 10,000 SETTINGS frames in one write drew 2,200 ACKs
    against a limit of 500 a second. Counted by header, the 501st is never parsed."""
    guard = FloodGuard({**BIG, Flood.CONTROL: 500}, now=0.0)
    gate = FrameGate(guard)
    read = PREFACE + b"".join(frame(0x4, 0, 0, b"\x00\x04\x00\x01\x00\x00") for _ in range(10_000))
    conn = _server()
    for piece in _pieces(gate, guard, [read]):
        conn.receive_data(piece)
    assert guard.tripped is Flood.CONTROL
    acks = [f for f in _frames_in(conn.data_to_send()) if f == (0x4, 0x1)]
    # The piece that holds the 501st is dropped with it: the connection is over.
    assert 500 - FRAMES_PER_PIECE < len(acks) <= 500


def test_gate_when_rapid_reset_pairs_then_h2_opens_no_more_streams_than_the_reset_limit() -> None:
    guard = FloodGuard({**BIG, Flood.RESET: 100}, now=0.0)
    gate = FrameGate(guard)
    read = PREFACE + b"".join(frame(0x1, 0x5, 1 + 2 * i, STATIC_GET_BLOCK) + frame(0x3, 0, 1 + 2 * i, CANCEL)
                              for i in range(2_000))
    conn = _server()
    opened = sum(isinstance(event, h2.events.RequestReceived)
                 for piece in _pieces(gate, guard, [read]) for event in conn.receive_data(piece))
    assert guard.tripped is Flood.RESET
    # The 101st HEADERS may come before the RST_STREAM past the limit.
    assert 100 - FRAMES_PER_PIECE < opened <= 101


def test_gate_when_the_window_turns_then_a_steady_rate_under_the_limit_never_trips() -> None:
    """Counted at the time the read came (the driver's clock, injected here)."""
    guard = FloodGuard({**BIG, Flood.WINDOW: 50}, now=0.0)
    gate = FrameGate(guard)
    gate.cut(memoryview(PREFACE), 0, 0.0)
    update = frame(0x8, 0, 0, b"\x00\x00\x00\x01")
    for second in range(20):
        for tick in range(5):
            read = memoryview(update * 10)
            assert gate.cut(read, 0, second + tick / 5) == len(read)
    assert guard.tripped is None
    read = memoryview(update * 51)
    assert gate.cut(read, 0, 20.5) == 13 * 16  # a first piece, in a fresh window
    assert gate.cut(read, 13 * 16, 20.5) == 13 * 32
    assert gate.cut(read, 13 * 32, 20.5) == 13 * 48
    assert gate.cut(read, 13 * 48, 20.5) == 13 * 50  # the 51st is not handed on
    assert guard.tripped is Flood.WINDOW


def test_gate_when_a_header_is_split_at_every_byte_then_its_frame_is_counted_once() -> None:
    empty_data = frame(0x0, 0x0, 1, b"")
    for split in range(1, 9):
        guard = FloodGuard(BIG, now=0.0)
        gate = FrameGate(guard, preface_bytes=0)
        reads = [empty_data[:split], empty_data[split:] + frame(0x3, 0, 1, CANCEL)]
        assert b"".join(_pieces(gate, guard, reads)) == b"".join(reads)
        assert guard.counted(Flood.EMPTY) == 1 and guard.counted(Flood.RESET) == 1


def test_gate_when_the_frame_past_the_limit_has_a_split_header_then_none_of_its_rest_is_handed_on() -> None:
    guard = FloodGuard({**BIG, Flood.RESET: 1}, now=0.0)
    gate = FrameGate(guard, preface_bytes=0)
    reset = frame(0x3, 0, 1, CANCEL)
    assert gate.cut(memoryview(reset + reset[:4]), 0, 0.0) == 17  # the second's first 4 bytes pass
    assert guard.tripped is None
    assert gate.cut(memoryview(reset[4:]), 0, 0.0) == 0
    assert guard.tripped is Flood.RESET


def test_gate_counts_by_kind() -> None:
    """DATA is EMPTY only with no payload and no END_STREAM; HEADERS, CONTINUATION
    and GOAWAY are not counted; SETTINGS and PING ACKs are (a flood of them costs a parse too)."""
    guard = FloodGuard(BIG, now=0.0)
    gate = FrameGate(guard, preface_bytes=0)
    read = b"".join([
        frame(0x0, 0x0, 1, b""), frame(0x0, 0x1, 1, b""), frame(0x0, 0x0, 1, b"x"),
        frame(0x1, 0x4, 3, STATIC_GET_BLOCK), frame(0x9, 0x4, 3, b""), frame(0x7, 0, 0, b"\x00" * 8),
        frame(0x2, 0, 5, b"\x00\x00\x00\x00\x10"), frame(0x4, 0x1, 0), frame(0x6, 0x1, 0, b"\x00" * 8),
        frame(0x8, 0, 1, b"\x00\x00\x00\x01"), frame(0x3, 0, 1, CANCEL),
    ])
    assert gate.cut(memoryview(read), 0, 0.0) == len(read)
    assert {kind: guard.counted(kind) for kind in Flood} == {
        Flood.EMPTY: 1, Flood.CONTROL: 3, Flood.WINDOW: 1, Flood.RESET: 1}
