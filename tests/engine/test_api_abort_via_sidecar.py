"""The engine behind a real sidecar with ``--abort-url``: the sidecar sends the engine
its own request id, so a client that reuses another's ``X-Request-Id`` and hangs up
ends only its own generation (issue 19, item 3)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from tokenwire.middleware import WireConfig
from tokenwire.sidecar import Sidecar, SidecarConfig

pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from conftest import RunningServer


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def sidecar_url(engine_server: RunningServer) -> Iterator[str]:
    """A sidecar in front of the engine, on its own loop in a thread."""
    config = SidecarConfig(wire=WireConfig(), upstream=(engine_server.base_url,), listen="127.0.0.1:0",
                           abort_url=engine_server.base_url + "/v1/abort/{request_id}", log_file="")
    sidecar = Sidecar(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sidecar-test", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(sidecar.start(), loop).result(15)
    try:
        host, port = sidecar.address
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(sidecar.shutdown(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)


def test_a_reused_request_id_aborts_only_its_own_row(engine_server: RunningServer, sidecar_url: str) -> None:
    backend = engine_server.app.state.engine.backend
    body = {"model": "tiny", "prompt": "Keep going", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    # Two such rows fit the test engine's KV budget (4,096 tokens) side by side; several
    # seconds of generation on a CPU, so the attacker comes and goes while the victim runs
    # (with 600 the victim once ended first on a loaded machine: its row never met the attacker's).
    headers = {"X-Request-Id": "shared-id"}
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{sidecar_url}/v1/completions", json=body, headers=headers) as victim:
        assert victim.headers["x-request-id"] == "shared-id"  # the client's own id comes back
        victim_lines = (line for line in victim.iter_lines() if line.startswith("data:"))
        assert next(victim_lines)
        _wait_until(lambda: len(backend.batch_row_ids) == 1)
        (victim_row,) = backend.batch_row_ids
        assert victim_row != "shared-id"  # the engine knows the sidecar's id, not the client's
        with httpx.Client(timeout=30) as other, other.stream(
                "POST", f"{sidecar_url}/v1/completions", json=body, headers=headers) as attacker:
            assert attacker.status_code == 200
            assert next(line for line in attacker.iter_lines() if line.startswith("data:"))
            _wait_until(lambda: len(backend.batch_row_ids) == 2)
        # The attacker hung up: its row goes (disconnect, then the abort call), the victim's stays
        # and runs to its end: an abort of it at any point would end it with an in-band error.
        _wait_until(lambda: backend.batch_row_ids == [victim_row])
        rest = list(victim_lines)
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2][len("data:"):])
    assert "error" not in finish and finish["choices"][0]["finish_reason"] == "length"


def test_a_reused_request_id_sent_straight_to_the_engine_aborts_nothing_of_the_victim(
        engine_server: RunningServer) -> None:
    """Without a sidecar: a second request with the victim's ``X-Request-Id`` that
    leaves before it is answered must not take the victim's row with it (the
    engine used to pass the middleware's ``on_abort`` the id, and abort by it)."""
    backend = engine_server.app.state.engine.backend
    body = {"model": "tiny", "prompt": "Keep going", "max_tokens": 300, "stream": True, "ignore_eos": True}
    host, port = engine_server.base_url.removeprefix("http://").split(":")
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{engine_server.base_url}/v1/completions", json=body,
            headers={"X-Request-Id": "victim-id"}) as victim:
        victim_lines = (line for line in victim.iter_lines() if line.startswith("data:"))
        assert next(victim_lines)
        _wait_until(lambda: backend.batch_row_ids == ["victim-id"])
        # The attacker's head promises a body it never sends, then it hangs up: the
        # middleware sees its client leave while the app still waits for the body.
        with socket.create_connection((host, int(port))) as attacker:
            attacker.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: victim-id\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            time.sleep(0.3)  # the app is now reading the body (no event to wait on from outside)
        rest = list(victim_lines)
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2][len("data:"):])
    assert "error" not in finish and finish["choices"][0]["finish_reason"] == "length"
