"""Resume on the Redis Streams store: a real redis-server, and two real sidecar
processes sharing it, so a reconnect that lands on the other replica resumes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import pytest
from conftest import LoopThread, RunningSidecar
from processes import SidecarProcess, spawn
from resume_client import open_stream, resume, resume_through_drops
from test_resume import PATH, seqs, start_stream, text_of
from tokenwire.middleware import EndReason, ReplayAppend
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from tokenwire.middleware.shared.replay_store import KeyReused, ReplayUnavailable, StreamNotFound
from upstreams import FakeUpstream, expected_text

pytestmark = pytest.mark.slow


@pytest.fixture
def replicas(redis_url: str, upstream: FakeUpstream) -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(*extra: str) -> SidecarProcess:
        # Replicas sharing a store share the owner secret (a reconnect is checked against it).
        process = spawn(["--upstream", upstream.url, "--resume", "--resume-store", redis_url,
                         "--resume-owner-secret", "replicas-share-this", *extra])
        started.append(process)
        return process

    yield start
    for process in started:
        assert process.stop() == 0


def test_a_stream_started_on_one_replica_resumes_through_the_other(
        replicas: Callable[..., SidecarProcess], upstream: FakeUpstream) -> None:
    # The grace (0.8 s) is shorter than the answer (~2 s): only an attach keeps it alive.
    first, second = replicas("--resume-grace-s", "0.8"), replicas("--resume-grace-s", "0.8")
    part = open_stream(first.port, "POST", PATH, body=b'{"stream": true}', stop_after=7,
                       headers={"x-fake-tokens": "200", "x-fake-delay-s": "0.01",
                                "x-request-id": "replica-1"})
    rest = resume(second.port, part.stream_id, part.ids[-1])
    assert rest.status == 200 and rest.clean_end
    assert seqs(part) + seqs(rest) == list(range(1, 205))  # role, 200 tokens, finish, usage, [DONE]
    assert text_of(part.events) + text_of(rest.events) == expected_text(200)
    # The reader attached on the other replica within the grace: no abort, one generation.
    assert len(upstream.requests_with("replica-1")) == 1
    assert upstream.requests_with("replica-1")[0].finished_at is not None


def test_a_stream_resumes_on_the_other_replica_only_for_its_caller(
        replicas: Callable[..., SidecarProcess]) -> None:
    first, second = replicas(), replicas()
    owner = {"Authorization": "Bearer sk-alice", "x-fake-tokens": "6"}
    done = open_stream(first.port, "POST", PATH, body=b'{"stream": true}', headers=owner)
    path = f"/v1/streams/{done.stream_id}"
    assert open_stream(second.port, "GET", path, headers=owner).clean_end
    stolen = open_stream(second.port, "GET", path, headers={"Authorization": "Bearer sk-mallory"})
    assert stolen.status == 404 and json.loads(stolen.body)["error"]["code"] == "stream_not_found"
    assert open_stream(second.port, "GET", path).status == 404


def test_a_redis_store_without_an_owner_secret_is_refused(redis_url: str, upstream: FakeUpstream) -> None:
    from tokenwire.middleware import ConfigError

    from tokenwire.tools.cli import load_sidecar_config

    with pytest.raises(ConfigError) as refused:
        load_sidecar_config(["--upstream", upstream.url, "--resume", "--resume-store", redis_url], {})
    assert refused.value.key == "resume_owner_secret"


def test_an_idempotency_key_repeated_on_the_other_replica_replays(
        replicas: Callable[..., SidecarProcess], upstream: FakeUpstream) -> None:
    first, second = replicas(), replicas()
    headers = {"Idempotency-Key": "cross-replica", "x-fake-tokens": "12"}
    one = open_stream(first.port, "POST", PATH, body=b'{"stream": true}',
                      headers={**headers, "x-request-id": "cross-a"})
    two = open_stream(second.port, "POST", PATH, body=b'{"stream": true}',
                      headers={**headers, "x-request-id": "cross-b"})
    assert [e.data for e in two.data_events] == [e.data for e in one.data_events]
    assert two.ids == one.ids and text_of(two.events) == expected_text(12)
    assert upstream.requests_with("cross-b") == []
    other = open_stream(second.port, "POST", PATH, body=b'{"stream": true, "x": 1}',
                        headers={**headers, "x-request-id": "cross-c"})
    assert other.status == 422


def test_random_disconnects_through_redis_give_the_uninterrupted_text(
        start_sidecar: Callable[..., RunningSidecar], redis_url: str) -> None:
    import random

    sidecar = start_sidecar(resume=True, resume_store=redis_url, resume_grace_s=5.0,
                            resume_owner_secret="s")
    rng = random.Random(99)
    for run in range(10):
        response = start_stream(sidecar, tokens=20, delay_s=0.002, stop_after=rng.randint(1, 23),
                                headers={"x-request-id": f"redis-random-{run}"})
        received = resume_through_drops(sidecar.port, response, rng)
        assert [e.id for e in received] == [f"{response.stream_id}.{n}" for n in range(1, 25)]
        assert text_of(received) == expected_text(20)


def test_the_redis_store_contract(loop_thread: LoopThread, redis_url: str) -> None:
    """The store itself: unknown streams, order, end, overflow, keys, attach, TTL."""

    async def scenario() -> None:
        store = RedisReplayStore(redis_url, ttl_s=1.0)
        with pytest.raises(StreamNotFound):
            async for _ in store.read("nope-stream", 0):
                pass
        assert await store.open("s-one", ("k1", "d1")) is None
        assert await store.open("s-two", ("k1", "d1")) == "s-one"
        with pytest.raises(KeyReused):
            await store.open("s-three", ("k1", "other"))
        assert not await store.wait_reader("s-one", 0.05)
        store.append(ReplayAppend("s-one", 1, (b"data: a\n\n", b"data: b\n\n")))
        store.append(ReplayAppend("s-one", 3, (b"data: c\n\n",), end=EndReason.COMPLETE))
        got: list[bytes] = []
        async for frames in store.read("s-one", 1):
            got += frames
        assert got == [b"data: b\n\n", b"data: c\n\n"]
        assert await store.wait_reader("s-one", 0.05)
        # Overflow: what was kept, then ReplayUnavailable.
        await store.open("s-over")
        store.append(ReplayAppend("s-over", 1, (b"data: x\n\n",), overflow=True))
        kept: list[bytes] = []
        with pytest.raises(ReplayUnavailable):
            async for frames in store.read("s-over", 0):
                kept += frames
        assert kept == [b"data: x\n\n"]
        # Discard (failed before its first event) frees the key for a retry.
        await store.open("s-fail", ("k2", "d2"))
        store.append(ReplayAppend("s-fail", 1, (), end=EndReason.UPSTREAM_ERROR, discard=True))
        await asyncio.sleep(0.2)
        assert await store.open("s-retry", ("k2", "d2")) is None
        # TTL: a second after its last append the stream is gone.
        await asyncio.sleep(2.2)
        with pytest.raises(StreamNotFound):
            async for _ in store.read("s-one", 0):
                pass
        await store.aclose()

    loop_thread.run(scenario(), timeout_s=20)


def test_a_redis_outage_loses_resume_but_never_an_answer_or_a_second_generation(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on: every Redis call fails
        probe.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    sidecar = start_sidecar(resume=True, resume_store=dead, resume_owner_secret="s")
    plain = start_stream(sidecar, tokens=5, headers={"x-request-id": "outage-plain"})
    assert plain.status == 200 and plain.clean_end and text_of(plain.events) == expected_text(5)
    again = resume(sidecar.port, plain.stream_id, plain.ids[-2])
    assert again.status == 503 and json.loads(again.body)["error"]["code"] == "resume_unavailable"
    keyed = start_stream(sidecar, tokens=5, headers={"x-request-id": "outage-key", "Idempotency-Key": "k"})
    assert keyed.status == 503 and upstream.requests_with("outage-key") == []
