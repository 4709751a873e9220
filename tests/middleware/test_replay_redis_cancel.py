"""Cancel by id on the Redis store: a real ``redis-server``, the two store calls
a cancel makes (``end_reason``, ``discard``), and a real sidecar sharing it
(``resume_store="redis://..."``) answering ``DELETE /v1/streams/{id}`` over
real sockets, for a live stream it writes and for one that already ended."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from resume_client import SSEResponse, open_stream
from tokenwire.middleware import EndReason, ReplayAppend, StreamRecord
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from tokenwire.middleware.shared.replay_store import StreamNotFound
from tokenwire.sidecar import Sidecar, SidecarConfig, StreamLog
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

pytestmark = pytest.mark.slow

T = TypeVar("T")
RUN = uuid.uuid4().hex[:8]  # this run's stream ids: a Redis kept from another run is no matter
DEADLINE_S = 5.0
ALICE = {"Authorization": "Bearer sk-alice"}
MALLORY = {"Authorization": "Bearer sk-mallory"}
PATH = "/normal/v1/chat/completions"
BODY = b'{"model": "fake", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'


def _sidecar_upstreams() -> Any:
    """tests/sidecar/upstreams.py (the fake engine that notes when the sidecar
    closed each connection), loaded by path: that folder is not this one's."""
    name = "_tokenwire_sidecar_upstreams"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "sidecar" / "upstreams.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


async def _until(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str) -> T:
    """Poll ``probe()`` until ``done`` says so (the store's writes are queued)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = await probe()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: still {value!r} after {DEADLINE_S} s"
        await asyncio.sleep(0.005)


async def _first_frames(store: RedisReplayStore, stream_id: str) -> tuple[bytes, ...]:
    async for frames in store.read(stream_id, 0):
        return frames
    raise AssertionError(f"{stream_id} ended with no frames")


# ------------------------------------------------------------------ the store


def test_end_reason_is_none_while_live_or_unknown_and_the_reason_once_the_end_is_stored(
        redis_url: str) -> None:
    async def scenario() -> None:
        store = RedisReplayStore(redis_url)
        try:
            for number, reason in enumerate((EndReason.CANCELLED, EndReason.COMPLETE)):
                stream_id = f"end-{number}-{RUN}"
                assert await store.end_reason(stream_id) is None  # unknown
                await store.open(stream_id, owner="alice")
                assert await store.end_reason(stream_id) is None  # open, nothing written
                store.append(ReplayAppend(stream_id, 1, (b"id: 1\ndata: a\n\n",)))
                assert await _first_frames(store, stream_id) == (b"id: 1\ndata: a\n\n",)
                assert await store.end_reason(stream_id) is None  # live: frames, no end
                store.append(ReplayAppend(stream_id, 2, (b"id: 2\ndata: b\n\n",), end=reason))
                assert await _until(lambda stream_id=stream_id: store.end_reason(stream_id),
                                    lambda found: found is not None, "the end") is reason
            assert await store.end_reason(f"never-{RUN}") is None
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_discard_forgets_an_ended_stream_and_frees_its_idempotency_key(redis_url: str) -> None:
    async def scenario() -> None:
        store = RedisReplayStore(redis_url)
        try:
            stream_id, key = f"gone-{RUN}", f"key-{RUN}"
            assert await store.open(stream_id, (key, "digest"), owner="alice") is None
            store.append(ReplayAppend(stream_id, 1, (b"id: 1\ndata: a\n\n",), end=EndReason.COMPLETE))
            await _until(lambda: store.end_reason(stream_id), lambda found: found is not None, "the end")
            # Before: the same key and body is the stream itself.
            assert await store.open(f"again-{RUN}", (key, "digest"), owner="alice") == stream_id

            await store.discard(stream_id)
            await _until(lambda: store.owner(stream_id), lambda owner: owner is None, "the owner")
            assert await store.end_reason(stream_id) is None
            with pytest.raises(StreamNotFound):
                await _first_frames(store, stream_id)
            # After: the key names nothing, so the same request generates anew.
            assert await store.open(f"fresh-{RUN}", (key, "digest"), owner="alice") is None
        finally:
            await store.aclose()

    asyncio.run(scenario())


# ---------------------------------------------------------------- a sidecar on it


class _Records(StreamLog):
    def __init__(self) -> None:
        super().__init__(None)
        self.records: list[StreamRecord] = []

    def write(self, record: StreamRecord, **extra: object) -> None:
        self.records.append(record)

    def of(self, request_id: str) -> StreamRecord:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            for record in list(self.records):
                if record.request_id == request_id:
                    return record
            time.sleep(0.005)
        raise AssertionError(f"no record for {request_id}: {[r.request_id for r in self.records]}")


@dataclass
class _Running:
    port: int
    upstream: Any
    log: _Records
    redis_url: str
    run: Callable[[Coroutine[Any, Any, Any]], Any]

    def delete(self, stream_id: str, owner: dict[str, str]) -> httpx.Response:
        return httpx.delete(f"http://127.0.0.1:{self.port}/v1/streams/{stream_id}", headers=owner, timeout=10)

    def reconnect(self, part: SSEResponse, last_id: str | None = None,
                  owner: dict[str, str] = ALICE) -> SSEResponse:
        """The EventSource reconnect, after ``last_id`` (by default the last event read)."""
        return open_stream(self.port, "GET", f"/v1/streams/{part.stream_id}", headers={
            "Accept": "text/event-stream", "Last-Event-ID": last_id or part.ids[-1], **owner})

    def stored_end(self, stream_id: str) -> EndReason | None:
        """The end the shared store holds for ``stream_id``, read as another replica would."""
        async def read() -> EndReason | None:
            store = RedisReplayStore(self.redis_url)
            try:
                return await _until(lambda: store.end_reason(stream_id), lambda found: found is not None,
                                    f"the end of {stream_id}")
            finally:
                await store.aclose()

        return asyncio.run(read())


@pytest.fixture
def sidecar(redis_url: str) -> Iterator[_Running]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(15)

    upstream = _sidecar_upstreams().FakeUpstream()
    run(upstream.start())
    wire = SIDECAR_WIRE_DEFAULTS.replace(resume=True, resume_grace_s=10.0,
                                         resume_owner_secret=f"redis-cancel-{RUN}")
    config = SidecarConfig(wire=wire, upstream=(upstream.url,), listen="127.0.0.1:0",
                           admin_listen="127.0.0.1:0", drain_s=0.0, resume_store=redis_url)
    log = _Records()
    proxy = Sidecar(config, log=log)
    run(proxy.start())
    try:
        yield _Running(proxy.address[1], upstream, log, redis_url, run)
    finally:
        run(proxy.shutdown())
        run(upstream.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _told_cancelled(response: SSEResponse) -> bool:
    """The reader learnt of the cancel: in-band after the stored events, or as
    its answer's error body where the cancel was all that was left to read."""
    if response.status == 200:
        last = json.loads(response.data_events[-1].data or "{}") if response.data_events else {}
        return not response.clean_end and last.get("error", {}).get("code") == "cancelled"
    return json.loads(response.body or b"{}").get("error", {}).get("code") == "cancelled"


def test_delete_of_a_live_stream_this_sidecar_writes_on_redis_cancels_it_in_the_grace(
        sidecar: _Running) -> None:
    request_id = f"redis-live-{RUN}"
    part = open_stream(sidecar.port, "POST", PATH, body=BODY, stop_after=3, headers={
        "x-fake-tokens": "5000", "x-fake-delay-s": "0.005", "x-request-id": request_id, **ALICE})
    assert part.status == 200 and part.stopped and part.stream_id
    connection = sidecar.upstream.connection_of(request_id)
    assert connection.peer_closed_at is None  # the client left; the grace keeps it generating

    other = sidecar.delete(part.stream_id, MALLORY)
    assert other.status_code == 404, other.text
    assert connection.peer_closed_at is None

    answer = sidecar.delete(part.stream_id, ALICE)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": part.stream_id, "object": "stream", "status": "cancelled"}
    assert connection.closed.wait(DEADLINE_S) and connection.peer_closed_at is not None
    assert sidecar.log.of(request_id).end_reason is EndReason.CANCELLED
    assert sidecar.stored_end(part.stream_id) is EndReason.CANCELLED
    late = sidecar.reconnect(part)
    assert _told_cancelled(late), late


def test_delete_of_an_ended_stream_on_redis_forgets_it(sidecar: _Running) -> None:
    request_id = f"redis-ended-{RUN}"
    done = open_stream(sidecar.port, "POST", PATH, body=BODY,
                       headers={"x-fake-tokens": "5", "x-request-id": request_id, **ALICE})
    assert done.status == 200 and done.clean_end
    assert sidecar.log.of(request_id).end_reason is EndReason.COMPLETE
    assert sidecar.stored_end(done.stream_id) is EndReason.COMPLETE
    # While stored, the owner's reconnect replays it (so the 404 below is the forgetting).
    replayed = sidecar.reconnect(done, done.ids[0])
    assert replayed.status == 200 and replayed.clean_end and replayed.ids == done.ids[1:]

    answer = sidecar.delete(done.stream_id, ALICE)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": done.stream_id, "object": "stream", "status": "ended"}
    assert sidecar.reconnect(done).status == 404
    assert sidecar.delete(done.stream_id, ALICE).status_code == 404
