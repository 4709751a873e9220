"""Four recent wire features as the clients users point at tokenwire see them:
real client libraries against real sidecars on 127.0.0.1 (``recovery_servers.py``).

* ``replay_gap`` (E7316): a stream stored in Redis loses events 40-44 (deleted
  from its Redis stream: what a Redis restarted from an older snapshot, or a
  replica promoted before it had them, no longer holds). A client that resumes
  before them gets the events up to 39, then the in-band ``replay_gap`` error
  event, never a clean end with tokens missing. Rows: a browser ``EventSource``
  (headless Chromium) and the npm ``eventsource`` package, each reading
  ``GET /v1/streams/{id}`` through a link that drops its first connection a
  few events in, so that they resume by themselves with ``Last-Event-ID``;
  openai-python, whose stream is cut the same way and which the application
  resumes by sending its request again with ``Last-Event-ID``.
* ``writer_gone`` (E7317): two sidecar processes share Redis; the one writing
  a stream is SIGKILLed; a resume on the other gets what was stored, then the
  in-band ``writer_gone`` error within the lease and its confirming look (1.7
  s), not heartbeats until ``resume_ttl_s``. Rows: a browser ``EventSource``
  opening the stream on the second replica, openai-python and httpx-sse
  resuming there with ``Last-Event-ID``. And a finding: an ``EventSource``
  that had every stored event when its replica died (reading it there through
  a load balancer) reconnects to the other replica by itself and is answered
  ``410`` before any event, which it cannot read: it goes CLOSED and never
  sees ``writer_gone``.
* Opt-in frames (``Tokenwire-Frames: open,done,summary``): httpx-sse sees
  ``tokenwire.open`` first and ``tokenwire.summary``/``tokenwire.done`` just
  before ``[DONE]``, by their names, over HTTP/1.1 and over HTTP/2 (httpx
  ``http2=True``: prior knowledge, and TLS with ALPN). What the SDKs make of
  them, each beside the same code without the header: they do not ignore the
  named events (Chat Completions has no event names, so they read every
  event's data as a chunk). openai-python's ``create()`` yields them as
  ``ChatCompletionChunk`` objects without ``choices`` (``None``) and its
  ``stream()`` helper accumulates the exact answer; openai-node's ``create()``
  yields them as chunks without ``choices`` (the usual loop's
  ``chunk.choices[0]?.delta?.content`` throws a ``TypeError``) and its
  ``stream()`` helper fails (``chunk.choices is not iterable``); the Vercel AI
  SDK's ``streamText`` gives the exact text but an ``error`` part for each
  frame and finishes with ``finishReason: "error"``.
* ``Tokenwire-Slow-Client-Policy: block`` per request: openai-python reading
  slowly (through a 64 KiB receive buffer, waiting after its first chunk until
  the engine is held) gets every one of 5,000 deltas unmerged, and the engine
  was made to wait; the same reader under ``coalesce`` gets them merged.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import httpx_sse
import openai
import pytest
from chromium import new_page, served_page
from resume_client import read_events, request_bytes
from tokenwire.middleware import EndReason, ErrorCode
from tokenwire.middleware.shared.redis_lease import CONFIRM_S, LEASE_MS

from .recovery_servers import (
    CHAT,
    RecoveryServers,
    SidecarProcess,
    chat_body,
    error_of,
    running_recovery_servers,
)

pytestmark = pytest.mark.timeout(180)

NODE_DIR = Path(__file__).resolve().parent / "node"
TOKENS = 60
GAP = (40, 44)
"""The events the store loses: event n is token n - 2 (event 1 is the role chunk)."""
KNOWN_DEAD_S = LEASE_MS / 1000 + CONFIRM_S
"""The longest a dead writer can look alive: its lease, then the confirming look."""
LOAD_SLACK_S = 1.0
"""What a busy machine may add to a bound measured in wall time."""
FRAMES = {"Tokenwire-Frames": "open,done,summary"}
FRAME_TOKENS = 12
READER_BUFFER_BYTES = 64 * 1024
"""The slow reader's socket receive buffer: Linux would autotune it to megabytes,
where the whole answer fits and the sidecar never sees a slow reader. (Far
smaller, 4 KiB, any httpx reader crawls: the window stays shut between reads.)"""
TIMINGS: dict[str, float] = {}
"""The writer_gone rows' figures, in seconds (printed at the end of the module)."""

PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire recovery</title></head><body>
<script>
// Opens an EventSource on url and lets it do as it does: reconnect by itself
// (with Last-Event-ID) whenever its connection drops, until it gives up
// (CLOSED), reads [DONE], or limitMs pass. Reports what it saw; every
// judgement is the test's.
window.watch = (url, limitMs, names = []) => new Promise((resolve) => {
  const started = performance.now();
  const seen = {messages: [], named: [], errors: [], opens: 0, ended: null, startedAt: Date.now()};
  window.seen = seen;  // for the test to wait on while it runs
  const source = new EventSource(url);
  const finish = (why) => { clearTimeout(late); source.close(); seen.ended = why; resolve(seen); };
  const late = setTimeout(() => finish("timeout"), limitMs);
  source.onopen = () => { seen.opens += 1; };
  // Named events (tokenwire's frames) reach only listeners of their name, in order with the rest.
  for (const name of names) {
    source.addEventListener(name, (event) => {
      seen.named.push({name, data: event.data, at: seen.messages.length});
    });
  }
  source.onmessage = (event) => {
    seen.messages.push({data: event.data, id: event.lastEventId, atMs: performance.now() - started});
    if (event.data === "[DONE]") finish("done");
  };
  source.onerror = () => {
    seen.errors.push({state: source.readyState, atMs: performance.now() - started});
    if (source.readyState === EventSource.CLOSED) finish("closed");
  };
});
</script></body></html>
"""


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """The browser rows' page, from an origin of its own (the sidecars' CORS allows it)."""
    with served_page(PAGE) as origin:
        yield origin


@pytest.fixture(scope="module")
def recovery(redis_url: str, page_origin: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecoveryServers]:
    with running_recovery_servers(redis_url, page_origin, tmp_path_factory.mktemp("tls")) as running:
        yield running
    if TIMINGS:
        print("\nwriter_gone rows: " + ", ".join(
            f"{row} {took:.2f} s" for row, took in sorted(TIMINGS.items())))


@pytest.fixture(scope="module")
def second_replica(recovery: RecoveryServers) -> Iterator[SidecarProcess]:
    """The replica that lives: where the writer_gone rows resume."""
    replica = recovery.replica()
    yield replica
    assert replica.stop() == 0


@pytest.fixture
def first_replica(recovery: RecoveryServers) -> Iterator[SidecarProcess]:
    """The replica the row SIGKILLs while it writes."""
    replica = recovery.replica()
    yield replica
    assert replica.stop() in (0, -signal.SIGKILL)


def _node(cases: list[dict[str, Any]], timeout_s: float = 60) -> dict[str, dict[str, Any]]:
    return _node_outcomes(_node_started(cases), timeout_s)


def _node_started(cases: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """``recovery_cases.mjs`` running ``cases`` (read :func:`_node_outcomes` when done)."""
    node = shutil.which("node")
    if node is None:
        raise AssertionError("no node: run scripts/system-deps.sh nodejs npm")
    for package in ("openai", "eventsource", "ai", "@ai-sdk/openai"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            raise AssertionError(f"the npm package {package} is missing: run scripts/node-deps.sh")
    process = subprocess.Popen([node, str(NODE_DIR / "recovery_cases.mjs")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=NODE_DIR)
    assert process.stdin is not None
    process.stdin.write(json.dumps(cases))
    process.stdin.close()
    process.stdin = None  # written and closed: communicate() has nothing more to send
    return process


def _node_outcomes(process: subprocess.Popen[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, f"node failed: {stderr[-3000:]}"
    outcomes: dict[str, dict[str, Any]] = json.loads(stdout)
    return outcomes


def _seq(event_id: str) -> int:
    return int(event_id.rpartition(".")[2])


def _text_of(datas: list[str]) -> list[str]:
    """The content of each chat chunk (the role chunk's is ``""``)."""
    return [(json.loads(data)["choices"][0]["delta"].get("content") or "") for data in datas]


def _tokens(first_event: int, last_event: int) -> list[str]:
    """What events ``first_event..last_event`` of the fake's answer carry (event 1 is the role chunk)."""
    return ["" if n == 1 else f"t{n - 2} " for n in range(first_event, last_event + 1)]


# ---------------------------------------------------------------- replay_gap


def _gapped_stream(servers: RecoveryServers) -> str:
    """A 60-token answer read whole through the Redis sidecar, then events 40-44
    lost from the store: its stream id."""
    answer = httpx.post(servers.urls["redis"] + CHAT, json=chat_body(), timeout=30,
                        headers={"x-fake-tokens": str(TOKENS)})
    assert answer.status_code == 200 and "\ndata: [DONE]\n" in answer.text, answer.text[-300:]
    stream_id = answer.headers["x-tokenwire-stream-id"]
    assert servers.stored_end(stream_id)["last"] == str(TOKENS + 4)  # role, tokens, finish, usage, [DONE]
    assert servers.lose_events(stream_id, *GAP) == GAP[1] - GAP[0] + 1
    return stream_id


def _assert_replay_gap_seen(stream_id: str, messages: list[dict[str, Any]]) -> None:
    """Every event up to the gap once, in order, then the in-band replay_gap error."""
    datas = [message["data"] for message in messages]
    assert datas, "the client got nothing"
    error = error_of(datas[-1])
    assert error is not None, f"no in-band error at the end: {datas[-3:]}"
    assert error["code"] == "replay_gap" and error["tokenwire"] == {"code": "replay_gap", "number": "E7316"}
    assert f"event {GAP[0]} of stream {stream_id!r}" in error["message"], error
    ids = [_seq(message["id"]) for message in messages[:-1]]
    assert ids == list(range(1, GAP[0])), ids  # nothing twice, nothing skipped, nothing past the gap
    assert _text_of(datas[:-1]) == _tokens(1, GAP[0] - 1)
    assert "[DONE]" not in datas


def _assert_refused_resumes(servers: RecoveryServers, stream_id: str, count: int) -> None:
    """What the sidecar's records say of the client's resumes, one per connection:
    each but the last read to the gap and ended with it in-band (200; the cut
    one too: the sidecar wrote it all before the link cut it), the last was
    refused before any event (410)."""
    records = servers.resume_records(stream_id, count)
    assert len(records) == count, records
    *read, last = records
    assert read and all((r.status, r.error_code) == (200, ErrorCode.REPLAY_GAP) for r in read), read
    assert read[0].events_out == GAP[0], read[0]  # from the start: the 39 events, then the error
    assert (last.status, last.error_code, last.end_reason) == (410, ErrorCode.REPLAY_GAP, EndReason.REFUSED)


@pytest.mark.slow
def test_browser_eventsource_resuming_by_itself_sees_replay_gap_in_band(
        recovery: RecoveryServers, browser: Any) -> None:
    """Chromium's EventSource on ``GET /v1/streams/{id}``: its first connection
    drops a few events in; it reconnects with ``Last-Event-ID`` by itself, reads
    on to the gap and gets the replay_gap error as a ``message`` event. The body
    is then cut; it reconnects once more from event 39, is refused (410) and
    gives up (CLOSED): no retry loop, no clean end."""
    stream_id = _gapped_stream(recovery)
    link_url, link = recovery.cut_link()
    try:
        with new_page(browser) as page:
            page.goto(recovery.page_origin + "/")
            seen = page.evaluate("([url, limit]) => window.watch(url, limit)",
                                 [f"{link_url}/v1/streams/{stream_id}", 30000])
    finally:
        recovery.close_link(link)
    messages = seen["messages"]
    # The in-band error is the last message: what follows it is the browser's own refused reconnect.
    _assert_replay_gap_seen(stream_id, messages)
    assert seen["ended"] == "closed", seen  # it gave up by itself
    states = [error["state"] for error in seen["errors"]]
    assert states[-1] == 2 and all(state == 0 for state in states[:-1]) and len(states) >= 2, states
    assert link.connections >= 3, link.connections  # cut, resumed to the gap, refused
    _assert_refused_resumes(recovery, stream_id, link.connections)


@pytest.mark.slow
def test_npm_eventsource_resuming_by_itself_sees_replay_gap_in_band(recovery: RecoveryServers) -> None:
    """The eventsource package, as the browser: cut, resumed with ``Last-Event-ID``
    by itself up to the gap, the replay_gap error as a message; its reconnect
    after that is refused with 410, which it reports as an error event with
    ``code`` 410 and gives up."""
    stream_id = _gapped_stream(recovery)
    link_url, link = recovery.cut_link()
    try:
        seen = _node([{"id": "gap", "client": "eventsource", "url": f"{link_url}/v1/streams/{stream_id}",
                       "limit_ms": 30000}])["gap"]
    finally:
        recovery.close_link(link)
    _assert_replay_gap_seen(stream_id, seen["messages"])
    assert seen["ended"] == "closed", seen
    last = seen["errors"][-1]
    assert (last["state"], last["code"]) == (2, 410), seen["errors"]
    assert all(error["state"] == 0 for error in seen["errors"][:-1]), seen["errors"]
    assert link.connections >= 3, link.connections
    _assert_refused_resumes(recovery, stream_id, link.connections)


@pytest.mark.slow
def test_openai_python_resuming_with_last_event_id_raises_replay_gap(recovery: RecoveryServers) -> None:
    """openai-python's stream is cut a few chunks in (``APIConnectionError``); the
    sidecar keeps generating it into Redis for the reconnect (its resume grace),
    where events 40-44 are then lost. The application sends its request again
    with ``Last-Event-ID`` (the stream id from the response header, the number
    of chunks it has): the SDK yields the chunks up to the gap, then raises the
    in-band replay_gap error as ``APIError``."""
    link_url, link = recovery.cut_link()
    client = openai.OpenAI(base_url=f"{link_url}/normal/v1", api_key="sk-gap", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "hi"}]
    try:
        stream = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                stream=True, extra_headers={"x-fake-tokens": str(TOKENS)})
        stream_id = stream.response.headers["x-tokenwire-stream-id"]
        first: list[Any] = []
        with pytest.raises(openai.APIConnectionError):
            for piece in stream:
                first.append(piece)
        assert 1 <= len(first) < GAP[0] - 1, len(first)
        assert recovery.stored_end(stream_id)["last"] == str(TOKENS + 4)  # generated on, to the end
        assert recovery.lose_events(stream_id, *GAP) == GAP[1] - GAP[0] + 1
        rest: list[Any] = []
        with pytest.raises(openai.APIError) as raised:
            resumed = client.chat.completions.create(
                model="m", messages=messages, stream=True,  # type: ignore[arg-type]
                extra_headers={"Last-Event-ID": f"{stream_id}.{len(first)}"})
            for piece in resumed:
                rest.append(piece)
    finally:
        recovery.close_link(link)
    error = raised.value
    assert type(error) is openai.APIError, repr(error)  # the in-band event, not a connection error
    assert isinstance(error.body, dict) and error.body["code"] == "replay_gap", error.body
    assert error.body["tokenwire"] == {"code": "replay_gap", "number": "E7316"}
    texts = [piece.choices[0].delta.content or "" for piece in first + rest]
    assert texts == _tokens(1, GAP[0] - 1), texts  # every chunk up to the gap once, then the error


# ---------------------------------------------------------------- writer_gone


def _begin(port: int, headers: dict[str, str], events: int,
           mode: str = "normal") -> tuple[socket.socket, str]:
    """A long answer (400 tokens, 20 ms apart) on ``port``, read up to ``events``
    events and left open: a client still reading when its replica dies."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    path = CHAT.replace("/normal/", f"/{mode}/")
    sock.sendall(request_bytes("POST", path, body=json.dumps(chat_body()).encode(), headers={
        "x-fake-tokens": "400", "x-fake-delay-s": "0.02", **headers}))
    part = read_events(sock, stop_after=events, drop=False)
    assert part.status == 200 and len(part.ids) == events, part
    return sock, part.ids[0].rpartition(".")[0]


STORED_AT_LEAST = 8
"""Of the events a client read before its replica died, the last one or two may
have been sent before they were stored (the store is written behind the wire)."""


def _kill(replica: SidecarProcess) -> None:
    replica.process.send_signal(signal.SIGKILL)
    replica.process.wait(10)


def _last_stored(servers: RecoveryServers, stream_id: str) -> int:
    import redis

    client = redis.Redis.from_url(servers.redis_url)
    try:
        newest = client.xrevrange(f"tw:{{{stream_id}}}:e", count=1)
        return int(newest[0][0].rpartition(b"-")[2])
    finally:
        client.close()


def _assert_writer_gone(error: dict[str, Any] | None, stream_id: str) -> None:
    assert error is not None, "no in-band error"
    assert error["code"] == "writer_gone" and error["tokenwire"] == {"code": "writer_gone", "number": "E7317"}
    assert stream_id in error["message"], error


@pytest.mark.slow
def test_browser_eventsource_on_the_second_replica_sees_writer_gone_in_band(
        recovery: RecoveryServers, first_replica: SidecarProcess, second_replica: SidecarProcess,
        browser: Any) -> None:
    """Replica A SIGKILLed ten events into a stream; Chromium's EventSource opens
    it on replica B: every event A stored, then the writer_gone error as a
    ``message`` event, well within 2 s of opening. (Its reconnect after the cut
    that follows is refused, 410, and it gives up.)"""
    sock, stream_id = _begin(first_replica.port, {}, events=10)
    _kill(first_replica)
    killed_wall = time.time()  # the page's clock is the wall clock
    sock.close()
    with new_page(browser) as page:
        page.goto(recovery.page_origin + "/")
        seen = page.evaluate("([url, limit]) => window.watch(url, limit)",
                             [f"http://127.0.0.1:{second_replica.port}/v1/streams/{stream_id}", 30000])
    messages = seen["messages"]
    assert messages, seen
    _assert_writer_gone(error_of(messages[-1]["data"]), stream_id)
    ids = [_seq(message["id"]) for message in messages[:-1]]
    last = _last_stored(recovery, stream_id)
    assert ids == list(range(1, last + 1)) and last >= STORED_AT_LEAST, (ids, last)  # all A stored, once
    assert _text_of([message["data"] for message in messages[:-1]]) == _tokens(1, last)
    took_s = messages[-1]["atMs"] / 1000
    TIMINGS["chromium-eventsource (open -> error)"] = took_s
    TIMINGS["chromium-eventsource (kill -> error)"] = seen["startedAt"] / 1000 + took_s - killed_wall
    assert took_s <= KNOWN_DEAD_S + LOAD_SLACK_S, took_s
    assert seen["ended"] == "closed" and seen["errors"][-1]["state"] == 2, seen


def _start_watching(page: Any, recovery: RecoveryServers, url: str, limit_ms: int, *, read: int,
                    timeout_ms: int = 10000) -> None:
    """The page's EventSource on ``url`` (``window.watching`` resolves to what it
    saw), once it has read ``read`` messages."""
    page.goto(recovery.page_origin + "/")
    page.evaluate("([url, limit]) => { window.watching = window.watch(url, limit); }", [url, limit_ms])
    page.wait_for_function(f"() => window.seen && window.seen.messages.length >= {read}", timeout=timeout_ms)


@pytest.mark.slow
def test_browser_eventsource_caught_up_when_its_replica_dies_is_refused_without_writer_gone(
        recovery: RecoveryServers, first_replica: SidecarProcess, second_replica: SidecarProcess,
        browser: Any) -> None:
    """What a browser reading a live stream sees when its replica dies, the
    common case: Chromium's EventSource reads ``GET /v1/streams/{id}`` through a
    load balancer (a relay to the first replica that accepts) from replica A,
    and has every event A stored (the engine is silent, between its second and
    third event) when A is SIGKILLed. It reconnects by itself with
    ``Last-Event-ID``, lands on replica B, and B, with nothing stored after that
    id, answers ``410`` with the writer_gone error as its body, before any
    event: an EventSource cannot read a non-200 answer, so it only goes CLOSED.
    It never sees writer_gone (a finding: the in-band error reaches only a
    reader behind the store). Asserted as it is; the same GET by httpx shows
    what the browser was refused with."""
    sock, stream_id = _begin(first_replica.port, {"x-fake-silence-s": "60"}, events=2, mode="silent")
    link_url, link = recovery.failover_link([first_replica.port, second_replica.port])
    try:
        with new_page(browser) as page:
            _start_watching(page, recovery, f"{link_url}/v1/streams/{stream_id}", 30000, read=2)
            assert _last_stored(recovery, stream_id) == 2  # caught up: it has all there is
            _kill(first_replica)
            killed_at = time.monotonic()
            seen = page.evaluate("() => window.watching")
            closed_s = time.monotonic() - killed_at
    finally:
        recovery.close_link(link)
        sock.close()
    assert link.landed == [first_replica.port, second_replica.port], link.landed  # reconnected to B
    assert [_seq(message["id"]) for message in seen["messages"]] == [1, 2], seen["messages"]
    assert all(error_of(message["data"]) is None for message in seen["messages"])  # no writer_gone
    assert [error["state"] for error in seen["errors"]] == [0, 2] and seen["ended"] == "closed", seen
    TIMINGS["chromium-eventsource-caught-up (kill -> CLOSED)"] = closed_s
    assert closed_s <= KNOWN_DEAD_S + 1.0 + LOAD_SLACK_S, closed_s  # its retry: 1 s (resume_retry_ms)
    refused = httpx.get(f"http://127.0.0.1:{second_replica.port}/v1/streams/{stream_id}", timeout=10,
                        headers={"Last-Event-ID": f"{stream_id}.2"})
    assert refused.status_code == 410, refused.text
    _assert_writer_gone(refused.json()["error"], stream_id)


@pytest.mark.slow
def test_browser_eventsource_reading_a_draining_replica_is_handed_to_the_other_and_reads_it_all(
        recovery: RecoveryServers, second_replica: SidecarProcess, browser: Any) -> None:
    """A rolling restart as a browser sees it: Chromium's EventSource reads
    ``GET /v1/streams/{id}`` through a load balancer (a relay to the first
    replica that accepts) from replica A while A's engine generates; A gets
    SIGTERM. Its drain closes the reader after an event, without the terminal
    event, and keeps generating into the store; the EventSource reconnects by
    itself with ``Last-Event-ID``, lands on replica B, and reads the rest from
    the store to ``[DONE]``: every event once, in order, one engine request."""
    draining = recovery.replica("--drain-s", "30")
    request_id = uuid.uuid4().hex
    sock, stream_id = _begin(draining.port, {"x-request-id": request_id}, events=2)
    link_url, link = recovery.failover_link([draining.port, second_replica.port])
    try:
        with new_page(browser) as page:
            _start_watching(page, recovery, f"{link_url}/v1/streams/{stream_id}", 60000, read=20,
                            timeout_ms=15000)
            draining.signal(signal.SIGTERM)
            seen = page.evaluate("() => window.watching")
    finally:
        recovery.close_link(link)
        sock.close()
        exited = _drained(draining)
    _assert_handed_off(recovery, seen, link.landed, [draining.port, second_replica.port], request_id)
    assert exited == 0


@pytest.mark.slow
def test_npm_eventsource_reading_a_draining_replica_is_handed_to_the_other_and_reads_it_all(
        recovery: RecoveryServers, second_replica: SidecarProcess) -> None:
    """The eventsource package, as the browser above: SIGTERM to its replica once
    it reads (the store holds 20 events of the answer), then the rest read on
    the other replica after its own reconnect, every event once."""
    draining = recovery.replica("--drain-s", "30")
    request_id = uuid.uuid4().hex
    sock, stream_id = _begin(draining.port, {"x-request-id": request_id}, events=2)
    link_url, link = recovery.failover_link([draining.port, second_replica.port])
    try:
        node = _node_started([{"id": "handoff", "client": "eventsource",
                               "url": f"{link_url}/v1/streams/{stream_id}", "limit_ms": 60000}])
        deadline = time.monotonic() + 15
        # The reader is answered (its head and events came back through the link: a
        # SIGTERM before the replica has its request closes that connection as idle,
        # and the reader's first open is on the other replica), and the store is ahead.
        while not (link.answered_bytes > 1024 and _last_stored(recovery, stream_id) >= 20):  # polled
            assert time.monotonic() < deadline and node.poll() is None, "the reader never got going"
            time.sleep(0.02)
        draining.signal(signal.SIGTERM)
        seen = _node_outcomes(node, 60)["handoff"]
    finally:
        recovery.close_link(link)
        sock.close()
        exited = _drained(draining)
    _assert_handed_off(recovery, seen, link.landed, [draining.port, second_replica.port], request_id)
    assert exited == 0


def _drained(replica: SidecarProcess) -> int | None:
    """How the draining replica exited once its streams ended (its answer done,
    it leaves by itself: a second SIGTERM would cut its drain short)."""
    try:
        return replica.process.wait(15)
    except subprocess.TimeoutExpired:
        return None  # still draining: stop() below ends it, and the test says so
    finally:
        replica.stop()


def _assert_handed_off(recovery: RecoveryServers, seen: dict[str, Any], landed: list[int],
                       replicas: list[int], request_id: str) -> None:
    """The whole answer read across the two replicas: every event once, in order,
    to ``[DONE]``, after one reconnect, from one engine request."""
    assert seen["ended"] == "done", seen
    # Opened on A, then reopened by itself once, on B (undici may open a spare
    # connection to B beside it: connections are not reconnects).
    first, *then = landed
    assert seen["opens"] == 2 and first == replicas[0] and set(then) == {replicas[1]}, (seen, landed)
    messages = seen["messages"]
    assert [_seq(message["id"]) for message in messages] == list(range(1, len(messages) + 1))
    assert _text_of([message["data"] for message in messages[:401]]) == _tokens(1, 401)  # role, 400 tokens
    assert messages[-1]["data"] == "[DONE]" and all(error_of(m["data"]) is None for m in messages)
    assert [error["state"] for error in seen["errors"]] == [0], seen["errors"]  # one reconnect, no give-up
    assert len(recovery.upstream.requests_with(request_id)) == 1  # generated once


@pytest.mark.slow
def test_openai_python_resuming_on_the_second_replica_raises_writer_gone(
        recovery: RecoveryServers, first_replica: SidecarProcess, second_replica: SidecarProcess) -> None:
    """openai-python reads ten chunks from replica A, which is SIGKILLed: its loop
    raises ``APIConnectionError``. The application sends the request again to
    replica B with ``Last-Event-ID`` (from its fifth chunk): the chunks A stored
    after it, then ``APIError`` carrying writer_gone, within 2 s."""
    messages = [{"role": "user", "content": "hi"}]
    client_a = openai.OpenAI(base_url=f"http://127.0.0.1:{first_replica.port}/normal/v1", api_key="sk-gone",
                             max_retries=0, timeout=30)
    stream = client_a.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                              stream=True, extra_headers={"x-fake-tokens": "400",
                                                                          "x-fake-delay-s": "0.02"})
    stream_id = stream.response.headers["x-tokenwire-stream-id"]
    first: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        for piece in stream:
            first.append(piece)
            if len(first) == 10:
                _kill(first_replica)
                killed_at = time.monotonic()
    client_b = openai.OpenAI(base_url=f"http://127.0.0.1:{second_replica.port}/normal/v1", api_key="sk-gone",
                             max_retries=0, timeout=30)
    rest: list[Any] = []
    asked_at = time.monotonic()
    with pytest.raises(openai.APIError) as raised:
        resumed = client_b.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                   stream=True,
                                                   extra_headers={"Last-Event-ID": f"{stream_id}.5"})
        for piece in resumed:
            rest.append(piece)
    took_s = time.monotonic() - asked_at
    TIMINGS["openai-python (request -> error)"] = took_s
    TIMINGS["openai-python (kill -> error)"] = time.monotonic() - killed_at
    error = raised.value
    assert type(error) is openai.APIError, repr(error)
    assert isinstance(error.body, dict)
    _assert_writer_gone(error.body, stream_id)
    last = _last_stored(recovery, stream_id)
    assert last >= STORED_AT_LEAST and [piece.choices[0].delta.content for piece in rest] == _tokens(6, last)
    assert took_s <= KNOWN_DEAD_S + LOAD_SLACK_S, took_s


@pytest.mark.slow
def test_httpx_sse_resuming_on_the_second_replica_reads_writer_gone(
        recovery: RecoveryServers, first_replica: SidecarProcess, second_replica: SidecarProcess) -> None:
    """httpx-sse's ``connect_sse`` on replica B's ``GET /v1/streams/{id}`` with
    ``Last-Event-ID`` after replica A's SIGKILL: the stored events (with their
    ids), then the writer_gone error event; the body is then cut
    (``RemoteProtocolError``), as after any in-band error over HTTP/1.1."""
    sock, stream_id = _begin(first_replica.port, {}, events=12)
    _kill(first_replica)
    killed_at = time.monotonic()
    sock.close()
    events: list[httpx_sse.ServerSentEvent] = []
    asked_at = time.monotonic()
    error_at = None
    with (httpx.Client(timeout=30) as client, pytest.raises(httpx.RemoteProtocolError),
          httpx_sse.connect_sse(client, "GET", f"http://127.0.0.1:{second_replica.port}/v1/streams/{stream_id}",
                                headers={"Last-Event-ID": f"{stream_id}.3"}) as source):
        assert source.response.status_code == 200
        for event in source.iter_sse():
            events.append(event)
            if error_of(event.data) is not None:
                error_at = time.monotonic()
    assert error_at is not None, [event.data for event in events]
    took_s = error_at - asked_at
    TIMINGS["httpx-sse (request -> error)"] = took_s
    TIMINGS["httpx-sse (kill -> error)"] = error_at - killed_at
    _assert_writer_gone(error_of(events[-1].data), stream_id)
    last = _last_stored(recovery, stream_id)
    assert [_seq(event.id) for event in events[:-1]] == list(range(4, last + 1)) and last >= STORED_AT_LEAST
    assert _text_of([event.data for event in events[:-1]]) == _tokens(4, last)
    assert took_s <= KNOWN_DEAD_S + LOAD_SLACK_S, took_s


# ---------------------------------------------------------------- opt-in frames


def _frames_headers(request_id: str) -> dict[str, str]:
    return {**FRAMES, "x-fake-tokens": str(FRAME_TOKENS), "x-request-id": request_id}


def _read_frames(client: httpx.Client, url: str, request_id: str) -> tuple[httpx.Response, list[Any]]:
    with httpx_sse.connect_sse(client, "POST", url + CHAT, json=chat_body(),
                               headers=_frames_headers(request_id)) as source:
        events = list(source.iter_sse())
    return source.response, events


def _assert_frames(response: httpx.Response, events: list[Any]) -> None:
    """``tokenwire.open`` first, the answer's own events unnamed, ``tokenwire.summary``
    and ``tokenwire.done`` just before ``[DONE]``."""
    names = [event.event for event in events]
    answer = 1 + FRAME_TOKENS + 2  # the role chunk, the tokens, the finish, the usage
    assert names == ["tokenwire.open", *["message"] * answer, "tokenwire.summary", "tokenwire.done",
                     "message"], names
    assert events[-1].data == "[DONE]"
    opened = json.loads(events[0].data)
    assert opened == {"stream_id": response.headers["x-tokenwire-stream-id"], "resumed": False,
                      "start_index": 1, "policy": "coalesce", "buffer_bytes": 1 << 20}, opened
    assert "".join(_text_of([event.data for event in events[1:1 + answer]])) == "".join(
        _tokens(1, FRAME_TOKENS + 1))
    summary, done = json.loads(events[-3].data), json.loads(events[-2].data)
    assert summary["tokens"] == FRAME_TOKENS and summary["tokens_source"] == "usage", summary
    assert (done["end_reason"], done["tokens"], done["delivered_from"]) == ("complete", FRAME_TOKENS, 1), done
    assert (done["coalesced"], done["dropped"], done["producer_wait_s"]) == (0, 0, 0), done


@pytest.mark.slow
def test_browser_eventsource_asks_for_the_frames_by_query(recovery: RecoveryServers, browser: Any) -> None:
    """An EventSource can set no header: ``?tokenwire_frames=open,done`` on its
    ``GET /v1/streams/{id}`` asks for them. It reads ``tokenwire.open`` (a
    resume, from event 1) before the stored answer and ``tokenwire.done``
    just before ``[DONE]``, each through a listener of its name; the answer's
    own messages are the stored ones, exact."""
    answer = httpx.post(recovery.urls["redis"] + CHAT, json=chat_body(), timeout=30,
                        headers={"x-fake-tokens": str(FRAME_TOKENS)})
    assert answer.status_code == 200 and "\ndata: [DONE]\n" in answer.text, answer.text[-300:]
    stream_id = answer.headers["x-tokenwire-stream-id"]
    with new_page(browser) as page:
        page.goto(recovery.page_origin + "/")
        seen = page.evaluate(
            "([url, limit, names]) => window.watch(url, limit, names)",
            [f"{recovery.urls['redis']}/v1/streams/{stream_id}?tokenwire_frames=open,done", 30000,
             ["tokenwire.open", "tokenwire.done"]])
    assert seen["ended"] == "done", seen
    messages = seen["messages"]
    named = [(frame["name"], frame["at"]) for frame in seen["named"]]
    assert named == [("tokenwire.open", 0), ("tokenwire.done", len(messages) - 1)], named
    opened = json.loads(seen["named"][0]["data"])
    assert (opened["stream_id"], opened["resumed"], opened["start_index"]) == (stream_id, True, 1), opened
    done = json.loads(seen["named"][1]["data"])
    assert (done["end_reason"], done["delivered_from"]) == ("complete", 1), done
    datas = [message["data"] for message in messages]
    assert datas[-1] == "[DONE]" and _text_of(datas[:FRAME_TOKENS + 1]) == _tokens(1, FRAME_TOKENS + 1)
    assert [_seq(message["id"]) for message in messages] == list(range(1, len(messages) + 1))


def test_httpx_sse_sees_the_frames_by_their_names(recovery: RecoveryServers) -> None:
    request_id = uuid.uuid4().hex
    with httpx.Client(timeout=30) as client:
        response, events = _read_frames(client, recovery.urls["redis"], request_id)
    assert response.http_version == "HTTP/1.1"
    _assert_frames(response, events)
    assert recovery.record(request_id).end_reason is EndReason.COMPLETE


@pytest.mark.parametrize("transport", ["h2c", "h2-tls"])
def test_httpx_http2_gets_the_same_frames(transport: str, recovery: RecoveryServers) -> None:
    """httpx ``http2=True`` to the sidecar's HTTP/2: with prior knowledge on the
    plain port, and negotiated by ALPN on the TLS one."""
    request_id = uuid.uuid4().hex
    if transport == "h2c":
        client = httpx.Client(http1=False, http2=True, timeout=30)
        url = recovery.urls["redis"]
    else:
        client = httpx.Client(http2=True, timeout=30,
                              verify=ssl.create_default_context(cafile=recovery.tls_files["ca"]))
        url = recovery.urls["tls"]
    with client:
        response, events = _read_frames(client, url, request_id)
    assert response.http_version == "HTTP/2"
    _assert_frames(response, events)
    assert recovery.extras[recovery.record(request_id).request_id]["http_version"] == "2"


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "no-frames"])
def test_openai_python_create_hands_the_frames_over_as_chunks_without_choices(
        frames: bool, recovery: RecoveryServers) -> None:
    """``chat.completions.create(stream=True)`` does not skip a named event it
    does not know: each frame comes out of the loop as a ``ChatCompletionChunk``
    whose ``choices`` is ``None`` (the frame's fields as extras). Code that
    guards ``if chunk.choices`` (as it must for a usage chunk) gets the exact
    answer; code that indexes ``chunk.choices[0]`` raises ``TypeError`` on the
    very first chunk. Without the header: no such chunk."""
    client = openai.OpenAI(base_url=recovery.urls["redis"] + "/normal/v1", api_key="sk-frames",
                           max_retries=0, timeout=30)
    headers = _frames_headers(uuid.uuid4().hex) if frames else {"x-fake-tokens": str(FRAME_TOKENS)}
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_headers=headers)
    chunks = list(stream)
    without = [i for i, piece in enumerate(chunks) if piece.choices is None]
    text = "".join(piece.choices[0].delta.content or "" for piece in chunks if piece.choices)
    assert text == "".join(_tokens(1, FRAME_TOKENS + 1))
    if not frames:
        assert without == [] and len(chunks) == FRAME_TOKENS + 3
        return
    assert without == [0, len(chunks) - 2, len(chunks) - 1], without  # open; summary and done
    extras = [piece.model_extra or {} for piece in (chunks[i] for i in without)]
    assert extras[0]["stream_id"] == stream.response.headers["x-tokenwire-stream-id"]
    assert extras[1]["tokens"] == FRAME_TOKENS and extras[2]["end_reason"] == "complete", extras
    with pytest.raises(TypeError, match="not subscriptable"):
        "".join(piece.choices[0].delta.content or "" for piece in chunks)  # the unguarded loop


def test_openai_python_stream_helper_accumulates_the_exact_answer_with_frames(
        recovery: RecoveryServers) -> None:
    """``chat.completions.stream()``: the frames pass through its accumulator
    without harm; the final completion is the exact answer."""
    client = openai.OpenAI(base_url=recovery.urls["redis"] + "/normal/v1", api_key="sk-frames",
                           max_retries=0, timeout=30)
    deltas: list[str] = []
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}],
                                        extra_headers=_frames_headers(uuid.uuid4().hex)) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == "".join(_tokens(1, FRAME_TOKENS + 1))
    assert final.choices[0].finish_reason == "stop"


NODE_FRAME_CLIENTS = ("openai-node-create", "openai-node-stream", "ai-sdk-chat")


@pytest.fixture(scope="module")
def node_frames(recovery: RecoveryServers) -> dict[str, dict[str, Any]]:
    """Every Node client, with and without the frames, in one ``node`` process."""
    cases = []
    for client in NODE_FRAME_CLIENTS:
        for frames in (True, False):
            headers = {"x-fake-tokens": str(FRAME_TOKENS), **(FRAMES if frames else {})}
            cases.append({"id": f"{client}/{'frames' if frames else 'no-frames'}", "client": client,
                          "base_url": recovery.urls["redis"] + "/normal/v1", "headers": headers})
    return _node(cases)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "no-frames"])
def test_openai_node_create_hands_the_frames_over_and_the_usual_loop_throws(
        frames: bool, node_frames: dict[str, dict[str, Any]]) -> None:
    """openai-node's ``create({stream: true})`` yields every frame as a chunk (its
    data, no ``choices``): the usual loop's ``chunk.choices[0]?.delta?.content``
    throws ``TypeError`` on the first one. Without the header it reads the answer."""
    seen = node_frames[f"openai-node-create/{'frames' if frames else 'no-frames'}"]
    assert seen["error"] is None, seen["error"]
    chunks = seen["chunks"]
    with_choices = [piece for piece in chunks if "choices" in piece]
    assert "".join(piece["choices"][0]["delta"].get("content") or "" for piece in with_choices) == "".join(
        _tokens(1, FRAME_TOKENS + 1))
    if not frames:
        assert len(chunks) == len(with_choices) == FRAME_TOKENS + 3
        assert seen["usual_error"] is None and seen["usual_text"] == "".join(_tokens(1, FRAME_TOKENS + 1))
        return
    without = [piece for piece in chunks if "choices" not in piece]
    assert chunks[0] == without[0] and without[0]["resumed"] is False and "stream_id" in without[0]
    assert len(without) == 3 and "ttft_s" in without[1] and without[2]["end_reason"] == "complete", without
    assert seen["usual_error"]["kind"] == "TypeError", seen
    assert "reading '0'" in seen["usual_error"]["message"], seen["usual_error"]
    assert seen["usual_text"] == ""  # it threw on the open frame, before any text


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "no-frames"])
def test_openai_node_stream_helper_fails_on_the_frames(frames: bool,
                                                       node_frames: dict[str, dict[str, Any]]) -> None:
    """openai-node's ``chat.completions.stream()`` accumulates each chunk's
    ``choices``: on the open frame it fails (``OpenAIError: chunk.choices is
    not iterable``) before any text, where without the header it gives the
    exact final completion. A finding: the frames break this helper."""
    seen = node_frames[f"openai-node-stream/{'frames' if frames else 'no-frames'}"]
    if not frames:
        assert seen["error"] is None, seen["error"]
        assert seen["final"] == {"content": "".join(_tokens(1, FRAME_TOKENS + 1)), "finish_reason": "stop"}
        return
    assert seen["final"] is None and seen["text"] == "", seen
    assert seen["error"]["kind"] == "OpenAIError", seen["error"]
    assert seen["error"]["message"] == "chunk.choices is not iterable", seen["error"]


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "no-frames"])
def test_ai_sdk_streamtext_gets_the_text_but_an_error_part_per_frame(
        frames: bool, node_frames: dict[str, dict[str, Any]]) -> None:
    """The Vercel AI SDK (``streamText``, ``@ai-sdk/openai``'s ``openai.chat()``)
    validates every event's data against its chunk schema, names ignored: each
    frame is an ``error`` part (``AI_TypeValidationError``, the frame as its
    value), the text is still exact, and the stream finishes with
    ``finishReason: "error"`` (the done frame comes after the finish chunk),
    where without the header it is ``stop`` with no error part. A finding."""
    seen = node_frames[f"ai-sdk-chat/{'frames' if frames else 'no-frames'}"]
    assert seen["error"] is None, seen["error"]
    assert seen["text"] == "".join(_tokens(1, FRAME_TOKENS + 1))
    if not frames:
        assert seen["errors"] == [] and seen["finish"]["reason"] == "stop", seen
        return
    assert [error["name"] for error in seen["errors"]] == ["AI_TypeValidationError"] * 3, seen["errors"]
    values = [error["value"] for error in seen["errors"]]
    assert "stream_id" in values[0] and values[1]["tokens"] == FRAME_TOKENS, values
    assert values[2]["end_reason"] == "complete", values
    assert seen["finish"]["reason"] == "error", seen["finish"]
    parts = seen["parts"]
    assert parts.index("error") < parts.index("text-delta") and parts[-1] == "finish", parts


# ---------------------------------------------------------------- block per request


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["block", "coalesce"])
def test_openai_python_reading_slowly_under_block_gets_every_event_unmerged(
        policy: str, recovery: RecoveryServers) -> None:
    """openai-python with ``Tokenwire-Slow-Client-Policy`` asked per request,
    reading through a 64 KiB receive buffer and waiting after its first chunk
    until the engine is held (or wrote its whole answer): under ``block`` every
    one of 5,000 deltas comes as its own chunk, exact, and the engine was made
    to wait as long as the record says; under ``coalesce`` the same reader gets
    them merged (and the engine never waits)."""
    burst = recovery.burst
    burst.reset()
    request_id = uuid.uuid4().hex
    small_buffer = (socket.SOL_SOCKET, socket.SO_RCVBUF, READER_BUFFER_BYTES)
    transport = httpx2.HTTPTransport(socket_options=[small_buffer])
    with httpx2.Client(transport=transport, timeout=60) as http_client:
        client = openai.OpenAI(base_url=recovery.urls["block"] + "/v1", api_key="sk-slow", max_retries=0,
                               http_client=http_client)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_headers={"Tokenwire-Slow-Client-Policy": policy, "x-request-id": request_id})
        chunks = []
        for piece in stream:
            chunks.append(piece)
            if len(chunks) == 1:
                assert burst.wait_held_or_finished(30), "the engine was neither held nor done"
    record = recovery.record(request_id)
    assert record.end_reason is EndReason.COMPLETE, record
    assert recovery.extras[request_id]["client_settings"] == f"slow_client_policy={policy}"
    text = burst.text()
    contents = [piece.choices[0].delta.content for piece in chunks[1:-1]]
    assert "".join(contents) == "".join(text)
    assert chunks[-1].choices[0].finish_reason == "stop"
    if policy == "block":
        assert contents == text  # every delta its own chunk, in order
        assert record.coalesced_events == 0 and record.events_out == len(text) + 3, record
        assert burst.held.is_set() and record.producer_wait_s > 0.1, record
    else:
        assert len(contents) < len(text) and record.coalesced_events > 0, record
        assert record.producer_wait_s == 0.0, record
