"""The sidecar as a real process: ``tokenwire sidecar ...`` with its ready line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from testbed.targets import read_line  # testbed/targets.py: the ready line read as the benchmarks read it


@dataclass
class SidecarProcess:
    process: subprocess.Popen[bytes]
    host: str
    port: int
    admin_port: int | None

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def spawn(args: list[str], timeout_s: float = 15.0) -> SidecarProcess:
    """Start ``tokenwire sidecar`` with ``args``; returns once it printed its ready line."""
    command = [sys.executable, "-m", "tokenwire.sidecar", "sidecar", "--listen", "127.0.0.1:0",
               "--admin-listen", "127.0.0.1:0", "--log-file", "", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        line = read_line(process, "sidecar", timeout_s)
    except RuntimeError as error:
        _, err = process.communicate(timeout=5)
        raise AssertionError(f"{error}: {err.decode()[-2000:]}") from None
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    assert line.startswith("ready "), line
    host, port = fields["listen"].rsplit(":", 1)
    admin_port = int(fields["admin"].rsplit(":", 1)[1]) if "admin" in fields else None
    return SidecarProcess(process, host, int(port), admin_port)
