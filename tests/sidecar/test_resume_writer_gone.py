"""A writer that is gone is known at once (issue 35): the process writing a
stream into a shared Redis holds a short lease there, so when it is SIGKILLed
a resume elsewhere gets what was stored and the in-band ``writer_gone`` error
within 2 s, and an idempotent repeat generates afresh, instead of heartbeats
for ``resume_ttl_s``. Real redis-server, real processes, real SIGKILLs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import LoopThread
from processes import SidecarProcess, spawn
from resume_client import open_stream, read_events, request_bytes, resume
from test_resume import PATH, text_of
from tokenwire.middleware import EndReason, ReplayAppend
from tokenwire.middleware.shared.redis_lease import CONFIRM_S, LEASE_MS, RENEW_S, lease_key
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from tokenwire.middleware.shared.replay_store import WriterGone
from upstreams import FakeUpstream, expected_text

from testbed.targets import read_line

pytestmark = pytest.mark.slow

# The target: from the request to the answer (or to the fresh generation).
TARGET_S = 2.0
# The longest a dead writer can look alive: its lease, then the confirming look.
KNOWN_DEAD_S = LEASE_MS / 1000 + CONFIRM_S
RUNS = 3

# A writer in a process of its own, to be SIGKILLed: opens a stream under an
# idempotency key, stores three events, says so, and waits to be killed.
_WRITER = """
import asyncio, sys
from tokenwire.middleware import ReplayAppend
from tokenwire.middleware.shared.replay_redis import RedisReplayStore

async def main(url, stream, key):
    store = RedisReplayStore(url)
    assert await store.open(stream, (key, "digest")) is None
    store.append(ReplayAppend(stream, 1, (b"data: a\\n\\n", b"data: b\\n\\n", b"data: c\\n\\n")))
    got = []
    async for frames in store.read(stream, 0):  # back from Redis: stored
        got += frames
        if len(got) == 3:
            break
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


def _writer_process(url: str, stream: str, key: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", _WRITER, url, stream, key], stdout=subprocess.PIPE)
    assert read_line(process, "writer", 15).strip() == "ready"
    return process


def _kill(process: subprocess.Popen[bytes]) -> float:
    """SIGKILL ``process``; the moment it was reaped."""
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    return time.monotonic()


def test_a_dead_writer_is_known_within_its_lease_and_its_key_taken_over_once(
        loop_thread: LoopThread, redis_url: str) -> None:
    """The store alone: a writer process SIGKILLed after storing three events;
    another store's reader gets them, then WriterGone, within the lease and
    its confirming look; the idempotency key goes to one repeat, and the next
    repeat replays that one (its writer, alive, renews its lease)."""
    writer = _writer_process(redis_url, "s-dead", "k-dead")
    killed_at = _kill(writer)

    async def scenario() -> None:
        store, other = RedisReplayStore(redis_url), RedisReplayStore(redis_url)
        got: list[bytes] = []
        with pytest.raises(WriterGone):
            async for frames in store.read("s-dead", 0):
                got.extend(frames)
        known_s = time.monotonic() - killed_at
        assert got == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"]
        assert known_s <= KNOWN_DEAD_S + 0.3, known_s
        # The repeat takes the key over at once (the lease has lapsed by now) ...
        assert await store.open("s-fresh", ("k-dead", "digest")) is None
        # ... and a second repeat, elsewhere, replays that one: its writer lives.
        asked_at = time.monotonic()
        assert await other.open("s-third", ("k-dead", "digest")) == "s-fresh"
        assert time.monotonic() - asked_at <= RENEW_S + 0.3  # one renewal seen
        store.append(ReplayAppend("s-fresh", 1, (b"data: x\n\n",), end=EndReason.COMPLETE))
        fresh: list[bytes] = []
        async for frames in other.read("s-fresh", 0):
            fresh += frames
        assert fresh == [b"data: x\n\n"]
        await store.aclose()
        await other.aclose()

    loop_thread.run(scenario(), timeout_s=20)


def test_a_live_writer_keeps_its_lease_and_its_stored_end_releases_it(
        loop_thread: LoopThread, redis_url: str) -> None:
    """Renewed while it writes (a lease lost out of its sight is set again
    before a reader gives up), deleted with the end; a stream without the
    lease mark (an older writer's) is never judged by it."""

    async def scenario() -> None:
        writer, reader = RedisReplayStore(redis_url), RedisReplayStore(redis_url)
        raw = writer._redis  # the same server, for a look at the lease itself
        await writer.open("s-live")
        writer.append(ReplayAppend("s-live", 1, (b"data: a\n\n",)))
        got: list[bytes] = []

        async def read() -> None:
            async for frames in reader.read("s-live", 0):
                got.extend(frames)

        task = asyncio.ensure_future(read())
        first = await raw.get(lease_key("s-live"))
        assert first is not None and 0 < await raw.pttl(lease_key("s-live")) <= LEASE_MS
        # Lost without its writer seeing (an eviction): set again within a renewal.
        await raw.delete(lease_key("s-live"))
        done, _ = await asyncio.wait({task}, timeout=KNOWN_DEAD_S + RENEW_S)
        assert not done, task  # the reader waits on: the writer lives
        value = await raw.get(lease_key("s-live"))
        assert value is not None and value != first  # renewed, round by round
        writer.append(ReplayAppend("s-live", 2, (b"data: b\n\n",), end=EndReason.COMPLETE))
        await asyncio.wait_for(task, 5)
        assert got == [b"data: a\n\n", b"data: b\n\n"]
        deadline = time.monotonic() + 2
        while await raw.exists(lease_key("s-live")):  # a renewal on its way may set it once more
            assert time.monotonic() < deadline, "the lease outlived the stored end"
            await asyncio.sleep(0.05)
        # An older writer's stream (no lease mark): live until its TTL, as before.
        await raw.hset("tw:{s-old}:m", mapping={"key": "", "owner": ""})
        await raw.xadd("tw:{s-old}:e", {"f": b"data: o\n\n"}, id="0-1")
        old: list[bytes] = []

        async def read_old() -> None:
            async for frames in reader.read("s-old", 0):
                old.extend(frames)

        task = asyncio.ensure_future(read_old())
        done, _ = await asyncio.wait({task}, timeout=KNOWN_DEAD_S + RENEW_S)
        assert not done and old == [b"data: o\n\n"]
        task.cancel()
        await raw.delete("tw:{s-old}:m", "tw:{s-old}:e", "tw:{s-old}:a")
        await writer.aclose()
        await reader.aclose()

    loop_thread.run(scenario(), timeout_s=30)


@pytest.fixture
def replicas(redis_url: str, upstream: FakeUpstream) -> Iterator[Callable[..., SidecarProcess]]:
    """Sidecars sharing one Redis and one owner secret, default settings otherwise."""
    started: list[SidecarProcess] = []

    def start(*extra: str) -> SidecarProcess:
        process = spawn(["--upstream", upstream.url, "--resume", "--resume-store", redis_url,
                         "--resume-owner-secret", "replicas-share-this", *extra])
        started.append(process)
        return process

    yield start
    for process in started:
        code = process.stop()
        assert code in (0, -signal.SIGKILL), code


def _begin(port: int, headers: dict[str, str], events: int) -> tuple[socket.socket, list[str]]:
    """A slow answer on ``port``, read up to ``events`` events and left open (a
    client still reading when its replica dies); the socket and the ids read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request_bytes("POST", PATH, body=b'{"stream": true}', headers={
        "x-fake-tokens": "400", "x-fake-delay-s": "0.02", **headers}))
    part = read_events(sock, stop_after=events, drop=False)
    assert part.status == 200 and len(part.ids) == events
    return sock, part.ids


def test_a_resume_after_its_replica_was_sigkilled_gets_what_was_stored_then_writer_gone(
        replicas: Callable[..., SidecarProcess], redis_url: str) -> None:
    """Replica A SIGKILLed mid-stream; the client resumes on B at once (from
    event 5, so stored events remain to send): every event A stored, then the
    in-band writer_gone error, within 2 s of the request."""
    import redis

    stored = redis.Redis.from_url(redis_url)
    second = replicas()
    took: list[float] = []
    for run in range(RUNS):
        first = replicas()
        # Killed at another point of its renewal round each run (15 events: 0.3 s).
        sock, ids = _begin(first.port, {"x-request-id": f"killed-{run}"}, events=10 + 15 * run)
        stream_id = ids[0].rpartition(".")[0]
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        sock.close()
        asked_at = time.monotonic()
        rest = resume(second.port, stream_id, ids[4], timeout_s=30)
        took.append(time.monotonic() - asked_at)
        assert rest.status == 200, rest
        numbers = [int(event.id.rpartition(".")[2]) for event in rest.data_events if event.id]
        # Everything A stored before it died, from where the client asked (the
        # client may have had an event or two more: sent before they were stored).
        last_stored = int(stored.xrevrange(f"tw:{{{stream_id}}}:e", count=1)[0][0].rpartition(b"-")[2])
        assert numbers == list(range(6, last_stored + 1)) and last_stored >= 8, (numbers, last_stored)
        error = json.loads(rest.data_events[-1].data or "")["error"]
        assert error["code"] == "writer_gone" and error["tokenwire"]["number"] == "E7317", error
        assert stream_id in error["message"]
        assert took[-1] <= TARGET_S, took
    stored.close()
    print(f"\nresume after SIGKILL: {', '.join(f'{t:.2f}' for t in took)} s; "
          f"median {statistics.median(took):.2f} s")


def test_an_idempotent_repeat_after_its_replica_was_sigkilled_generates_afresh(
        replicas: Callable[..., SidecarProcess], upstream: FakeUpstream) -> None:
    """The same Idempotency-Key sent to B right after A's SIGKILL: a fresh
    generation reaches the engine within 2 s and answers in full."""
    second = replicas()
    took: list[float] = []
    for run in range(RUNS):
        first = replicas()
        key = f"taken-over-{run}"
        sock, _ = _begin(first.port, {"Idempotency-Key": key, "x-request-id": f"takeover-a-{run}"},
                         events=3 + 15 * run)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        sock.close()
        asked_at = time.monotonic()
        # The repeat: the same body and key (a short answer this time, to read in full).
        again = open_stream(second.port, "POST", PATH, body=b'{"stream": true}', timeout_s=30, headers={
            "Idempotency-Key": key, "x-request-id": f"takeover-b-{run}", "x-fake-tokens": "8"})
        fresh = upstream.requests_with(f"takeover-b-{run}")
        assert len(fresh) == 1, fresh  # generated again, once
        took.append(fresh[0].received_at - asked_at)
        assert again.status == 200 and again.clean_end, again
        assert text_of(again.events) == expected_text(8)
        assert took[-1] <= TARGET_S, took
    print(f"\nidempotent takeover after SIGKILL: {', '.join(f'{t:.2f}' for t in took)} s; "
          f"median {statistics.median(took):.2f} s")

