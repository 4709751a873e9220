"""The OpenAI Python SDK against a FastAPI app behind the middleware."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG

from .asgi_apps import SERVERS, Hooks, chat_chunk, running_server


def chat_app(fail_after: int | None) -> FastAPI:
    api = FastAPI()

    @api.post("/v1/chat/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        prompt = body["messages"][-1]["content"]

        async def tokens() -> AsyncIterator[str]:
            for i in range(20):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("the engine fell over")
                yield f"data: {chat_chunk(f'{prompt}{i} ')}\n\n"
                await asyncio.sleep(0.001)
            yield f"data: {chat_chunk('', finish='stop')}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    return api


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def stream_text(port: int) -> str:
    stream = client(port).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w"}], stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("server", SERVERS)
def test_openai_sdk_when_stream_completes_then_gets_all_text(server: str) -> None:
    hooks = Hooks()
    config = DEFAULT_CONFIG.replace(terminal_marker="[DONE]")
    app = TokenWireMiddleware(chat_app(None), config, on_finished=hooks.on_finished)
    with running_server(app, server) as port:
        assert stream_text(port) == "".join(f"w{i} " for i in range(20))
    assert hooks.wait_record().end_reason == "complete"


@pytest.mark.parametrize("server", SERVERS)
def test_openai_sdk_when_app_raises_after_10_events_then_raises_api_error(server: str) -> None:
    hooks = Hooks()
    app = TokenWireMiddleware(chat_app(10), on_finished=hooks.on_finished)
    received: list[str] = []
    with running_server(app, server) as port:
        stream = client(port).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w"}], stream=True)
        with pytest.raises(openai.APIError) as raised:
            for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "".join(f"w{i} " for i in range(10))
    failed = "upstream failed: the application failed before it ended the answer"
    assert raised.value.body == {"message": failed,
                                 "type": "upstream_error", "code": "upstream_failed",
                                 "tokenwire": {"code": "upstream_failed", "number": "E7307"}}
    record = hooks.wait_record()
    assert record.end_reason == "upstream_error" and record.events_in == 10
