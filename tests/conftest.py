"""Fixtures every test folder may use: a real Redis server, headless Chromium."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chromium import launched

# The repository's root last on the path: the tests start processes with the
# helpers the benches use (testbed/), so both start them one way.
sys.path.append(str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``redis-server`` on 127.0.0.1 for this test session (installed by
    ``scripts/test.sh`` through ``scripts/system-deps.sh`` when missing)."""
    binary = shutil.which("redis-server") or ("/usr/bin/redis-server"
                                               if Path("/usr/bin/redis-server").exists() else None)
    if binary is None:
        pytest.fail("redis-server is not installed: run scripts/system-deps.sh redis-server")
    port = _free_port()
    directory = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian chromium driven by Playwright (``chromium.launched``).
    Module scope: while it lives, Playwright's loop runs in the main thread and
    every ``asyncio.run()`` there fails, so it must not outlive the module."""
    with launched() as browser:
        yield browser


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuses to test a stale compiled core: Python imports a module's extension
    (``scripts/compile-core.sh``) over its ``.py``, so an edit to a compiled
    module's source would otherwise go untested."""
    import importlib.machinery

    root = Path(__file__).resolve().parents[1]
    stale = sorted(
        str(source.relative_to(root)) for folder in ("middleware", "sidecar")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        for built in (root / folder).rglob(f"*{suffix}")
        if (source := built.with_name(built.name[: -len(suffix)] + ".py")).exists()
        and source.stat().st_mtime > built.stat().st_mtime)
    if stale:
        pytest.exit(f"the compiled core is older than {', '.join(stale)}: run scripts/compile-core.sh "
                    "(or scripts/compile-core.sh --clean for the pure-Python core)", returncode=4)
