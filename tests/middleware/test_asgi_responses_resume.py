"""The Responses API's own resume form through the ASGI middleware on a real
uvicorn: ``GET /v1/responses/{id}?stream=true&starting_after=N`` served from the
replay store, caller-scoped, the engine's for anything the store does not hold."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from resume_client import open_stream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG
from tokenwire.middleware.shared.replay_redis import RedisReplayStore

from .asgi_apps import Hooks, running_server

WORDS = [f"w{i} " for i in range(20)]
RUN = uuid.uuid4().hex[:8]  # the response ids of this run: a Redis kept from another is no matter


def frame(kind: str, seq: int, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields, 'sequence_number': seq})}\n\n"


class ResponsesApp:
    """POST /v1/responses streams ``resp_<x-request-id>`` word by word; GET
    /v1/responses/{id} is the engine's own retrieve (counted)."""

    def __init__(self) -> None:
        self.retrieved: list[str] = []
        self.generated = 0
        self.app = Starlette(routes=[Route("/v1/responses", self.create, methods=["POST"]),
                                     Route("/v1/responses/{ident}", self.retrieve, methods=["GET"])])

    async def create(self, request: Request) -> StreamingResponse:
        await request.body()
        ident = f"resp_{request.headers.get('x-request-id', '')}"
        self.generated += 1

        async def events() -> AsyncIterator[str]:
            response = {"id": ident, "object": "response", "status": "in_progress", "output": []}
            yield frame("response.created", 0, response=response)
            for seq, word in enumerate(WORDS, start=1):
                await asyncio.sleep(0.005)
                yield frame("response.output_text.delta", seq, item_id="msg_1", output_index=0,
                            content_index=0, delta=word, logprobs=[])
            yield frame("response.completed", len(WORDS) + 1,
                        response={**response, "status": "completed"})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def retrieve(self, request: Request) -> JSONResponse:
        self.retrieved.append(request.path_params["ident"])
        return JSONResponse({"error": {"message": "not stored here", "type": "invalid_request_error"}},
                            status_code=404)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.slow)])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[int, ResponsesApp]]:
    app = ResponsesApp()
    store = RedisReplayStore(request.getfixturevalue("redis_url")) if request.param == "redis" else None
    wrapped = TokenWireMiddleware(app.app, DEFAULT_CONFIG.replace(resume=True, resume_grace_s=10.0),
                                  on_finished=Hooks().on_finished, replay_store=store)
    with running_server(wrapped, "uvicorn-h11") as port:
        yield port, app


def numbers(events: list[Any]) -> list[int]:
    return [json.loads(e.data)["sequence_number"] for e in events if e.data]


def text(events: list[Any]) -> str:
    return "".join(json.loads(e.data).get("delta", "") for e in events
                   if e.event == "response.output_text.delta")


def test_get_stream_true_resumes_after_starting_after_from_the_store(
        served: tuple[int, ResponsesApp]) -> None:
    port, app = served
    me = {"Authorization": "Bearer mine", "x-request-id": f"r1{RUN}"}
    first = open_stream(port, "POST", "/v1/responses", body=b'{"stream": true}', headers=me, stop_after=5)
    seen = numbers(first.data_events)
    assert seen == [0, 1, 2, 3, 4]
    again = open_stream(port, "GET", f"/v1/responses/resp_r1{RUN}?stream=true&starting_after={seen[-1]}",
                        headers={"Authorization": "Bearer mine"})
    assert again.status == 200 and again.clean_end
    assert numbers(again.data_events) == list(range(5, len(WORDS) + 2))
    assert text(first.data_events) + text(again.data_events) == "".join(WORDS)
    assert again.data_events[-1].event == "response.completed"
    whole = open_stream(port, "GET", f"/v1/responses/resp_r1{RUN}?stream=true",
                        headers={"Authorization": "Bearer mine"})
    assert numbers(whole.data_events) == list(range(len(WORDS) + 2))
    assert (app.generated, app.retrieved) == (1, [])


def test_another_callers_or_an_unknown_id_is_the_engines_to_answer(served: tuple[int, ResponsesApp]) -> None:
    port, app = served
    done = open_stream(port, "POST", "/v1/responses", body=b'{"stream": true}',
                       headers={"Authorization": "Bearer mine", "x-request-id": f"r2{RUN}"})
    assert done.clean_end
    def get(path: str, caller: str) -> Any:
        return open_stream(port, "GET", path, headers={"Authorization": f"Bearer {caller}"})

    theirs = get(f"/v1/responses/resp_r2{RUN}?stream=true", "theirs")
    unknown = get("/v1/responses/resp_nope?stream=true", "mine")
    plain = get(f"/v1/responses/resp_r2{RUN}", "mine")
    assert (theirs.status, unknown.status, plain.status) == (404, 404, 404)
    assert theirs.data_events == []
    assert app.retrieved == [f"resp_r2{RUN}", "resp_nope", f"resp_r2{RUN}"]


def test_a_malformed_starting_after_is_a_clear_400(served: tuple[int, ResponsesApp]) -> None:
    port, app = served
    bad = open_stream(port, "GET", "/v1/responses/resp_x?stream=true&starting_after=-1")
    assert bad.status == 400 and app.retrieved == []


def test_openai_python_resumes_with_its_own_retrieve_call(served: tuple[int, ResponsesApp]) -> None:
    """openai-python's resume form, ``responses.retrieve(id, stream=True, starting_after=N)``,
    after the client dropped the first stream: the rest once, from the store, the same caller."""
    port, app = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="mine", max_retries=0)
    seen: list[Any] = []
    with client.responses.create(model="m", input="hi", stream=True,
                                 extra_headers={"x-request-id": f"r3{RUN}"}) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 4:
                break  # the client's connection drops here
    rest = list(client.responses.retrieve(f"resp_r3{RUN}", stream=True,
                                          starting_after=seen[-1].sequence_number))
    client.close()
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(WORDS) + 2))
    assert "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta") == "".join(WORDS)
    assert rest[-1].type == "response.completed" and (app.generated, app.retrieved) == (1, [])
