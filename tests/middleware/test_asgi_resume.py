"""Resume through the ASGI middleware on a real uvicorn: ids, reconnects,
idempotency and grace, with the app a plain Starlette streaming endpoint."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from resume_client import SSEResponse, open_stream, resume, resume_through_drops
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import EndReason, TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG
from tokenwire.middleware.shared.replay_redis import RedisReplayStore

from .asgi_apps import Hooks, chat_chunk, running_server


class CountingApp:
    """POST /v1/chat/completions streams ``x-tokens`` chat chunks, ``x-delay-s``
    apart, then [DONE]; counts the generations it ran and how each ended."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.completed: list[str] = []
        self.cancelled: list[str] = []
        self.stream_ids: list[str | None] = []
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.endpoint, methods=["POST"])])

    async def endpoint(self, request: Request) -> StreamingResponse:
        await request.body()
        name = request.headers.get("x-request-id", "")
        self.stream_ids.append(request.scope["extensions"]["tokenwire"].stream_id)
        tokens = int(request.headers.get("x-tokens", "5"))
        delay_s = float(request.headers.get("x-delay-s", "0"))
        self.started.append(name)

        async def events() -> AsyncIterator[str]:
            try:
                for i in range(tokens):
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    yield f"data: {chat_chunk(f't{i} ')}\n\n"
                yield "data: [DONE]\n\n"
                self.completed.append(name)
            except asyncio.CancelledError:
                self.cancelled.append(name)
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


def text_of(response_events: list[Any]) -> str:
    parts = []
    for event in response_events:
        if event.data and event.data != "[DONE]" and "error" not in event.data:
            parts.append(json.loads(event.data)["choices"][0]["delta"].get("content") or "")
    return "".join(parts)


def expected(tokens: int) -> str:
    return "".join(f"t{i} " for i in range(tokens))


@pytest.fixture
def served() -> Iterator[Any]:
    """``served(**wire_config)`` → (port, app, hooks) on uvicorn (h11)."""
    stack: list[Any] = []

    def serve(store: Any = None, **config: Any) -> tuple[int, CountingApp, Hooks]:
        app = CountingApp()
        hooks = Hooks()
        wrapped = TokenWireMiddleware(app.app, DEFAULT_CONFIG.replace(resume=True, **config),
                                      on_abort=hooks.on_abort, on_finished=hooks.on_finished,
                                      replay_store=store)
        manager = running_server(wrapped, "uvicorn-h11")
        port = manager.__enter__()
        stack.append(manager)
        return port, app, hooks

    yield serve
    for manager in stack:
        manager.__exit__(None, None, None)


def post(port: int, *, tokens: int, delay_s: float = 0.0, stop_after: int | None = None,
         headers: dict[str, str] | None = None, body: bytes = b'{"stream": true}') -> SSEResponse:
    return open_stream(port, "POST", "/v1/chat/completions", body=body, stop_after=stop_after,
                       headers={"x-tokens": str(tokens), "x-delay-s": str(delay_s), **(headers or {})})


def test_ids_retry_and_replay_from_any_point(served: Any) -> None:
    port, app, _ = served(resume_retry_ms=1500)
    full = post(port, tokens=6)
    assert full.status == 200 and full.clean_end
    # retry: rides on the first event that carries data: no frame is an empty event.
    first_frame = full.body.split(b"\n\n")[0]
    assert first_frame.startswith(b"data: {") and b"\nid: " in first_frame
    assert first_frame.endswith(b"\nretry: 1500")
    stream_id = full.stream_id
    # Live, the app's burst may have been coalesced (a merged chunk carries the
    # id of its newest event); the last id is the [DONE] after 6 chunks.
    assert full.ids[-1] == f"{stream_id}.7" and text_of(full.events) == expected(6)
    everything = resume(port, stream_id, None)
    assert everything.ids == [f"{stream_id}.{n}" for n in range(1, 8)]  # a replay never merges
    assert text_of(everything.events) == expected(6) and everything.clean_end
    for after in (3, 6):
        replay = resume(port, stream_id, f"{stream_id}.{after}")
        assert replay.status == 200 and replay.clean_end
        assert [e.data for e in replay.data_events] == [e.data for e in everything.data_events][after:]
        assert replay.ids == everything.ids[after:]
    assert resume(port, stream_id, f"{stream_id}.7").status == 204
    assert len(app.started) == 1  # replays never reach the app
    assert app.stream_ids == [stream_id]  # the app can see its stream id


def test_unknown_stream_and_bad_ids_are_refused_before_the_app(served: Any) -> None:
    port, app, _ = served()
    missing = resume(port, "NoSuchStreamHere", None)
    assert missing.status == 404 and json.loads(missing.body)["error"]["code"] == "stream_not_found"
    bad = resume(port, "NoSuchStreamHere", "nonsense")
    assert bad.status == 400 and json.loads(bad.body)["error"]["code"] == "invalid_last_event_id"
    assert app.started == []


def test_idempotency_key_one_generation_for_two_requests(served: Any) -> None:
    port, app, _ = served()
    headers = {"Idempotency-Key": "pay-7", "x-request-id": "first"}
    results: list[SSEResponse] = []
    worker = threading.Thread(target=lambda: results.append(
        post(port, tokens=30, delay_s=0.01, headers=headers)))
    worker.start()
    repeat = post(port, tokens=30, delay_s=0.01, headers={**headers, "x-request-id": "second"})
    worker.join(10)
    assert text_of(repeat.events) == text_of(results[0].events) == expected(30)
    assert repeat.ids == results[0].ids
    assert len(app.started) == 1  # whichever arrived first generated; the other replayed
    other = post(port, tokens=30, headers=headers, body=b'{"stream": true, "n": 2}')
    assert other.status == 422 and len(app.started) == 1


@pytest.mark.parametrize("other", [{"Authorization": "Bearer sk-mallory"}, {}],
                         ids=["another-credential", "no-credential"])
def test_streams_belong_to_their_caller(served: Any, other: dict[str, str]) -> None:
    port, app, _ = served()
    alice = {"Authorization": "Bearer sk-alice"}
    first = post(port, tokens=5, delay_s=0.01, headers={**alice, "x-request-id": "alice-1"})
    path = f"/v1/streams/{first.stream_id}"
    unknown = open_stream(port, "GET", "/v1/streams/NoSuchStreamHere", headers=other)
    for headers in (other, {**other, "Last-Event-ID": first.ids[0]}):
        stolen = open_stream(port, "GET", path, headers=headers)
        # The very 404 an unknown stream gets: the same body but for the id it names
        # (a random id, so "no token text in it" must not look inside the id).
        assert stolen.status == 404 == unknown.status
        assert (stolen.body.replace(first.stream_id.encode(), b"ID")
                == unknown.body.replace(b"NoSuchStreamHere", b"ID"))
        assert json.loads(stolen.body)["error"]["code"] == "stream_not_found"
    resent = post(port, tokens=5, headers={**other, "Last-Event-ID": first.ids[0]})
    assert resent.status == 404 and app.started == ["alice-1"]
    mine = open_stream(port, "GET", path, headers=alice)
    assert mine.clean_end and text_of(mine.events) == expected(5)
    # An idempotency key is the caller's own: another caller neither replays nor gets a 422.
    key = {"Idempotency-Key": "pay-8"}
    post(port, tokens=5, headers={**alice, **key, "x-request-id": "alice-2"})
    theirs = post(port, tokens=5, headers={**other, **key, "x-request-id": "other-1"})
    different = post(port, tokens=5, body=b'{"stream": true, "n": 2}',
                     headers={**other, "Idempotency-Key": "pay-8-b", "x-request-id": "other-2"})
    assert theirs.status == 200 == different.status
    again = post(port, tokens=5, headers={**alice, **key, "x-request-id": "alice-3"})
    assert again.status == 200 and app.started == ["alice-1", "alice-2", "other-1", "other-2"]
    reused = post(port, tokens=5, body=b'{"stream": true, "n": 2}', headers={**alice, **key})
    assert reused.status == 422


def test_grace_keeps_the_app_generating_for_a_reconnect(served: Any) -> None:
    # The grace (0.5 s) is shorter than the answer (~1.2 s): only the reconnect keeps it.
    port, app, hooks = served(resume_grace_s=0.5)
    part = post(port, tokens=120, delay_s=0.01, stop_after=5, headers={"x-request-id": "kept"})
    rest = resume(port, part.stream_id, part.ids[-1])
    assert rest.clean_end and text_of(part.events) + text_of(rest.events) == expected(120)
    assert [int(i.rpartition(".")[2]) for i in part.ids + rest.ids] == list(range(1, 122))
    assert app.completed == ["kept"] and app.cancelled == [] and hooks.aborts == []
    record = next(r for r in hooks.records if r.request_id == "kept")
    assert record.end_reason is EndReason.DETACHED


def test_grace_expiry_cancels_the_app_and_calls_on_abort(served: Any) -> None:
    port, app, hooks = served(resume_grace_s=0.2)
    part = post(port, tokens=500, delay_s=0.01, stop_after=3, headers={"x-request-id": "lost"})
    record = hooks.wait_record()
    assert record.end_reason is EndReason.CLIENT_GONE
    assert [(name, why) for name, why, _ in hooks.aborts] == [("lost", "client_gone")]
    assert app.completed == []
    late = resume(port, part.stream_id, part.ids[-1])
    assert not late.clean_end
    assert json.loads(late.data_events[-1].data or "")["error"]["code"] == "cancelled"


@pytest.mark.slow
def test_random_disconnects_on_the_redis_store(served: Any, redis_url: str) -> None:
    port, _, _ = served(store=RedisReplayStore(redis_url), resume_grace_s=5.0)
    rng = random.Random(7)
    for run in range(8):
        response = post(port, tokens=25, delay_s=0.002, stop_after=rng.randint(1, 25),
                        headers={"x-request-id": f"mw-{run}"})
        received = resume_through_drops(port, response, rng)
        assert [e.id for e in received] == [f"{response.stream_id}.{n}" for n in range(1, 27)]
        assert text_of(received) == expected(25)


def test_cancel_by_id_when_the_owner_asks_then_the_app_is_cancelled_and_a_reconnect_reads_why(
        served: Any) -> None:
    """``DELETE /v1/streams/{id}`` through the middleware: the app generating
    for the grace is cancelled at once; another caller gets 404; the stream's
    reconnect learns of the cancel."""
    import httpx

    port, app, hooks = served(resume_grace_s=10.0)
    owner = {"Authorization": "Bearer sk-alice"}
    part = open_stream(port, "POST", "/v1/chat/completions", body=b"{}", stop_after=3, headers={
        "x-tokens": "100000", "x-delay-s": "0.002", "x-request-id": "asgi-cancel", **owner})
    assert app.cancelled == []
    url = f"http://127.0.0.1:{port}/v1/streams/{part.stream_id}"
    other = httpx.delete(url, headers={"Authorization": "Bearer sk-mallory"})
    assert other.status_code == 404
    answer = httpx.delete(url, headers=owner)
    assert answer.status_code == 200
    assert answer.json() == {"id": part.stream_id, "object": "stream", "status": "cancelled"}
    deadline = time.monotonic() + 5
    while not (ended := [r for r in hooks.records if r.request_id == "asgi-cancel"]):
        assert time.monotonic() < deadline, hooks.records
        time.sleep(0.01)
    assert [r.end_reason for r in ended] == [EndReason.CANCELLED], hooks.records
    while app.cancelled != ["asgi-cancel"]:  # the app's task unwinds once the loop runs it
        assert time.monotonic() < deadline, app.cancelled
        time.sleep(0.01)
    late = open_stream(port, "GET", f"/v1/streams/{part.stream_id}",
                       headers={"Last-Event-ID": part.ids[-1], **owner})
    told = json.loads(late.data_events[-1].data or "") if late.status == 200 else json.loads(late.body)
    assert told["error"]["code"] == "cancelled" and not (late.status == 200 and late.clean_end)
