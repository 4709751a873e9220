"""DataWriter, sans-IO: the DATA frames written beside h2 are h2's own bytes, and
leave h2 in h2's own state, for any sequence of sends, window updates, settings,
resets and ends. Two real server-side H2Connections take the same client bytes;
one sends through DataWriter, the other through h2 alone, and after every step
their output, errors, windows and states must agree."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import h2.config
import h2.connection
import h2.errors
import h2.exceptions
import h2.settings
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.downstream.http2_data import DataWriter, supported

REQUEST = [(b":method", b"POST"), (b":path", b"/v1/chat/completions"), (b":scheme", b"http"),
           (b":authority", b"sidecar")]
STREAM_IDS = (1, 3, 5, 7, 9)  # 9 is never opened


def _server() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    return conn


class Pair:
    """A client, and two servers fed its bytes: ``ours`` sends DATA through a
    DataWriter, ``theirs`` through h2."""

    def __init__(self) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.client = h2.connection.H2Connection(config)
        self.client.initiate_connection()
        self.ours, self.theirs = _server(), _server()
        self.writer = DataWriter(self.ours)
        self.sent_ours = bytearray()
        self.sent_theirs = bytearray()
        self.opened: list[int] = []
        self.deliver()

    def deliver(self) -> None:
        """The client's pending bytes to both servers; h2's answers back to it."""
        data = self.client.data_to_send()
        if data:
            for server in (self.ours, self.theirs):
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    server.receive_data(data)
        self.flush()

    def flush(self) -> None:
        ours, theirs = self.writer.take(), self.theirs.data_to_send()
        assert ours == theirs
        self.sent_ours += ours
        self.sent_theirs += theirs
        if theirs:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.client.receive_data(theirs)

    def both(self, ours: Callable[[], object], theirs: Callable[[], object]) -> None:
        assert _outcome(ours) == _outcome(theirs)

    def send_both(self, stream_id: int, payload: bytes) -> None:
        self.both(partial(self.writer.send, stream_id, payload),
                  partial(self.theirs.send_data, stream_id, payload))

    def check_state(self) -> None:
        ours, theirs = self.ours, self.theirs
        assert ours.state_machine.state is theirs.state_machine.state
        assert ours.outbound_flow_control_window == theirs.outbound_flow_control_window
        assert sorted(ours.streams) == sorted(theirs.streams)
        for stream_id, stream in ours.streams.items():
            other = theirs.streams[stream_id]
            assert stream.state_machine.state is other.state_machine.state
            assert stream.outbound_flow_control_window == other.outbound_flow_control_window
        for stream_id in STREAM_IDS:
            assert (_outcome(partial(self.writer.window, stream_id))
                    == _outcome(partial(theirs.local_flow_control_window, stream_id)))


def _outcome(call: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", call()
    except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError, h2.exceptions.NoSuchStreamError,
            h2.exceptions.FlowControlError, h2.exceptions.FrameTooLargeError, KeyError) as error:
        return type(error).__name__, str(error)


def _step(pair: Pair, step: tuple[str, int, int]) -> None:
    kind, index, amount = step
    client = pair.client
    # Most steps are on an opened stream; one choice in five is a stream never opened.
    stream_id = [*pair.opened, STREAM_IDS[-1]][index % (len(pair.opened) + 1)] if index else STREAM_IDS[-1]
    if kind == "open" and len(pair.opened) < len(STREAM_IDS) - 1:
        stream_id = STREAM_IDS[len(pair.opened)]
        pair.opened.append(stream_id)
        _client_call(pair, lambda: client.send_headers(stream_id, REQUEST, end_stream=amount % 2 == 0))
        pair.both(lambda: pair.ours.send_headers(stream_id, [(b":status", b"200")]),
                  lambda: pair.theirs.send_headers(stream_id, [(b":status", b"200")]))
    elif kind == "data":
        # Sizes around the limits: exactly the window (or the frame size), one past, small, zero.
        window = _outcome(lambda: pair.theirs.local_flow_control_window(stream_id))
        limit = min(int(window[1]), pair.theirs.max_outbound_frame_size) if window[0] == "ok" else 10  # type: ignore[call-overload]
        size = (limit, limit + 1, amount * 100, 0)[amount % 4]
        pair.send_both(stream_id, bytes([index + 65]) * size)
    elif kind == "small":
        pair.send_both(stream_id, b"data: {}\n\n" * (amount + 1))
    elif kind == "window":
        increment = amount * 1000 + 1
        _client_call(pair, lambda: client.increment_flow_control_window(increment, stream_id=stream_id))
    elif kind == "conn_window":
        _client_call(pair, lambda: client.increment_flow_control_window(amount * 1000 + 1))
    elif kind == "settings":
        _client_call(pair, lambda: client.update_settings({
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: amount * 97,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 16_384 + amount * 1000}))
    elif kind == "client_end":
        _client_call(pair, lambda: client.end_stream(stream_id))
    elif kind == "client_reset":
        _client_call(pair, lambda: client.reset_stream(stream_id))
    elif kind == "end":
        pair.both(lambda: pair.ours.end_stream(stream_id), lambda: pair.theirs.end_stream(stream_id))
    elif kind == "reset":
        pair.both(lambda: pair.ours.reset_stream(stream_id), lambda: pair.theirs.reset_stream(stream_id))
    elif kind == "goaway":
        pair.both(lambda: pair.ours.close_connection(), lambda: pair.theirs.close_connection())
    if kind in ("flush", "goaway") or amount % 3 == 0:
        pair.flush()


def _client_call(pair: Pair, call: Callable[[], object]) -> None:
    if _outcome(call)[0] == "ok":
        pair.deliver()


# Sends weigh most; what ends a stream or the connection is rarer, so most
# examples send a while on open streams before it comes.
_KINDS = ["small"] * 8 + ["data"] * 4 + ["window", "conn_window"] * 2 + ["open", "settings", "flush"] * 2 + [
    "client_end", "client_reset", "end", "reset", "goaway"]
_STEPS = st.tuples(
    st.sampled_from(_KINDS),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=0, max_value=70))


@settings(max_examples=500, deadline=None)
@given(steps=st.lists(_STEPS, max_size=40))
def test_data_frames_are_h2s_own_bytes_and_state(steps: list[tuple[str, int, int]]) -> None:
    pair = Pair()
    for step in [("open", 1, 1), *steps]:
        _step(pair, step)
        pair.check_state()
    pair.flush()
    assert pair.sent_ours == pair.sent_theirs


def test_a_plain_answer_takes_the_fast_path() -> None:
    """The writer writes the frame itself (h2's send_data never runs) for an
    answer's ordinary event, so the property test above compares two paths."""
    pair = Pair()
    _step(pair, ("open", 0, 0))
    calls: list[int] = []
    h2_send = pair.ours.send_data
    pair.ours.send_data = lambda *args, **kwargs: calls.append(1) or h2_send(*args, **kwargs)  # type: ignore[method-assign]
    pair.writer.send(1, b"data: {}\n\n")
    assert calls == []
    pair.theirs.send_data(1, b"data: {}\n\n")
    pair.flush()
    pair.check_state()


def test_this_h2_is_supported() -> None:
    """The h2 the project installs keeps the state DataWriter reads (else every
    frame would silently take h2's slower path)."""
    assert supported(_server())
