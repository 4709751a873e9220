"""Fake engine pods as real processes (``fake_engine.py``): controllable queue,
speed, health and prefix cache, each on its own port.

One launcher for the balancing benchmark (``balance_bench.py``) and the
balancing tests (``tests/sidecar/test_balance_processes.py``): it lives beside
the fake engine it starts, and the tests import it from here (``tests/conftest.py``
puts the repository root on their path).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.targets import read_line

FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


@dataclass
class FakePod:
    name: str
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, method: str, path: str, payload: object | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def control(self, **state: Any) -> Any:
        """Change the pod's speed or health (see fake_engine.py)."""
        return self._call("POST", "/control", state)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/stats")
        return result

    def kill(self) -> None:
        """SIGKILL: its sockets close with the process, as a crashed pod's do."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def spawn_pod(name: str, *args: str, timeout_s: float = 15.0) -> FakePod:
    """``fake_engine.py --name NAME ARGS``, once it printed ``ready port=N``."""
    process = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--name", name, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = read_line(process, f"fake engine {name}", timeout_s)
    if not line.startswith("ready port="):
        process.kill()
        raise RuntimeError(f"fake engine {name} said {line!r}, not its ready line")
    return FakePod(name, process, int(line.split("=", 1)[1]))


@contextlib.contextmanager
def running_pods(specs: Sequence[Sequence[str]]) -> Iterator[list[FakePod]]:
    """One pod per spec (its arguments), ``pod0``, ``pod1``...; stopped at the end."""
    started: list[FakePod] = []
    try:
        for index, args in enumerate(specs):
            started.append(spawn_pod(f"pod{index}", *args))
        yield started
    finally:
        for pod in started:
            pod.stop()
