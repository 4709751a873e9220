"""Faults of the Redis resume store that are not an outage, against real
``redis-server`` processes: a wait for a reader longer than redis-py's 5 s
socket timeout, an append refused by an error reply (READONLY from a master
turned replica, OOM past ``maxmemory``) on one server, Sentinel and Cluster,
and what the logs say while the store is out (its password never; "not
resumable" once a while, not once a request)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from clients import chat_body, wait_for
from conftest import RunningSidecar
from redis_topologies import ClusterSetup, SentinelSetup, Server, free_port
from resume_client import open_stream, resume
from test_resume import start_stream, text_of
from tokenwire.middleware import EndReason, ReplayAppend
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from tokenwire.middleware.shared.replay_store import ReplayGap
from tokenwire.middleware.shared.store_outages import LOG_EVERY_S, STORE_OUTAGES
from upstreams import FakeUpstream, expected_text

pytestmark = pytest.mark.slow

RUN = uuid.uuid4().hex[:8]  # this run's stream ids: a Redis kept from another run is no matter
SECRET = "replicas-share-this"
DEADLINE_S = 10.0
_DATA = ["--save", "", "--appendonly", "no"]


async def _until(done: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> float:
    """Poll ``done`` (a question to a server: nothing to wait on instead) until
    true; the seconds it took."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def _frames(first: int, last: int) -> tuple[bytes, ...]:
    return tuple(f"data: event {n}\n\n".encode() for n in range(first, last + 1))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A redis-server of this test's own (it is made READONLY, OOM, or killed)."""
    own = Server(tmp_path / "redis", list(_DATA))
    own.start()
    yield own
    own.stop()


# ------------------------------------------------ a wait past the socket timeout


def test_a_wait_for_a_reader_outlasts_redis_pys_socket_timeout(redis_url: str) -> None:
    # redis-py reads every reply within 5 s (its socket timeout): a BLPOP of
    # the whole grace raised TimeoutError at 5 s, which ended the grace early.
    async def scenario() -> None:
        store = RedisReplayStore(redis_url)
        try:
            stream_id = f"wait-{RUN}"
            await store.open(stream_id)
            store.append(ReplayAppend(stream_id, 1, _frames(1, 1)))
            loop = asyncio.get_running_loop()
            began = loop.time()
            waiter = loop.create_task(store.wait_reader(stream_id, 8.0))
            done, _ = await asyncio.wait({waiter}, timeout=5.8)  # past the 5 s: the point of the test
            assert not done, f"the 8 s wait ended after {loop.time() - began:.2f} s: {waiter.result()}"
            reader = store.read(stream_id, 0)
            attached = loop.time()
            assert await anext(reader) == _frames(1, 1)  # the read attached: the waiter is told
            assert await asyncio.wait_for(waiter, 2.0) is True
            print(f"\nreader attached {attached - began:.2f} s into an 8 s wait, "
                  f"seen {loop.time() - attached:.3f} s later")
            await reader.aclose()
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_a_reconnect_after_the_socket_timeout_keeps_its_generation_past_the_grace(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, redis_url: str) -> None:
    sidecar = start_sidecar(resume=True, resume_store=redis_url, resume_owner_secret=SECRET,
                            resume_grace_s=8.0)
    # Two events, then 8.5 s of silence from the engine (past the grace), then the rest.
    part = open_stream(sidecar.port, "POST", "/silent/v1/chat/completions", body=chat_body(),
                       headers={"x-fake-tokens": "5", "x-fake-silence-s": "8.5",
                                "x-request-id": "grace-8s"}, stop_after=2)
    left_at = time.monotonic()
    connection = upstream.connection_of("grace-8s")
    # The reconnect comes 6 s after the client left: past the socket timeout,
    # inside the grace. Its attach must reach the writer, or the grace's end
    # aborts the generation under the reader's feet.
    while time.monotonic() < left_at + 6.0:
        assert connection.peer_closed_at is None, (
            f"aborted {connection.peer_closed_at - left_at:.2f} s after the client left, in an 8 s grace")
        time.sleep(0.02)
    rest = resume(sidecar.port, part.stream_id, part.ids[-1], timeout_s=15.0)
    assert rest.status == 200 and rest.clean_end, (rest.error, rest.body[-600:])
    assert text_of(part.events) + text_of(rest.events) == expected_text(5)
    assert upstream.requests_with("grace-8s")[0].finished_at is not None  # ran to its end
    assert sidecar.record("grace-8s").end_reason is EndReason.DETACHED
    print(f"\nreconnected {6.0:.1f} s after leaving (grace 8 s), answer complete "
          f"{time.monotonic() - left_at:.2f} s after leaving")


# ------------------------------------------------ appends refused by an error reply


@dataclass(frozen=True)
class Fault:
    """An error reply a node gives every write while it is on."""

    name: str
    on: Callable[[redis.Redis], object]
    off: Callable[[redis.Redis], object]


READONLY = Fault(  # a master turned replica (of a master that is not there: it keeps its data)
    "readonly", lambda node: node.execute_command("REPLICAOF", "127.0.0.1", str(free_port())),
    lambda node: node.execute_command("REPLICAOF", "NO", "ONE"))
OOM = Fault(  # past maxmemory, with Redis's default policy: writes are refused, nothing evicted
    "oom", lambda node: node.config_set("maxmemory-policy", "noeviction") and node.config_set("maxmemory", 1),
    lambda node: node.config_set("maxmemory", 0))


# Sentinel's READONLY is redis-py's ConnectionError (its SentinelManagedConnection)
# and a cluster node takes no REPLICAOF: OOM is the error reply both have.
@pytest.mark.parametrize(("topology", "fault"), [
    ("server", READONLY), ("server", OOM), ("sentinel", OOM), ("cluster", OOM)],
    ids=["server-readonly", "server-oom", "sentinel-oom", "cluster-oom"])
def test_an_append_refused_by_an_error_reply_is_marked_as_a_gap(
        topology: str, fault: Fault, request: pytest.FixtureRequest) -> None:
    stream_id = f"{topology}-{fault.name}-{RUN}"
    events, meta = "tw:{" + stream_id + "}:e", "tw:{" + stream_id + "}:m"
    url, node = _store_and_node(topology, events, request)

    async def scenario() -> None:
        store = RedisReplayStore(url)
        try:
            await store.open(stream_id)
            store.append(ReplayAppend(stream_id, 1, _frames(1, 5)))
            await _until(lambda: node.xlen(events) == 5, "the first five events stored")
            fault.on(node)
            try:
                # The last events and the end, refused: before, the round counted as
                # stored and its writer's lease was let go, so a resume ended with
                # writer_gone (READONLY, OOM) and nothing said events were lost.
                store.append(ReplayAppend(stream_id, 6, _frames(6, 8), end=EndReason.COMPLETE))
                refused_s = await _until(lambda: store.write_errors > 0, "the refused round counted lost")
            finally:
                fault.off(node)
            marked_s = await _until(lambda: node.hget(meta, "gap") is not None, "the gap marked")
            state = node.hgetall(meta)
            assert (state["gap"], state["end"], state["last"]) == ("6", "complete", "8"), state
            assert node.xlen(events) == 5
            read: list[bytes] = []
            with pytest.raises(ReplayGap) as gap:
                async for frames in store.read(stream_id, 0):
                    read.extend(frames)
            assert tuple(read) == _frames(1, 5) and gap.value.seq == 6
            print(f"\n{topology} {fault.name}: refused round counted lost in {refused_s:.3f} s; "
                  f"gap marked {marked_s:.3f} s after the node took writes again")
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_a_discard_refused_by_an_error_reply_lets_its_lease_go(server: Server) -> None:
    # A stream that failed before its first event is discarded (its key freed for
    # a repeat). A round refused by READONLY used to skip letting its lease go:
    # the renewer kept it alive, and a repeat of the key was served the empty
    # stream, heartbeats until the TTL.
    stream_id, key = f"discarded-{RUN}", ("key-" + RUN, "digest")

    async def scenario() -> None:
        node = server.client()
        store, repeat = RedisReplayStore(f"redis://127.0.0.1:{server.port}/0"), None
        try:
            assert await store.open(stream_id, key) is None
            READONLY.on(node)
            try:
                store.append(ReplayAppend(stream_id, 0, (), discard=True))
                await _until(lambda: store.write_errors > 0, "the refused discard counted lost")
            finally:
                READONLY.off(node)
            lease = "tw:{" + stream_id + "}:w"
            lapsed_s = await _until(lambda: node.exists(lease) == 0, "the lease lapsed", timeout_s=5.0)
            repeat = RedisReplayStore(f"redis://127.0.0.1:{server.port}/0")
            assert await repeat.open(f"repeat-{RUN}", key) is None  # the key taken over: generated afresh
            print(f"\nrefused discard: lease gone {lapsed_s:.2f} s after the node took writes again")
        finally:
            await store.aclose()
            if repeat is not None:
                await repeat.aclose()

    asyncio.run(scenario())


def _store_and_node(topology: str, key: str, request: pytest.FixtureRequest) -> tuple[str, redis.Redis]:
    """The store's address in ``topology``, and a client of the node holding ``key``."""
    if topology == "server":
        own: Server = request.getfixturevalue("server")
        return f"redis://127.0.0.1:{own.port}/0", own.client()
    if topology == "sentinel":
        sentinel: SentinelSetup = request.getfixturevalue("sentinel_setup")
        return sentinel.url, sentinel.master.client()
    cluster: ClusterSetup = request.getfixturevalue("cluster_setup")
    return cluster.url, cluster.node_of(key).client()


# ------------------------------------------------ what an outage logs


def test_an_outage_never_logs_the_stores_password(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    password = "s3cret-" + RUN
    own = Server(tmp_path / "redis", [*_DATA, "--user", "user", "on", f">{password}", "~*", "&*", "+@all"])
    own.start()
    try:
        caplog.set_level(logging.DEBUG)
        sidecar = start_sidecar(resume=True, resume_store=f"redis://user:{password}@127.0.0.1:{own.port}/0",
                                resume_owner_secret=SECRET, resume_grace_s=5.0)
        # Left in its grace: the answer goes on into the store, which then dies.
        part = start_stream(sidecar, tokens=300, delay_s=0.01, stop_after=3,
                            headers={"x-request-id": "outage-secret"})
        own.kill()
        for n in range(3):  # each meets the store out: not resumable, and a resume refused
            assert start_stream(sidecar, tokens=2, headers={"x-request-id": f"outage-{n}"}).clean_end
            assert resume(sidecar.port, part.stream_id, part.ids[-1]).status == 503

        def said(words: str) -> list[logging.LogRecord]:
            return [r for r in caplog.records if words in r.getMessage()]

        wait_for(lambda: bool(said("appends lost")), timeout_s=15.0)
        assert f"redis://user:***@127.0.0.1:{own.port}/0" in said("appends lost")[0].getMessage()
        shown = [(r.name, r.getMessage(), caplog.handler.format(r)) for r in caplog.records]
        assert not [line for line in shown if password in " ".join(line)], "the password was logged"
    finally:
        own.stop()


def test_not_resumable_is_logged_once_a_while_with_a_count(
        start_sidecar: Callable[..., RunningSidecar], server: Server, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's one count, on a clock of this test's own, as if nothing had
    # been logged yet; monkeypatch puts all three back, so no later test is affected.
    now = [0.0]
    monkeypatch.setattr(STORE_OUTAGES, "clock", lambda: now[0])
    for last_line in ("_logged_at", "_unresumable_logged_at"):
        monkeypatch.setattr(STORE_OUTAGES, last_line, -LOG_EVERY_S)
    sidecar = start_sidecar(resume=True, resume_store=f"redis://127.0.0.1:{server.port}/0",
                            resume_owner_secret=SECRET)
    server.kill()  # a store that was there, and is out
    before = STORE_OUTAGES.unresumable
    caplog.set_level(logging.WARNING, logger="tokenwire")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "not resumable" in r.getMessage()]

    for n in range(20):
        answer = start_stream(sidecar, tokens=2, headers={"x-request-id": f"unresumable-{n}"})
        assert answer.status == 200 and answer.clean_end  # answered, just not resumable
    assert STORE_OUTAGES.unresumable == before + 20
    assert len(lines()) == 1 and f"(requests so far: {before + 1})" in lines()[0], lines()
    now[0] += LOG_EVERY_S
    assert start_stream(sidecar, tokens=2, headers={"x-request-id": "unresumable-late"}).clean_end
    assert len(lines()) == 2 and f"(requests so far: {before + 21})" in lines()[1], lines()
