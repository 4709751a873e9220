"""Fake engine pods as real processes (``bench/fake_engine.py``): controllable
queue, speed, health and prefix cache, each on its own port."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAKE_ENGINE = Path(__file__).resolve().parents[2] / "bench" / "fake_engine.py"


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
    process = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--name", name, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready or process.poll() is not None:
            process.kill()
            raise AssertionError(f"fake engine {name} did not start")
        line += os.read(process.stdout.fileno(), 1)
    assert line.startswith(b"ready port="), line
    return FakePod(name, process, int(line.split(b"=", 1)[1]))
