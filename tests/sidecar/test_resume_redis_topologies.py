"""Resume on real Redis topologies: Sentinel (a master, a replica, one sentinel)
and a 3-master Cluster, each made of redis-server processes
(``redis_topologies.py``), shared by two real sidecar processes.

In each: a stream resumes exactly on the other replica, an Idempotency-Key
repeat there replays, a cancel by id works from either replica (the Cluster's
across nodes: the claim, the alias and the stream hash to different slots). A
Sentinel failover (the master SIGKILLed mid-stream, the replica promoted) ends
with every resume exact or clearly refused, and the replicas follow the new
master. A store error on the request path is logged (once a while) instead of
a silent 503: a cluster named as one server (each key's slot answers MOVED),
and a cluster with a master down.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clients import chat_body, wait_for
from conftest import LoopThread
from processes import SidecarProcess, spawn
from redis_topologies import ClusterSetup, SentinelSetup
from resume_client import SSEResponse, open_stream, resume
from test_cancel import ALICE, _cancel, _reconnect, _start, _told_cancelled
from test_resume import PATH, seqs, text_of
from test_resume_redis_outage import TOKENS, GatedEngine, _texts
from upstreams import FakeUpstream, expected_text, token

pytestmark = pytest.mark.slow

SECRET = "replicas-share-this"
Topology = SentinelSetup | ClusterSetup


@pytest.fixture(params=["sentinel", "cluster"])
def topology(request: pytest.FixtureRequest) -> Topology:
    setup: Topology = request.getfixturevalue(f"{request.param}_setup")
    return setup


class Replicas:
    """Sidecar processes sharing one store (the owner secret too), stopped at the end."""

    def __init__(self, upstream: FakeUpstream) -> None:
        self.upstream = upstream
        self.started: list[SidecarProcess] = []

    def start(self, store_url: str, *extra: str, upstream_url: str | None = None) -> SidecarProcess:
        process = spawn(["--upstream", upstream_url or self.upstream.url, "--resume", "--resume-store",
                         store_url, "--resume-owner-secret", SECRET, *extra])
        self.started.append(process)
        return process

    def pair(self, store_url: str, *extra: str,
             upstream_url: str | None = None) -> tuple[SidecarProcess, ...]:
        return tuple(self.start(store_url, *extra, upstream_url=upstream_url) for _ in range(2))


def stop_and_read_stderr(process: SidecarProcess) -> str:
    assert process.stop() == 0
    assert process.process.stderr is not None
    return process.process.stderr.read().decode(errors="replace")


@pytest.fixture
def replicas(upstream: FakeUpstream) -> Iterator[Replicas]:
    made = Replicas(upstream)
    yield made
    for process in made.started:
        process.stop()


def test_a_stream_resumes_exactly_on_the_other_replica(
        topology: Topology, replicas: Replicas, upstream: FakeUpstream) -> None:
    # The grace (0.8 s) is shorter than the answer (~2 s): only the attach on the other replica keeps it.
    first, second = replicas.pair(topology.url, "--resume-grace-s", "0.8")
    request_id = f"topology-resume-{type(topology).__name__}"
    part = open_stream(first.port, "POST", PATH, body=b'{"stream": true}', stop_after=7,
                       headers={"x-fake-tokens": "200", "x-fake-delay-s": "0.01", "x-request-id": request_id})
    rest = resume(second.port, part.stream_id, part.ids[-1], timeout_s=20)
    assert rest.status == 200 and rest.clean_end
    assert seqs(part) + seqs(rest) == list(range(1, 205))  # role, 200 tokens, finish, usage, [DONE]
    assert text_of(part.events) + text_of(rest.events) == expected_text(200)
    assert len(upstream.requests_with(request_id)) == 1  # one generation


def test_an_idempotency_key_repeated_on_the_other_replica_replays(
        topology: Topology, replicas: Replicas, upstream: FakeUpstream) -> None:
    first, second = replicas.pair(topology.url)
    name = type(topology).__name__
    for n in range(6):  # keys of several slots (on the cluster, of several nodes)
        headers = {"Idempotency-Key": f"{name}-key-{n}", "x-fake-tokens": "12"}
        one = open_stream(first.port, "POST", PATH, body=b'{"stream": true}',
                          headers={**headers, "x-request-id": f"{name}-idem-a{n}"})
        two = open_stream(second.port, "POST", PATH, body=b'{"stream": true}',
                          headers={**headers, "x-request-id": f"{name}-idem-b{n}"})
        assert one.status == 200 and one.clean_end, one.body
        assert [e.data for e in two.data_events] == [e.data for e in one.data_events], (two.status, two.body)
        assert two.ids == one.ids and text_of(two.events) == expected_text(12)
        assert upstream.requests_with(f"{name}-idem-b{n}") == []
        other = open_stream(second.port, "POST", PATH, body=b'{"stream": true, "x": 1}',
                            headers={**headers, "x-request-id": f"{name}-idem-c{n}"})
        assert other.status == 422


def test_a_cancel_by_id_works_on_either_replica(
        topology: Topology, replicas: Replicas, upstream: FakeUpstream) -> None:
    writer, other = replicas.pair(topology.url, "--resume-grace-s", "10")
    name = type(topology).__name__
    for cancelling in (writer, other):  # the writer itself, then the other over pub/sub
        request_id = f"{name}-cancel-{cancelling.port}"
        part = _start(writer, request_id)
        connection = upstream.connection_of(request_id)
        assert connection.peer_closed_at is None  # generating on, for the grace
        status, body = _cancel(cancelling, part.stream_id)
        assert (status, body) == (200, {"id": part.stream_id, "object": "stream", "status": "cancelled"})
        wait_for(lambda connection=connection: connection.peer_closed_at is not None, timeout_s=5)
        assert _told_cancelled(_reconnect(other, part))
    # An ended idempotent stream is forgotten, its key with it (the stream's keys and
    # its claim deleted: on the cluster, keys of different slots): the key generates again.
    headers = {"Idempotency-Key": f"{name}-ended", "x-fake-tokens": "3", **ALICE}
    done = open_stream(writer.port, "POST", PATH, body=chat_body(),
                       headers={**headers, "x-request-id": f"{name}-ended-1"})
    assert done.clean_end
    # Its end is stored just after the client read it: once a reader is told it ended (204).
    assert _reconnect(other, done).status == 204
    ended = {"id": done.stream_id, "object": "stream", "status": "ended"}
    assert _cancel(other, done.stream_id) == (200, ended)
    again = open_stream(other.port, "POST", PATH, body=chat_body(),
                        headers={**headers, "x-request-id": f"{name}-ended-2"})
    assert again.clean_end and again.stream_id != done.stream_id
    assert len(upstream.requests_with(f"{name}-ended-2")) == 1


def _idempotent(port: int, key: str) -> SSEResponse:
    return open_stream(port, "POST", PATH, body=b'{"stream": true}',
                       headers={"Idempotency-Key": key, "x-fake-tokens": "4"})


def _resume_outcome(port: int, stream_id: str, after: int) -> str:
    """``exact``, or how a resume from event ``after`` was clearly refused; fails
    on a resume with an event missing or repeated."""
    last_id = f"{stream_id}.{after}" if after else None
    got = resume(port, stream_id, last_id, timeout_s=10)
    for _ in range(10):  # as a client does: a store not reachable yet says when to retry
        if got.status != 503:
            break
        time.sleep(float(got.headers["retry-after"]))
        got = resume(port, stream_id, last_id, timeout_s=10)
    if got.status != 200:
        body = json.loads(got.body)
        assert got.status in (404, 410) and body["error"]["code"] in (
            "stream_not_found", "replay_gap", "resume_unavailable"), (got.status, body)
        return str(body["error"]["code"])
    numbers = [int(event.id.rpartition(".")[2]) for event in got.data_events if event.id]
    assert numbers == list(range(after + 1, after + 1 + len(numbers))), numbers  # nothing skipped
    if got.clean_end:
        assert numbers[-1] == TOKENS + 3 and got.data_events[-1].data == "[DONE]"
        return "exact"
    error = json.loads(got.data_events[-1].data or "{}")["error"]
    assert error["code"] in ("replay_gap", "writer_gone"), error
    return str(error["code"])


def test_a_sentinel_failover_mid_stream_ends_every_resume_exact_or_clearly_refused(
        tmp_path: Path, loop_thread: LoopThread, replicas: Replicas, upstream: FakeUpstream) -> None:
    setup = SentinelSetup(tmp_path)
    setup.start()
    engine = GatedEngine(loop_thread, (10, 30))
    loop_thread.run(engine.start())
    try:
        writer, other = replicas.pair(setup.url, upstream_url=f"http://127.0.0.1:{engine.port}")
        # Two more on the fake upstream, for after the failover; in use before it, so
        # their connections and cancel listeners are the old master's.
        fake_writer, fake_other = replicas.pair(setup.url, "--resume-grace-s", "10")
        assert _idempotent(fake_writer.port, "before-failover").ids == \
            _idempotent(fake_other.port, "before-failover").ids

        def failover() -> None:
            engine.wait_reached(10)
            setup.master.kill()  # SIGKILL: what was not replicated yet is lost
            engine.let_go(10)
            engine.wait_reached(30)  # the rest of the answer goes to the promoted replica
            setup.wait_for_the_promotion()
            engine.let_go(30)

        thread = threading.Thread(target=failover, daemon=True)
        thread.start()
        live = open_stream(writer.port, "POST", "/v1/chat/completions", timeout_s=60,
                           body=b'{"stream": true, "messages": []}')
        thread.join(30)
        assert live.status == 200 and live.clean_end  # the live client never noticed
        assert "".join(_texts(live.data_events)) == "".join(token(i) for i in range(TOKENS))
        outcomes = {after: _resume_outcome(other.port, live.stream_id, after) for after in (0, 3, 10, 12, 40)}
        assert outcomes[0] == "replay_gap", outcomes  # events stored before the kill, then the loss said
        assert outcomes[40] == "exact", outcomes  # written to the new master after the promotion
        # The replicas follow the new master: a new stream resumes exactly on the other one...
        part = open_stream(fake_writer.port, "POST", PATH, body=b'{"stream": true}', stop_after=4,
                           headers={"x-fake-tokens": "30", "x-fake-delay-s": "0.002"})
        rest = resume(fake_other.port, part.stream_id, part.ids[-1], timeout_s=20)
        assert rest.status == 200 and rest.clean_end and seqs(part) + seqs(rest) == list(range(1, 35))
        # ...an idempotent repeat replays there...
        assert _idempotent(fake_writer.port, "after-failover").ids == \
            _idempotent(fake_other.port, "after-failover").ids
        # ...and a cancel on the other replica reaches the writer again, once every
        # listener subscribed on the new master (each retries every second).
        subscribers = setup.replica.client()
        wait_for(lambda: subscribers.pubsub_numsub("tw:cancel")[0][1] >= 4, timeout_s=10)
        long = _start(fake_writer, "after-failover-cancel")
        assert _cancel(fake_other, long.stream_id)[1]["status"] == "cancelled"
        logged = stop_and_read_stderr(writer)
        assert "appends lost" in logged, logged[-2000:]
    finally:
        loop_thread.run(engine.stop())
        setup.stop()


def test_a_cluster_named_as_one_server_says_so_in_the_log_instead_of_a_silent_503(
        cluster_setup: ClusterSetup, replicas: Replicas) -> None:
    """The issue's symptom: ``redis://`` of one node of a cluster; each request's
    keys hash to any slot, and another node's slot answers MOVED."""
    sidecar = replicas.start(f"redis://127.0.0.1:{cluster_setup.nodes[0].port}/0")
    answers = [_idempotent(sidecar.port, f"one-server-{n}") for n in range(12)]
    refused = [a for a in answers if a.status == 503]
    assert refused and all(json.loads(a.body)["error"]["code"] == "resume_unavailable" for a in refused)
    logged = stop_and_read_stderr(sidecar)
    lines = [line for line in logged.splitlines() if "resume store unavailable" in line]
    assert len(lines) == 1, logged[-3000:]  # once a while, not per request
    assert "MovedError" in lines[0] and "redis+cluster://" in lines[0], lines[0]


def test_a_cluster_master_down_is_logged_and_refused_then_the_store_comes_back(
        tmp_path: Path, replicas: Replicas) -> None:
    setup = ClusterSetup(tmp_path)
    setup.start()
    try:
        sidecar, other = replicas.pair(setup.url)
        assert _idempotent(sidecar.port, "before").clean_end
        setup.nodes[2].kill()  # a third of the slots gone, no replica: the cluster is down
        survivor = setup.nodes[0].client()
        wait_for(lambda: survivor.cluster("INFO")["cluster_state"] == "fail", timeout_s=20, interval_s=0.05)
        started = time.monotonic()
        refused = _idempotent(sidecar.port, "while-down")
        assert refused.status == 503 and json.loads(refused.body)["error"]["code"] == "resume_unavailable"
        assert time.monotonic() - started < 2, "an outage is answered at once (before the commit deadline)"
        plain = open_stream(sidecar.port, "POST", PATH, body=b'{"stream": true}',
                            headers={"x-fake-tokens": "3"})
        assert plain.status == 200 and plain.clean_end  # an ordinary request is answered, unresumable
        setup.nodes[2].start()  # the same folder: it rejoins with its slots
        wait_for(setup.healthy, timeout_s=30, interval_s=0.05)
        for _ in range(50):  # the clients find the node again on their next tries
            back = _idempotent(sidecar.port, "after")
            if back.status == 200:
                break
            time.sleep(float(back.headers.get("retry-after", "0.2")))
        assert back.status == 200 and back.clean_end
        again = _idempotent(other.port, "after")
        assert again.ids == back.ids  # replayed from the store on the other replica
        logged = stop_and_read_stderr(sidecar)
        assert "resume store unavailable" in logged, logged[-3000:]
    finally:
        setup.stop()
