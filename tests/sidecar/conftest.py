"""Harness: one event loop (uvloop) in a background thread runs the fake upstream
and each test's sidecar; tests act as real clients from the main thread."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis_topologies import ClusterSetup, SentinelSetup
from tokenwire.middleware import StreamRecord, WireConfig
from tokenwire.sidecar import Sidecar, SidecarConfig, StreamLog
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS
from upstreams import FakeUpstream, ScriptedUpstream

from testbed.targets import tiny_model

T = TypeVar("T")

_WIRE_KEYS = frozenset(f.name for f in dataclasses.fields(WireConfig))


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call())

    def cpu_time_s(self) -> float:
        """CPU time the loop's thread has used so far: what a test bounds when it
        means the loop's own work, which waiting for a busy machine's cores does not inflate."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident or 0))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class RecordingLog(StreamLog):
    """Keeps the records in memory instead of writing JSON lines."""

    def __init__(self) -> None:
        super().__init__(None)
        self.records: list[StreamRecord] = []
        self.extras: dict[str, dict[str, object]] = {}
        """The fields the driver adds to each record (``http_version``...), by request id."""

    def write(self, record: StreamRecord, **extra: object) -> None:
        self.extras[record.request_id] = extra
        self.records.append(record)


@dataclass
class RunningSidecar:
    sidecar: Sidecar
    log: RecordingLog
    host: str
    port: int
    admin_port: int | None
    scheme: str = "http"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def record(self, request_id: str, timeout_s: float = 5.0) -> StreamRecord:
        """The finished stream's record (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in list(self.log.records):
                if record.request_id == request_id:
                    return record
            time.sleep(0.01)
        raise AssertionError(f"no record for {request_id}; have {[r.request_id for r in self.log.records]}")


def make_config(upstream: str | list[str], **overrides: Any) -> SidecarConfig:
    """A config for tests: free ports, no drain, wire keys and sidecar keys mixed."""
    wire = {k: v for k, v in overrides.items() if k in _WIRE_KEYS}
    own = {k: v for k, v in overrides.items() if k not in _WIRE_KEYS}
    own.setdefault("listen", "127.0.0.1:0")
    own.setdefault("admin_listen", "127.0.0.1:0")
    own.setdefault("drain_s", 0.0)
    upstreams = (upstream,) if isinstance(upstream, str) else tuple(upstream)
    return SidecarConfig(wire=SIDECAR_WIRE_DEFAULTS.replace(**wire), upstream=upstreams, **own)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def upstream(loop_thread: LoopThread) -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    loop_thread.run(fake.start())
    yield fake
    loop_thread.run(fake.stop())


@pytest.fixture
def recorder(loop_thread: LoopThread) -> Iterator[ScriptedUpstream]:
    """An upstream that answers as each test scripts it and records what reached it."""
    upstream = ScriptedUpstream()
    loop_thread.run(upstream.start())
    yield upstream
    loop_thread.run(upstream.stop())


@pytest.fixture
def start_sidecar(loop_thread: LoopThread, upstream: FakeUpstream) -> Iterator[Callable[..., RunningSidecar]]:
    """``start_sidecar(**config_overrides)`` → a running sidecar, stopped after the test."""
    started: list[RunningSidecar] = []

    def start(upstreams: str | list[str] | None = None, **overrides: Any) -> RunningSidecar:
        config = make_config(upstreams if upstreams is not None else upstream.url, **overrides)
        log = RecordingLog()
        sidecar = Sidecar(config, log=log)
        loop_thread.run(sidecar.start())
        host, port = sidecar.address
        admin = sidecar.admin_address
        running = RunningSidecar(sidecar, log, host, port, admin[1] if admin else None,
                                 scheme="https" if config.tls else "http")
        started.append(running)
        return running

    yield start
    for running in started:
        loop_thread.run(running.sidecar.shutdown())


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache dir, model folder): a quickly trained tiny model, built once per module
    (``targets.tiny_model``: in a child process, so this one never loads torch)."""
    pytest.importorskip("torch")
    cache_dir = tmp_path_factory.mktemp("tokenwire-cache")
    return cache_dir, tiny_model(cache_dir, timeout_s=300)


@pytest.fixture(scope="module")
def sentinel_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSetup]:
    """Real redis-servers as a Sentinel topology (a master, a replica, a sentinel)."""
    setup = SentinelSetup(tmp_path_factory.mktemp("sentinel"))
    setup.start()
    yield setup
    setup.stop()


@pytest.fixture(scope="module")
def cluster_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSetup]:
    """Real redis-servers as a three-master Redis Cluster."""
    setup = ClusterSetup(tmp_path_factory.mktemp("cluster"))
    setup.start()
    yield setup
    setup.stop()
