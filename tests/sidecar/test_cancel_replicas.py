"""Cancel by id across replicas sharing a real Redis store: the replica a DELETE
reaches passes it on to the one writing the stream (``redis_cancel.py``), and
answers once the stream's end is stored; a stream nobody writes is refused."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable

import pytest
from clients import chat_body, exchange, wait_for
from conftest import LoopThread, RunningSidecar
from processes import spawn
from resume_client import open_stream
from test_cancel import ALICE, MALLORY, PATH, _cancel, _reconnect, _start, _told_cancelled
from tokenwire.middleware import EndReason, ReplayAppend, WireConfig
from tokenwire.middleware.core.resume import CallerKey
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from upstreams import FakeUpstream

pytestmark = pytest.mark.slow

SHARED = {"resume": True, "resume_grace_s": 10.0, "resume_owner_secret": "replicas-share-this"}
RUNS = 10
# The owner's DELETE on the other replica reaches the upstream as a closed
# connection within this, at the median: one publish, the writer's stop, the
# end stored, the canceller's next look at it.
ABORTED_WITHIN_S = 0.100


def _replicas(start_sidecar: Callable[..., RunningSidecar], redis_url: str) -> tuple[RunningSidecar, ...]:
    return tuple(start_sidecar(resume_store=redis_url, **SHARED) for _ in range(2))


def test_a_cancel_on_the_other_replica_stops_the_writer_there(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, redis_url: str) -> None:
    writer, other = _replicas(start_sidecar, redis_url)
    delays_s: list[float] = []
    for run in range(RUNS):
        request_id = f"far-cancel-{run}"
        part = _start(writer, request_id)
        connection = upstream.connection_of(request_id)
        assert connection.peer_closed_at is None  # generating on, for the grace
        asked_at = time.monotonic()
        status, body = _cancel(other, part.stream_id)
        assert (status, body) == (200, {"id": part.stream_id, "object": "stream", "status": "cancelled"})
        wait_for(lambda connection=connection: connection.peer_closed_at is not None, timeout_s=5)
        delays_s.append(connection.peer_closed_at - asked_at)
        assert writer.record(request_id).end_reason is EndReason.CANCELLED
        # Either replica's reader learns of it, after what was stored.
        assert _told_cancelled(_reconnect(other, part))
    assert statistics.median(delays_s) <= ABORTED_WITHIN_S, delays_s


def test_another_callers_cancel_on_the_other_replica_is_an_unknown_id_and_changes_nothing(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, redis_url: str) -> None:
    writer, other = _replicas(start_sidecar, redis_url)
    part = _start(writer, "far-mallory")
    status, body = _cancel(other, part.stream_id, MALLORY)
    assert status == 404 and body["error"]["code"] == "stream_not_found"
    assert upstream.connection_of("far-mallory").peer_closed_at is None
    assert _cancel(other, part.stream_id, ALICE)[0] == 200  # the owner's still works


def test_a_live_stream_no_process_stops_is_stream_elsewhere(
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread, redis_url: str) -> None:
    """Its writer lives (its lease is renewed) but does not hear cancels: nobody
    stops it, and the caller is told so after the relay's wait, not told it
    was cancelled."""
    sidecar, _ = _replicas(start_sidecar, redis_url)
    stream_id = f"unheard-{uuid.uuid4().hex}"
    # Its lease renewed on a loop of its own, which the sidecars' work never holds up.
    own = LoopThread()
    writer = RedisReplayStore(redis_url)  # hears no cancel
    own.run(writer.open(stream_id, owner=_alice()))
    try:
        _start(sidecar, "listens")  # the replica writes streams: it listens for cancels
        asked_at = time.monotonic()
        status, body = _cancel(sidecar, stream_id)
        assert status == 409 and body["error"]["code"] == "stream_elsewhere", body
        assert time.monotonic() - asked_at >= 1.5  # the relay waited for a writer that never answered
    finally:
        own.run(writer.aclose())
        own.close()


def test_a_cancel_of_a_stream_whose_writer_died_forgets_it(
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread, redis_url: str) -> None:
    """Its writer opened it and is gone before storing its end (its lease
    lapses): the stream never goes on, so the cancel answers as for an ended
    stream and forgets it, where it used to say 409 stream_elsewhere."""
    sidecar, _ = _replicas(start_sidecar, redis_url)
    stream_id = f"orphaned-{uuid.uuid4().hex}"
    writer = RedisReplayStore(redis_url)
    loop_thread.run(writer.open(stream_id, owner=_alice()))
    loop_thread.run(writer.aclose())  # its renewals stop: the lease lapses
    _start(sidecar, "listens")
    asked_at = time.monotonic()
    status, body = _cancel(sidecar, stream_id)
    assert (status, body) == (200, {"id": stream_id, "object": "stream", "status": "ended"}), body
    print(f"\na dead writer's stream: cancel answered in {time.monotonic() - asked_at:.2f} s")
    status, body = _cancel(sidecar, stream_id)
    assert status == 404 and body["error"]["code"] == "stream_not_found", body  # forgotten


def _alice() -> str:
    key = CallerKey.from_config(WireConfig(resume=True, resume_owner_secret=SHARED["resume_owner_secret"]))
    return key.owner([(b"authorization", ALICE["Authorization"].encode())])


def test_the_relay_is_heard_only_by_the_process_that_writes(loop_thread: LoopThread, redis_url: str) -> None:
    """The store's own relay, sans sidecar: a process stopped by a published cancel
    is told the stream id; no end stored means the publisher hears False."""
    listener, publisher = RedisReplayStore(redis_url), RedisReplayStore(redis_url)
    stopped: list[str] = []

    async def scenario() -> tuple[bool, bool]:
        listener.serve_cancels(lambda stream_id: stopped.append(stream_id) is None)
        for _ in range(200):  # subscribed?
            if (await publisher._redis.pubsub_numsub("tw:cancel"))[0][1]:
                break
            await asyncio.sleep(0.01)
        unanswered = await publisher.relay_cancel("nobody-ends-it")
        await listener.open("ends", owner="o")
        listener.append(_end("ends"))
        answered = await publisher.relay_cancel("ends")
        await listener.aclose()
        await publisher.aclose()
        return unanswered, answered

    unanswered, answered = loop_thread.run(scenario())
    assert (unanswered, answered) == (False, True)
    assert stopped == ["nobody-ends-it", "ends"]


def _end(stream_id: str) -> ReplayAppend:
    return ReplayAppend(stream_id, 1, (b"data: x\n\n",), end=EndReason.CANCELLED)


def test_under_workers_every_cancel_reaches_the_writer_whichever_worker_it_lands_on(
        upstream: FakeUpstream, redis_url: str) -> None:
    """``--workers 2`` on one Redis store: the kernel spreads the DELETEs over the
    workers, and each is answered ``cancelled`` (before the relay, one in two was
    ``stream_elsewhere``)."""
    process = spawn(["--upstream", upstream.url, "--workers", "2", "--resume", "--resume-grace-s", "10",
                     "--resume-store", redis_url, "--resume-owner-secret", "workers-share-this"])
    try:
        for run in range(12):
            request_id = f"workers-cancel-{run}"
            part = open_stream(process.port, "POST", PATH, body=chat_body(), stop_after=3, headers={
                "x-fake-tokens": "5000", "x-fake-delay-s": "0.005", "x-request-id": request_id, **ALICE})
            answer = exchange(process.port, "DELETE", f"/v1/streams/{part.stream_id}", headers=ALICE)
            assert answer.status == 200, (run, answer.body)
            connection = upstream.connection_of(request_id)
            wait_for(lambda connection=connection: connection.peer_closed_at is not None, timeout_s=5)
    finally:
        assert process.stop() == 0
