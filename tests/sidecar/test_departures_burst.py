"""Many clients leaving at once: every upstream is closed, and every stream's
bookkeeping still runs once (record, metrics, the pod, the registry)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Callable

from clients import chat_body, connect, open_silent_streams, request_bytes, reset, wait_for
from conftest import LoopThread, RunningSidecar
from h2client import H2Client
from tokenwire.sidecar.exchange.departures import MAX_HELD, MAX_WAIT_S, PAUSE_S, SLICE_S, Departures
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
        await asyncio.sleep(0)
        departures.defer(lambda: ran.append("c"))  # before the first look: wait again
        await asyncio.sleep(0)
        assert ran == []
        for _ in range(4):
            await asyncio.sleep(0)
        assert len(departures) == 0
        return ran

    assert loop_thread.run(scenario()) == ["a", "b", "c"]


def test_departures_let_the_resets_read_meanwhile_go_first(loop_thread: LoopThread) -> None:
    """Resets that reach the sidecar during a slice of bookkeeping are read in
    the loop's next poll, and each reaches its ``connection_lost`` (where the
    upstream is cut) by a callback queued in that poll: the next look runs
    behind those callbacks, so no cut waits for another slice. Real TCP
    connections reset with ``SO_LINGER`` 0; with and without the pause."""
    async def scenario(pause_s: float) -> list[str]:
        loop = asyncio.get_running_loop()
        departures = Departures(pause_s=pause_s)
        order: list[str] = []
        made: list[asyncio.BaseTransport] = []

        class Client(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                order.append("cut")
                departures.defer(lambda: order.append("bookkeeping"))

        server = await loop.create_server(Client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        socks = [connect(port) for _ in range(2)]
        while len(made) < 2:
            await asyncio.sleep(0)

        def slow() -> None:  # a whole slice, during which both clients reset
            order.append("slow")
            for sock in socks:
                reset(sock)
            # ...and the kernel has taken both RSTs before the slice ends.
            _busy(SLICE_S, until=lambda: all(_tcp_closed(t) for t in made))

        departures.defer(slow)
        departures.defer(lambda: order.append("next"))  # held for the next slice
        while len(order) < 6:
            await asyncio.sleep(0.001)
        server.close()
        return order

    for pause_s in (0, PAUSE_S):
        order = loop_thread.run(scenario(pause_s))
        assert order == ["slow", "cut", "cut", "next", "bookkeeping", "bookkeeping"]


def _busy(duration_s: float, until: Callable[[], bool] = lambda: True) -> None:
    """Keep the loop busy for ``duration_s`` (a precise clock: uvloop's moves
    in whole milliseconds), and then until ``until()`` holds."""
    end = time.monotonic() + duration_s
    while time.monotonic() < end or not until():
        pass


def _tcp_closed(transport: asyncio.BaseTransport) -> bool:
    """The kernel's TCP state of the transport's socket is CLOSE (an RST
    taken), read from ``TCP_INFO`` without touching the socket's error."""
    info = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    return info[0] == 7  # TCP_CLOSE


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
            _busy(SLICE_S)

        deferred_at = loop.time()
        for _ in range(3):
            departures.defer(slow)
        departures.defer(done.set)
        await asyncio.wait_for(done.wait(), 10)
        return deferred_at, ran_at

    deferred_at, ran_at = loop_thread.run(scenario())
    assert len(ran_at) == 3
    # In the loop's own clock, the pauses' (uvloop's moves in whole milliseconds).
    assert ran_at[0] - deferred_at >= PAUSE_S * 0.99
    for before, after in itertools.pairwise(ran_at):
        assert after - before >= PAUSE_S * 0.99


def test_departures_never_wait_past_their_bounds(loop_thread: LoopThread) -> None:
    async def steady_trickle() -> int:
        """A new departure every turn: the bookkeeping still runs once
        ``MAX_WAIT_S`` of loop time has passed (its look is two turns away)."""
        loop = asyncio.get_running_loop()
        departures = Departures(pause_s=0)
        ran: list[int] = []
        started = loop.time()
        turns_past_bound = 0
        while not ran:
            departures.defer(lambda: ran.append(1))
            await asyncio.sleep(0)
            if loop.time() - started >= MAX_WAIT_S:
                turns_past_bound += 1
        return turns_past_bound

    async def flood() -> tuple[list[tuple[int, int]], int]:
        """Past ``MAX_HELD`` held departures, the slices follow each other
        with no pause between them (only the two turns of each look)."""
        departures = Departures()
        turn = 0
        ran: list[tuple[int, int]] = []  # (loop turn, departures still held after it)
        done = asyncio.Event()

        def slow() -> None:  # half a slice: two per slice
            _busy(SLICE_S / 2)
            ran.append((turn, len(departures)))

        for _ in range(MAX_HELD + 40):
            departures.defer(slow)
        departures.defer(done.set)
        while not done.is_set():
            await asyncio.sleep(0)
            turn += 1
        return ran, len(departures)

    assert loop_thread.run(steady_trickle()) <= 3
    ran, held = loop_thread.run(flood())
    assert held == 0
    assert len(ran) == MAX_HELD + 40
    # Each slice's last run, and how many it left held: while that was
    # MAX_HELD or more, the next slice came two turns later (a pause would be
    # a millisecond of turns); below it, the pauses are back.
    last_of_slice = {turn: left for turn, left in ran}
    slices = sorted(last_of_slice.items())
    gaps = [(after[0] - before[0], before[1]) for before, after in itertools.pairwise(slices)]
    assert sum(1 for _, left in gaps if left >= MAX_HELD) >= 10
    assert all(gap <= 3 for gap, left in gaps if left >= MAX_HELD)


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
        for _ in range(6):
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
