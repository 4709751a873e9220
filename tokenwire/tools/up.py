"""``tokenwire up``: the engine (tiny model) and the sidecar in front of it.

Two child processes joined by a Unix socket, as in a pod: the engine listens on
``unix:PATH`` and the sidecar forwards to it. ``up`` prints where to point a
client, then waits; Ctrl-C (or SIGTERM) stops the sidecar first, so open
streams drain, then the engine. If either child dies, ``up`` stops the other
and exits non-zero with the child's last words.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tokenwire.sidecar.downstream.cors import admin_origins

_ENGINE_START_TIMEOUT_S = 300.0  # the first run builds the tiny model (about a minute)
_SIDECAR_START_TIMEOUT_S = 30.0
# ``up`` is for trying things in a browser: the playground's resume button needs ids and a
# replay. A client that leaves stops its answer at once (no grace), unless the request
# asked to keep it going (``Tokenwire-Keep-Generating: true``, the playground's checkbox;
# a Responses ``"background": true``), for up to the default bound of client_settings.
# The playground's policy menu asks for coalesce, block or drop per request.
_UP_SIDECAR_ARGS = ("--resume", *(arg for setting in (
    "heartbeat_s=1..60", "write_deadline_s=5..120", "keep_generating_s=0..600",
    "slow_client_policy=coalesce|block|drop") for arg in ("--client-settings", setting)))


class Child:
    """A child process whose output is kept (last lines) and echoed if asked."""

    # Every child echoes to the one stderr, each from its own thread: a line is
    # written whole, under this lock, never split by another child's (print()
    # writes the text and its newline apart, and a JSON log line interleaved
    # with another is neither one's).
    _echo_lock = threading.Lock()

    def __init__(self, name: str, argv: list[str], *, echo: bool, relay: tuple[str, ...] = (),
                 on_line: Callable[[str], None] | None = None) -> None:
        """``echo``: every line of the child's output to our stderr; ``relay``:
        only the log lines whose message starts with one of these (progress a
        newcomer should see without ``--verbose``), as plain text; ``on_line``:
        called with every line, from the thread that reads them."""
        self.name = name
        self.lines: deque[str] = deque(maxlen=40)
        self.ready = threading.Event()
        self.ready_line = ""
        self._echo = echo
        self._relay = relay
        self._on_line = on_line
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True)
        assert self.process.stdout is not None
        self.pump = threading.Thread(target=self._pump, args=(self.process.stdout,), daemon=True)
        """Reads (and echoes) the child's output until it closes it."""
        self.pump.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith("ready"):
                self.ready_line = line
                self.ready.set()
            if self._on_line is not None:
                # The pump must go on reading, or the child blocks on a full
                # pipe: a watcher that fails is said once and dropped.
                try:
                    self._on_line(line)
                except Exception as error:
                    self._on_line = None
                    sys.stderr.write(f"[{self.name}] its line watcher failed and was dropped: {error!r}\n")
            shown = line if self._echo else self._relayed(line)
            if shown is not None:
                with Child._echo_lock:
                    sys.stderr.write(f"[{self.name}] {shown}\n")
                    sys.stderr.flush()

    def _relayed(self, line: str) -> str | None:
        """The message of a JSON log line to relay (see ``relay``), else None."""
        if not self._relay or not line.startswith("{"):
            return None
        try:
            message = json.loads(line).get("msg")
        except (ValueError, AttributeError):
            return None
        return message if isinstance(message, str) and message.startswith(self._relay) else None

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def last_words(self) -> str:
        return "\n".join(f"  {line}" for line in list(self.lines)[-15:])


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a running ``up`` can be reached."""

    api_url: str
    admin_url: str
    engine_socket: str
    children: tuple[Child, ...]

    def dead_child(self) -> Child | None:
        """A child that has exited, if any."""
        return next((child for child in self.children if not child.alive()), None)


class UpError(RuntimeError):
    """``up`` could not start; the message says why."""


def check_port_free(address: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` and fail with a clear message if the port is taken."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise UpError(f"expected HOST:PORT, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    port = int(port_text)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise UpError(f"{host}:{port} is not available ({error.strerror}); "
                          f"choose another with --listen/--admin-listen") from None
    return host, port


def _tiny_built() -> bool:
    """Whether the engine will find the tiny model built (the cache it reads is ours too)."""
    from tokenwire.engine.tiny import tiny_model_path

    return (tiny_model_path() / "config.json").exists()


def _engine_ready(socket_path: str) -> bool:
    """True once the engine answers ``GET /health`` on its Unix socket."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(2)
            conn.connect(socket_path)
            conn.sendall(b"GET /health HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n")
            return conn.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _wait(child: Child, ready: threading.Event | None, probe: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise UpError(f"the {child.name} exited ({child.process.returncode}):\n{child.last_words()}")
        if (ready is not None and ready.is_set()) or (probe is not None and _engine_ready(probe)):
            return
        time.sleep(0.2)
    raise UpError(f"the {child.name} did not become ready in {timeout_s:g} s:\n{child.last_words()}")


@contextlib.contextmanager
def running(*, listen: str, admin_listen: str, model: str, sidecar_args: Sequence[str] = (),
            echo: bool = False, announce: bool = True) -> Iterator[Endpoints]:
    """Start engine and sidecar; yield their endpoints; stop both on exit."""
    host, port = check_port_free(listen)
    admin_host, admin_port = check_port_free(admin_listen)
    workdir = Path(tempfile.mkdtemp(prefix="tokenwire-up-"))
    engine_socket = str(workdir / "engine.sock")
    python = sys.executable
    children: list[Child] = []
    try:
        if announce:
            building = "; it is built first, about a minute" if model == "tiny" and not _tiny_built() else ""
            print(f"starting the engine (model {model}{building})...", file=sys.stderr, flush=True)
        engine = Child("engine", [python, "-m", "tokenwire.engine.server", "--listen",
                                  f"unix:{engine_socket}", "--model", model], echo=echo,
                       relay=("building the tiny model", "built the tiny model") if announce else ())
        children.append(engine)
        _wait(engine, None, engine_socket, _ENGINE_START_TIMEOUT_S)
        sidecar = Child("sidecar", [python, "-m", "tokenwire.sidecar", "sidecar",
                                    "--listen", f"{host}:{port}", "--upstream", f"unix:{engine_socket}",
                                    "--admin-listen", f"{admin_host}:{admin_port}",
                                    *(arg for origin in admin_origins(admin_host, admin_port)
                                      for arg in ("--cors-allow-origin", origin)),
                                    *sidecar_args], echo=echo)
        children.append(sidecar)
        _wait(sidecar, sidecar.ready, None, _SIDECAR_START_TIMEOUT_S)
        yield Endpoints(api_url=f"http://{host}:{port}", admin_url=f"http://{admin_host}:{admin_port}",
                        engine_socket=engine_socket, children=tuple(children))
    finally:
        for child in reversed(children):
            child.stop()
        with contextlib.suppress(OSError):
            os.unlink(engine_socket)
        with contextlib.suppress(OSError):
            workdir.rmdir()


def banner(endpoints: Endpoints, model: str) -> str:
    """What to paste to try it: curl and the OpenAI SDK."""
    api = endpoints.api_url
    return f"""
tokenwire is up
  API (sidecar, OpenAI-compatible)  {api}/v1
  playground (open in a browser)    {endpoints.admin_url}/
  admin (metrics, streams)          {endpoints.admin_url}/metrics  {endpoints.admin_url}/streams
  engine (behind the sidecar)       unix:{endpoints.engine_socket}

try it:
  curl -N {api}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "stream": true,
         "messages": [{{"role": "user", "content": "Tell me about the sea."}}]}}'

  python -c "from openai import OpenAI
for c in OpenAI(base_url='{api}/v1', api_key='none').chat.completions.create(
        model='{model}', stream=True, messages=[{{'role': 'user', 'content': 'Hello'}}]):
    print(c.choices[0].delta.content or '', end='', flush=True)"

Ctrl-C stops both.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire up`` flags."""
    parser.description = ("The engine (tiny model) and a sidecar in front of it, joined by a Unix "
                          "socket, with resume on; prints where to point a client. Ctrl-C stops both.")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="sidecar address (default %(default)s)")
    parser.add_argument("--admin-listen", default="127.0.0.1:8081",
                        help="admin address: playground, metrics, streams (default %(default)s)")
    parser.add_argument("--model", default="tiny", help="tiny (built locally) or a model folder")
    parser.add_argument("--verbose", action="store_true", help="echo the children's logs")


def main(argv: Sequence[str] | None = None) -> int:
    """``tokenwire up``: start both, print the banner, wait; non-zero if a child died."""
    parser = argparse.ArgumentParser(prog="tokenwire up", allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    # SIGTERM stops us like Ctrl-C does, also while the children start, so
    # the context manager's cleanup always stops them.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with running(listen=args.listen, admin_listen=args.admin_listen, model=args.model,
                     sidecar_args=_UP_SIDECAR_ARGS, echo=args.verbose) as endpoints:
            print(banner(endpoints, args.model), flush=True)
            while (dead := endpoints.dead_child()) is None:
                time.sleep(0.5)
            raise UpError(f"the {dead.name} exited ({dead.process.returncode}):\n{dead.last_words()}")
    except UpError as error:
        print(f"tokenwire up: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    return 0
