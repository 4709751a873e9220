"""Many clients leaving at once: every upstream is closed, and every stream's
bookkeeping still runs once (record, metrics, the pod, the registry)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from clients import chat_body, connect, open_silent_streams, request_bytes, reset, wait_for
from conftest import LoopThread, RunningSidecar
from h2client import H2Client
from tokenwire.sidecar.departures import MAX_HELD, MAX_WAIT_TURNS, PAUSE_S, SLICE_S, Departures
from upstreams import FakeUpstream

BURST = 50
SILENT_PATH = "/silent/v1/chat/completions"


def _aborts_measured(sidecar: RunningSidecar) -> float:
    context = sidecar.sidecar.context
    assert context is not None
    metrics = context.metrics
    for family in metrics.abort_propagation.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


def _settled(sidecar: RunningSidecar) -> bool:
    context = sidecar.sidecar.context
    assert context is not None
    return len(context.registry) == 0 and len(context.departures) == 0 and context.buffered_body_bytes == 0


def test_fifty_http1_clients_resetting_at_once_each_close_their_upstream(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    ids = [f"burst-h1-{i}" for i in range(BURST)]
    socks = open_silent_streams(sidecar.port, ids)
    wait_for(lambda: all(upstream.requests_with(request_id) for request_id in ids))
    connections = [upstream.connection_of(request_id) for request_id in ids]
    assert len({id(connection) for connection in connections}) == BURST
    measured = _aborts_measured(sidecar)
    for sock in socks:  # back to back, as a front end that drops its connections would
        reset(sock)
    for request_id, connection in zip(ids, connections, strict=True):
        assert connection.closed.wait(10), f"{request_id}: its upstream was never closed"
        assert connection.peer_closed_at is not None
    for request_id in ids:
        assert sidecar.record(request_id).end_reason.value == "client_gone"
    wait_for(lambda: _aborts_measured(sidecar) == measured + BURST, timeout_s=10)
    wait_for(lambda: _settled(sidecar), timeout_s=10)
    # Each connection's own end waits with its stream's bookkeeping, and still runs once.
    wait_for(lambda: _connections_counted(sidecar) == (0, 0.0), timeout_s=10)


def _connections_counted(sidecar: RunningSidecar) -> tuple[int, float]:
    """The client connections the sidecar holds, and its gauge of them."""
    context = sidecar.sidecar.context
    assert context is not None
    gauge = next(sample.value for family in context.metrics.active_connections.collect()
                 for sample in family.samples)
    return len(context.connections), gauge


def test_fifty_http2_streams_reset_in_one_write_each_close_their_upstream(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    ids = [f"burst-h2-{i}" for i in range(BURST)]
    with H2Client(sidecar.port) as client:
        streams = [client.request(SILENT_PATH, method="POST", body=chat_body(), flush=False,
                                  headers=[(b"content-type", b"application/json"),
                                           (b"x-fake-silence-s", b"60"),
                                           (b"x-request-id", request_id.encode())])
                   for request_id in ids]
        client.flush()
        assert client.read_until(lambda: all(client.streams[s].status is not None for s in streams))
        wait_for(lambda: all(upstream.requests_with(request_id) for request_id in ids))
        connections = [upstream.connection_of(request_id) for request_id in ids]
        for stream_id in streams:
            client.conn.reset_stream(stream_id, 8)  # CANCEL
        client.flush()  # all 50 RST_STREAM frames in one write
        for request_id, connection in zip(ids, connections, strict=True):
            assert connection.closed.wait(10), f"{request_id}: its upstream was never closed"
        for request_id in ids:
            assert sidecar.record(request_id).end_reason.value == "client_gone"
    wait_for(lambda: _settled(sidecar), timeout_s=10)


# ---------------------------------------------------------------- Departures


def test_departures_wait_for_a_turn_without_departures_then_run_in_order(loop_thread: LoopThread) -> None:
    async def scenario() -> list[str]:
        departures = Departures(pause_s=0)
        ran: list[str] = []
        departures.defer(lambda: ran.append("a"))
        departures.defer(lambda: ran.append("b"))
        await asyncio.sleep(0)  # one loop turn: a departure came in it, so wait
        assert ran == []
        departures.defer(lambda: ran.append("c"))
        await asyncio.sleep(0)
        assert ran == []
        await asyncio.sleep(0)  # a quiet turn: the burst is over
        assert ran[:1] == ["a"]  # each slice runs one at least
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(departures) == 0
        return ran

    assert loop_thread.run(scenario()) == ["a", "b", "c"]


def test_departures_leave_the_loop_free_before_each_slice(loop_thread: LoopThread) -> None:
    """With a pause (the default), no bookkeeping runs until ``PAUSE_S`` of
    loop time after the burst, and each next slice waits as long again: the
    loop may sleep, so processes the cuts woke get the CPU."""
    async def scenario() -> tuple[float, list[float]]:
        loop = asyncio.get_running_loop()
        departures = Departures()
        ran_at: list[float] = []
        done = asyncio.Event()

        def slow() -> None:  # takes a whole slice: one per slice
            ran_at.append(loop.time())
            until = loop.time() + SLICE_S
            while loop.time() < until:
                pass

        deferred_at = loop.time()
        for _ in range(3):
            departures.defer(slow)
        departures.defer(done.set)
        await asyncio.wait_for(done.wait(), 10)
        return deferred_at, ran_at

    deferred_at, ran_at = loop_thread.run(scenario())
    assert len(ran_at) == 3
    assert ran_at[0] - deferred_at >= PAUSE_S * 0.99
    for before, after in itertools.pairwise(ran_at):
        assert after - before >= SLICE_S + PAUSE_S * 0.99


def test_departures_never_wait_past_their_bounds(loop_thread: LoopThread) -> None:
    async def steady_trickle() -> int:
        departures = Departures(pause_s=0)
        ran: list[int] = []
        turns = 0
        while not ran:
            departures.defer(lambda: ran.append(1))  # a new departure every turn
            await asyncio.sleep(0)
            turns += 1
            assert turns <= MAX_WAIT_TURNS + 2
        return turns

    async def flood() -> tuple[int, int]:
        departures = Departures()  # with its pause: none while so many are held
        ran: list[int] = []
        done = asyncio.Event()
        for _ in range(MAX_HELD - 1):
            departures.defer(lambda: ran.append(1))
        departures.defer(done.set)
        await asyncio.sleep(0)  # no waiting for a quiet turn nor a pause: so many are held
        first_turn = len(ran)
        await asyncio.wait_for(done.wait(), 10)
        return first_turn, len(ran) + 1

    assert loop_thread.run(steady_trickle()) <= MAX_WAIT_TURNS + 2
    first_turn, total = loop_thread.run(flood())
    assert first_turn >= 1
    assert total == MAX_HELD


def test_departures_run_all_now_on_shutdown(loop_thread: LoopThread) -> None:
    async def scenario() -> tuple[list[int], int]:
        departures = Departures(pause_s=0)
        ran: list[int] = []
        for i in range(3):
            departures.defer(lambda i=i: ran.append(i))
        departures.run_all()  # no loop turn in between
        return ran, len(departures)

    assert loop_thread.run(scenario()) == ([0, 1, 2], 0)


def test_departures_one_failure_does_not_stop_the_others(loop_thread: LoopThread) -> None:
    async def scenario() -> list[int]:
        departures = Departures(pause_s=0)
        ran: list[int] = []

        def broken() -> None:
            raise RuntimeError("bookkeeping bug")

        departures.defer(broken)
        departures.defer(lambda: ran.append(2))
        for _ in range(MAX_WAIT_TURNS + 4):
            await asyncio.sleep(0)
        return ran

    assert loop_thread.run(scenario()) == [2]


def test_clients_leaving_while_queued_for_a_pod_never_reach_it(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """Queued for a busy pod, a client that leaves is dropped from the queue:
    when the pod frees up, nothing is sent for it."""
    sidecar = start_sidecar(max_streams_per_upstream=1, queue_timeout_s=30.0)
    (holder,) = open_silent_streams(sidecar.port, ["queue-holder"])
    context = sidecar.sidecar.context
    assert context is not None
    queued = []
    for i in range(5):
        sock = connect(sidecar.port)
        sock.sendall(request_bytes("POST", SILENT_PATH, body=chat_body(),
                                   headers={"x-fake-silence-s": "60", "X-Request-Id": f"queued-{i}"}))
        queued.append(sock)
    wait_for(lambda: len(context.registry) == 6)
    for sock in queued:
        reset(sock)
    for i in range(5):
        assert sidecar.record(f"queued-{i}").end_reason.value == "client_gone"
    reset(holder)  # the pod frees up: the queue must be empty by now
    assert sidecar.record("queue-holder").end_reason.value == "client_gone"
    wait_for(lambda: _settled(sidecar), timeout_s=10)
    assert not any(upstream.requests_with(f"queued-{i}") for i in range(5))


def test_clients_resetting_while_their_upstreams_stream_each_end_once(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    """Upstream reads arrive in the same loop turns as the resets: a stream
    whose client the loop already saw go (its reset read, or a write that
    failed) is cut from the upstream read itself; the connection's own
    ``connection_lost`` follows. Either way: every upstream closed, one
    record each, the connection counted out once."""
    sidecar = start_sidecar()
    ids = [f"burst-flowing-{i}" for i in range(30)]
    socks = []
    for request_id in ids:
        sock = connect(sidecar.port)
        sock.sendall(request_bytes("POST", "/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-tokens": "100000", "x-fake-delay-s": "0.001",
                                            "X-Request-Id": request_id}))
        socks.append(sock)
    for sock in socks:  # the head, and tokens flowing
        data = b""
        while data.count(b"data:") < 3:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended early"
            data += chunk
    connections = [upstream.connection_of(request_id) for request_id in ids]
    for sock in socks:
        reset(sock)
    for request_id, connection in zip(ids, connections, strict=True):
        assert connection.closed.wait(10), f"{request_id}: its upstream was never closed"
    wait_for(lambda: _settled(sidecar), timeout_s=10)
    records = list(sidecar.log.records)
    for request_id in ids:
        mine = [record for record in records if record.request_id == request_id]
        assert len(mine) == 1, f"{request_id}: {len(mine)} records"
        assert mine[0].end_reason.value == "client_gone"
    wait_for(lambda: _connections_counted(sidecar) == (0, 0.0), timeout_s=10)
