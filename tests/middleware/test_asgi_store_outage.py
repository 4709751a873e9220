"""The ASGI middleware with its Redis resume store out (nothing answers at its
address): every request is still answered, and "not resumable" is logged once a
while with a count (``store_outages.py``), not once a request."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from resume_client import open_stream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from tokenwire.middleware import TokenWireMiddleware
from tokenwire.middleware.asgi.middleware import DEFAULT_CONFIG
from tokenwire.middleware.shared.replay_redis import RedisReplayStore
from tokenwire.middleware.shared.store_outages import LOG_EVERY_S, STORE_OUTAGES

from .asgi_apps import chat_chunk, running_server

pytestmark = pytest.mark.slow


async def _endpoint(request: Request) -> StreamingResponse:
    await request.body()

    async def events() -> AsyncIterator[str]:
        yield f"data: {chat_chunk('hi')}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def dead_store_url() -> Iterator[str]:
    """A Redis address where nothing listens: every connect is refused, as to a
    redis-server that was killed (``tests/sidecar/test_resume_redis_faults.py``
    kills a real one under a sidecar). The port is held, bound but not
    listening, so no other process can take it meanwhile."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"redis://127.0.0.1:{held.getsockname()[1]}/0"


def test_not_resumable_is_logged_once_a_while_with_a_count(
        dead_store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's one count, on a clock of this test's own, as if nothing had
    # been logged yet; monkeypatch puts all three back, so no later test is affected.
    now = [0.0]
    monkeypatch.setattr(STORE_OUTAGES, "clock", lambda: now[0])
    for last_line in ("_logged_at", "_unresumable_logged_at"):
        monkeypatch.setattr(STORE_OUTAGES, last_line, -LOG_EVERY_S)
    app = Starlette(routes=[Route("/v1/chat/completions", _endpoint, methods=["POST"])])
    wrapped = TokenWireMiddleware(app, DEFAULT_CONFIG.replace(resume=True),
                                  replay_store=RedisReplayStore(dead_store_url))
    caplog.set_level(logging.WARNING, logger="tokenwire")
    before = STORE_OUTAGES.unresumable

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "not resumable" in r.getMessage()]

    def post() -> None:
        answer = open_stream(port, "POST", "/v1/chat/completions", body=b'{"stream": true}')
        assert answer.status == 200 and answer.clean_end  # answered, just not resumable

    with running_server(wrapped, "uvicorn-h11") as port:
        for _ in range(20):
            post()
        assert STORE_OUTAGES.unresumable == before + 20
        assert len(lines()) == 1 and f"(requests so far: {before + 1})" in lines()[0], lines()
        now[0] += LOG_EVERY_S
        post()
        assert len(lines()) == 2 and f"(requests so far: {before + 21})" in lines()[1], lines()
