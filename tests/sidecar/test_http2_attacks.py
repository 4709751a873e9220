"""The known HTTP/2 attacks, each shown and bounded: rapid reset, CONTINUATION
flood, HPACK bomb, SETTINGS/PING/PRIORITY/empty-DATA floods, too many streams,
stream id exhaustion, oversized header lists. Nothing of a refused stream
reaches the upstream, and the sidecar keeps serving others.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable

import hpack
import pytest
from conftest import LoopThread, RunningSidecar
from h2client import PREFACE, STATIC_GET_BLOCK, H2Client, chat_headers, frame, read_goaway
from hyperframe.frame import ContinuationFrame, HeadersFrame
from upstreams import FakeUpstream, expected_text

CHAT = b'{"model":"m","stream":true,"messages":[]}'
CHAT_PATH = "/normal/v1/chat/completions"
ENHANCE_YOUR_CALM = 0xB
PROTOCOL_ERROR = 0x1
REFUSED_STREAM = 0x7


def _serves(sidecar: RunningSidecar) -> None:
    """The sidecar still answers a fresh connection."""
    with H2Client(sidecar.port) as client:
        state = client.response(client.request(CHAT_PATH, method="POST", body=CHAT,
                                               headers=chat_headers(3)))
    assert state.ended and state.status == 200


def _closed_with(client: H2Client, code: int, timeout_s: float = 10.0) -> None:
    assert client.read_until(lambda: client.closed, timeout_s), "the connection stayed open"
    assert client.goaway is not None and client.goaway.error_code == code, client.goaway


class _Bystander(threading.Thread):
    """A stream on its own connection; records the gaps between its DATA frames."""

    def __init__(self, port: int, tokens: int, delay_s: float) -> None:
        super().__init__(daemon=True)
        self.client = H2Client(port)
        self.stream_id = self.client.request(CHAT_PATH, method="POST", body=CHAT,
                                             headers=chat_headers(tokens, delay_s))
        self.started = threading.Event()

    def run(self) -> None:
        state = self.client.streams[self.stream_id]
        self.client.read_until(lambda: state.first_data_at is not None)
        self.started.set()
        self.client.response(self.stream_id, timeout_s=30)

    def max_gap_s(self) -> float:
        times = self.client.streams[self.stream_id].data_times
        return max(b - a for a, b in itertools.pairwise(times))


def test_attack_rapid_reset_when_open_cancel_flood_then_goaway_calm_and_upstream_sees_at_most_the_limit(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream,
        loop_thread: LoopThread) -> None:
    """CVE-2023-44487: streams opened and cancelled at once cost the server
    work while never counting as open. Resets are counted per connection: past
    http2_max_resets_per_s the connection ends with GOAWAY(ENHANCE_YOUR_CALM),
    after a bounded amount of the loop's work (its CPU time: 0.13-0.26 s
    measured, where handling the whole flood took 2.4 s), so a bystander's
    stream on another connection keeps flowing."""
    sidecar = start_sidecar(http2_max_resets_per_s=50, http2_max_concurrent_streams=20)
    bystander = _Bystander(sidecar.port, tokens=40, delay_s=0.02)
    bystander.start()
    assert bystander.started.wait(10)
    before = len(upstream.requests)
    pairs = 20_000
    # Prebuilt frames: the flood costs this process (which also runs the sidecar's
    # loop and the bystander's reader) next to nothing, as a real attacker's would.
    cancel = b"\x00\x00\x00\x08"
    flood = b"".join(frame(0x1, 0x5, 1 + 2 * i, STATIC_GET_BLOCK) + frame(0x3, 0, 1 + 2 * i, cancel)
                     for i in range(pairs))
    cpu_before_s = loop_thread.cpu_time_s()
    with socket.create_connection(("127.0.0.1", sidecar.port), timeout=10) as sock:
        sock.sendall(PREFACE + frame(0x4, 0, 0))
        with contextlib.suppress(OSError):  # the sidecar hangs up mid-flood: that is the defence
            sock.sendall(flood)
        goaway = read_goaway(sock)
    flood_cpu_s = loop_thread.cpu_time_s() - cpu_before_s
    assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM, goaway
    # The loop (sidecar, upstream and all) worked this long while the flood came:
    # a stall of the bystander's stream can be no longer, whatever the load. The
    # bound sits between the defended figure and the undefended one (see the
    # docstring) with room for a busy machine, where a thread's CPU time grows.
    assert flood_cpu_s < 1.5, flood_cpu_s
    bystander.join(30)
    assert bystander.client.streams[bystander.stream_id].ended
    # bench/h2_bench.py measures this bound apart from the load (81 ms there);
    # here the test process also runs the sidecar and the reader, on a machine
    # maybe busy besides (0.23-0.52 s seen): a generous bound of wall time, the
    # CPU bound above being the exact one.
    assert bystander.max_gap_s() < 3.0
    time.sleep(0.2)  # let any upstream request already under way arrive
    forwarded = len(upstream.requests) - before
    assert forwarded <= 50 + 20
    _serves(sidecar)


def test_attack_too_many_streams_when_over_the_limit_then_refused_stream_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(http2_max_concurrent_streams=4)
    with H2Client(sidecar.port) as client:
        client.read_until(lambda: client.conn.remote_settings.max_concurrent_streams == 4, 5)
        assert client.conn.remote_settings.max_concurrent_streams == 4
        # A client that ignores the limit: streams 5 and 6 are refused, one by one.
        client.conn.remote_settings[3] = 100
        client.conn.remote_settings.acknowledge()
        ids = [client.request(CHAT_PATH, method="POST", body=CHAT,
                              headers=[*chat_headers(20, 0.02), (b"x-request-id", f"cap-{i}".encode())])
               for i in range(6)]
        for stream_id in ids[4:]:
            assert client.response(stream_id).reset_code == REFUSED_STREAM
        for stream_id in ids[:4]:
            state = client.response(stream_id)
            assert state.ended and state.status == 200
    assert not upstream.requests_with("cap-4") and not upstream.requests_with("cap-5")


def test_attack_continuation_flood_when_endless_header_block_then_goaway_after_a_bounded_run(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """CVE-2024-27316: a header block that never ends, one CONTINUATION after
    another, held in memory by servers that wait for END_HEADERS. h2 allows 64
    frames (64 x 16 KiB at most) and ends the connection with PROTOCOL_ERROR."""
    sidecar = start_sidecar()
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        encoder = hpack.Encoder()
        first = HeadersFrame(1)
        first.data = encoder.encode([(b":method", b"GET"), (b":path", b"/models/v1/models"),
                                     (b":scheme", b"http"), (b":authority", b"x")])
        client.sock.sendall(first.serialize())
        sent = 0
        try:
            for _ in range(10_000):
                frame = ContinuationFrame(1)
                frame.data = encoder.encode([(b"x-flood", b"y" * 1000)])
                client.sock.sendall(frame.serialize())
                sent += 1
        except OSError:
            pass
        _closed_with(client, PROTOCOL_ERROR)
    assert sent < 10_000 or client.closed
    assert len(upstream.requests) == before
    _serves(sidecar)


def test_attack_hpack_bomb_when_small_block_inflates_huge_then_goaway_calm_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """A 4 KB header put in the dynamic table once, then named by its one-byte
    index 500 times: 5 KB on the wire, 2 MB decoded. The decoder stops at twice
    http2_max_header_list_bytes and the connection ends."""
    sidecar = start_sidecar()
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        client.read_until(lambda: client.conn.remote_settings.max_header_list_size is not None, 5)
        bomb = [(b"x-bomb", b"a" * 4000)] * 500
        encoder = hpack.Encoder()
        frame = HeadersFrame(1)
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        frame.data = encoder.encode([(b":method", b"GET"), (b":path", b"/models/v1/models"),
                                     (b":scheme", b"http"), (b":authority", b"x"), *bomb])
        assert len(frame.data) < 6000
        client.sock.sendall(frame.serialize())
        _closed_with(client, ENHANCE_YOUR_CALM)
    assert len(upstream.requests) == before
    _serves(sidecar)


def test_attack_header_list_over_limit_then_stream_431_and_connection_stays(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(http2_max_header_list_bytes=8192)
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        big = client.response(client.request("/models/v1/models", headers=[(b"x-big", b"b" * 10_000)]))
        assert big.status == 431 and big.ended
        assert "8192" in json.loads(bytes(big.body))["error"]["message"]
        assert len(upstream.requests) == before
        fine = client.response(client.request("/models/v1/models"))
        assert fine.status == 200


@pytest.mark.parametrize(("method", "path", "status"), [
    ("get", "/models/v1/models", 400),  # methods are case-sensitive
    ("TRACE", "/models/v1/models", 405),
    ("GET", "/models/v1/../../etc/passwd", 400),
    ("GET", "/models/v1/%2e%2e/x", 400),
    ("GET", "/models/v1/" + "a" * 9000, 414),
])
def test_request_rules_when_over_http2_then_refused_as_over_http1_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, method: str, path: str,
        status: int) -> None:
    """The rules both versions share (sidecar/downstream/request_rules.py): the
    same statuses as the HTTP/1.1 payload corpus gets, the connection kept."""
    sidecar = start_sidecar()
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        refused = client.response(client.request(path, method=method))
        assert (refused.status, refused.ended) == (status, True), bytes(refused.body)
        assert len(upstream.requests) == before
        assert client.response(client.request("/models/v1/models")).status == 200


def test_request_rules_when_authority_is_no_host_then_400(start_sidecar: Callable[..., RunningSidecar],
                                                         upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        assert client.response(client.request("/models/v1/models", authority=b"a/b")).status == 400
        assert len(upstream.requests) == before


@pytest.mark.parametrize("flood", ["settings", "ping", "priority"])
def test_attack_control_frame_flood_then_goaway_calm(start_sidecar: Callable[..., RunningSidecar],
                                                 flood: str) -> None:
    """CVE-2019-9512 (PING), -9515 (SETTINGS), -9516/-9513 (PRIORITY): frames
    that make the server answer or reorder, nothing asked. Past
    http2_max_control_frames_per_s the connection ends."""
    sidecar = start_sidecar(http2_max_control_frames_per_s=100)
    with H2Client(sidecar.port) as client:
        sent = 0
        try:
            for i in range(5000):
                if flood == "settings":
                    client.conn.update_settings({4: 65535 + i % 2})
                elif flood == "ping":
                    client.conn.ping(i.to_bytes(8, "big"))
                else:
                    client.conn.prioritize(1 + 2 * (i % 100), weight=1 + i % 255)
                sent += 1
                if sent % 100 == 0:
                    client.flush()
            client.flush()
        except OSError:
            pass
        _closed_with(client, ENHANCE_YOUR_CALM)
    _serves(sidecar)


def test_attack_empty_data_flood_then_goaway_calm_and_nothing_forwarded(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """CVE-2019-9518: DATA frames with nothing in them, each an event to handle."""
    sidecar = start_sidecar(http2_max_empty_frames_per_s=100)
    before = len(upstream.requests)
    with H2Client(sidecar.port) as client:
        stream_id = client.request("/echo/v1/x", method="POST", end=False)
        try:
            for i in range(5000):
                client.conn.send_data(stream_id, b"")
                if i % 100 == 0:
                    client.flush()
            client.flush()
        except OSError:
            pass
        _closed_with(client, ENHANCE_YOUR_CALM)
    assert len(upstream.requests) == before
    _serves(sidecar)


def test_attack_streams_per_connection_when_many_then_goaway_no_error_and_the_rest_refused(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """A connection is not forever: after http2_max_streams_per_connection it
    is asked to go (GOAWAY NO_ERROR naming the last stream it serves); what
    it opens later is refused, and what it had open finishes."""
    sidecar = start_sidecar(http2_max_streams_per_connection=3)
    with H2Client(sidecar.port) as client:
        ids = [client.request(CHAT_PATH, method="POST", body=CHAT,
                              headers=[*chat_headers(5, 0.02), (b"x-request-id", f"per-{i}".encode())])
               for i in range(4)]
        assert client.read_until(lambda: client.goaway is not None, 5)
        assert client.goaway is not None and client.goaway.last_stream_id == ids[2]
        assert client.goaway.error_code == 0
        for stream_id in ids[:3]:
            assert client.response(stream_id).ended
        assert client.response(ids[3]).reset_code == REFUSED_STREAM
    assert not upstream.requests_with("per-3")


def test_attack_stream_id_exhaustion_when_last_id_used_then_served_and_lower_id_is_a_connection_error(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    """Stream ids only grow, to 2**31 - 1. A client there is served; an id
    below it (a wrapped counter) ends the connection, and the sidecar is fine."""
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        last = 2**31 - 1
        client.conn.highest_outbound_stream_id = last - 2
        stream_id = client.request(CHAT_PATH, method="POST", body=CHAT, headers=chat_headers(3))
        assert stream_id == last
        state = client.response(stream_id)
        assert state.ended and bytes(state.body).count(b"t2 ") == 1
        encoder = hpack.Encoder()
        frame = HeadersFrame(1)
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        frame.data = encoder.encode([(b":method", b"GET"), (b":path", b"/models/v1/models"),
                                     (b":scheme", b"http"), (b":authority", b"x")])
        client.sock.sendall(frame.serialize())
        _closed_with(client, PROTOCOL_ERROR)
    _serves(sidecar)
    assert expected_text(1)
