"""Engine fixtures: one tiny model per test session, built into a temp cache dir."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel, load_model
from tokenwire.engine.tiny import TinySpec, ensure_tiny_model

TEST_SPEC = TinySpec(train_steps=30, batch_size=4, sequence_length_tokens=64)
"""Same shape as the default tiny model, far less training: tests need a model, not prose."""


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Two intra-op threads on a shared two-core machine spin against whatever else
    runs there (seen: a 40-step build taking 135 s instead of 10 s); one is steady."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny model folder, built once per session under a pytest temp dir."""
    cache_dir = tmp_path_factory.mktemp("tokenwire-cache")
    previous = os.environ.get("TOKENWIRE_CACHE_DIR")
    os.environ["TOKENWIRE_CACHE_DIR"] = str(cache_dir)
    try:
        yield ensure_tiny_model(TEST_SPEC, log=False)
    finally:
        if previous is None:
            os.environ.pop("TOKENWIRE_CACHE_DIR", None)
        else:
            os.environ["TOKENWIRE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_f64(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model in float64: batched and unbatched maths agree to the last bit
    that could flip an argmax, so greedy comparisons are exact."""
    return load_model(tiny_model_dir, device="cpu", dtype="float64", name="tiny")


@pytest.fixture(scope="session")
def tiny_f32(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model as served by default on CPU."""
    return load_model(tiny_model_dir, device="cpu", dtype="float32", name="tiny")


@dataclass
class RunningServer:
    """A real uvicorn serving the engine app on 127.0.0.1."""

    base_url: str
    app: Any
    """The bare Starlette app (``app.state.engine`` has the service and scheduler)."""
    loop: asyncio.AbstractEventLoop

    def abort_mid_stream(self, request_id: str, *, max_tokens: int, timeout_s: float) -> list[str]:
        """Stream a long completion as ``request_id``, call ``POST /v1/abort/{id}``
        once its first event came (asserting a 200), and read on: the ``data:``
        lines after the abort, up to the cut the middleware makes after its
        in-band error (asserted: the body ends without its chunked terminator)."""
        body = {"model": "tiny", "prompt": "Abort me", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        rest: list[str] = []
        with httpx.Client(timeout=timeout_s) as client, client.stream(
            "POST", f"{self.base_url}/v1/completions", json=body, headers={"X-Request-Id": request_id},
        ) as response:
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            assert next(events)
            assert httpx.post(f"{self.base_url}/v1/abort/{request_id}").status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                for line in events:
                    rest.append(line)
        return rest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(app: Any) -> Iterator[RunningServer]:
    """``app`` (the bare engine app) behind tokenwire's middleware, served by uvicorn
    in a thread on 127.0.0.1, lifespan included."""
    import uvicorn
    from tokenwire.engine.server import _wrap_in_middleware

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(_wrap_in_middleware(app), host="127.0.0.1", port=port,
                       log_level="warning", lifespan="on")
    )
    loop_box: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        loop_box.append(loop)
        loop.run_until_complete(server.serve())
        loop.close()

    thread = threading.Thread(target=run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline_s = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline_s or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(base_url=f"http://127.0.0.1:{port}", app=app, loop=loop_box[0])
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def engine_server(tiny_f32: LoadedModel) -> Iterator[RunningServer]:
    """The engine behind tokenwire's middleware, served by uvicorn in a thread."""
    from tokenwire.engine.api import build_app

    config = EngineConfig(max_running=32, kv_budget_tokens=4096, max_prefill_tokens_per_step=64)
    with serve(build_app(tiny_f32, config)) as running:
        yield running


@pytest.fixture(scope="session")
def serve_engine() -> Any:
    """:func:`serve`, for test modules (which cannot import this conftest by name)."""
    return serve
