"""The ASGI middleware with its Redis resume store out (a real ``redis-server``,
killed): every request is still answered, and "not resumable" is logged once a
while with a count (``store_outages.py``), not once a request."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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

from .asgi_apps import chat_chunk, free_port, running_server

pytestmark = pytest.mark.slow


async def _endpoint(request: Request) -> StreamingResponse:
    await request.body()

    async def events() -> AsyncIterator[str]:
        yield f"data: {chat_chunk('hi')}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def dead_store_url(tmp_path: Path) -> Iterator[str]:
    """The address of a redis-server that was up and has been SIGKILLed."""
    port = free_port()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:  # polling a starting server's port: nothing to wait on instead
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as probe:
                probe.sendall(b"PING\r\n")
                if probe.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and process.poll() is None, "redis-server did not start"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    yield f"redis://127.0.0.1:{port}/0"


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
