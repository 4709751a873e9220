"""The opt-in frames asked by query (``?tokenwire_frames=open,done``), as a
browser ``EventSource`` can (it sets no header), through the ASGI middleware on
real uvicorn: the frames come, an unknown frame is a 400 before the app runs,
and a request that asked nothing gets none."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from resume_client import open_stream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG

from .asgi_apps import chat_chunk, running_server

PATH = "/v1/chat/completions"


def _app(calls: list[str]) -> Starlette:
    async def endpoint(request: Request) -> StreamingResponse:
        calls.append(request.headers.get("tokenwire-frames", ""))

        async def events() -> AsyncIterator[str]:
            for word in ("a ", "b "):
                yield f"data: {chat_chunk(word)}\n\n"
            yield f"data: {chat_chunk('', finish='stop')}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route(PATH, endpoint, methods=["GET", "POST"])])


def test_frames_asked_by_query_come_and_a_bad_one_is_refused_before_the_app() -> None:
    calls: list[str] = []
    wrapped = TokenWireMiddleware(_app(calls), DEFAULT_CONFIG.replace(resume=True))
    with running_server(wrapped, "uvicorn-h11") as port:
        asked = open_stream(port, "GET", PATH + "?x=1&tokenwire_frames=open%2Cdone")
        assert asked.status == 200 and asked.clean_end, asked.error
        names = [event.event for event in asked.data_events]
        assert names == ["tokenwire.open", None, None, None, "tokenwire.done", None], names
        opened = json.loads(asked.data_events[0].data or "")
        assert opened["stream_id"] == asked.headers["x-tokenwire-stream-id"] and opened["resumed"] is False
        done = json.loads(asked.data_events[-2].data or "")
        assert done["end_reason"] == "complete", done
        assert calls == ["open,done"]  # passed on as the header it stands for

        refused = open_stream(port, "GET", PATH + "?tokenwire_frames=open,bogus")
        assert refused.status == 400 and b"'bogus' is not a frame" in refused.body, refused.body
        assert calls == ["open,done"]  # the app never ran

        plain = open_stream(port, "GET", PATH + "?x=tokenwire_frames")
        assert plain.status == 200 and all(event.event is None for event in plain.data_events)
