"""``tokenwire drain``: drain a running sidecar and wait for its streams to end.

What a Kubernetes preStop hook of the *engine* container runs. Kubernetes stops
a pod's native sidecar only after its main containers have exited, so a
sidecar that began its drain on its own SIGTERM would find the engine already
gone and could neither finish nor hand off a stream. Instead the engine's
preStop asks the sidecar to drain (``POST /drain`` on its admin port: the
listener closes, ``/readyz`` says ``draining``, open streams finish or, with a
shared resume store, are handed to the other replicas), waits until no stream
is open, and only then lets the engine get its SIGTERM. The sidecar stays up
until its own SIGTERM, which finds nothing left.

Exit status: 0 drained (or, with ``--wait-s 0``, the drain begun), 1 streams
still open when ``--wait-s`` ran out, 2 the sidecar could not be asked (not
listening, a refused token, not a tokenwire admin port).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

_POLL_S = 0.25
_REQUEST_TIMEOUT_S = 5.0


class DrainError(Exception):
    """The sidecar's admin port could not be asked, or answered something else."""


@dataclass(frozen=True, slots=True)
class AdminPort:
    """Where the sidecar's admin port is, and the token it asks for."""

    host: str
    port: int
    token: str = ""

    def ask(self, method: str, path: str) -> dict[str, object]:
        """One admin request; its JSON answer. Raises :class:`DrainError`."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=_REQUEST_TIMEOUT_S)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as error:
            raise DrainError(f"cannot reach the admin port {self.host}:{self.port}: {error}") from None
        finally:
            connection.close()
        if response.status == 401:
            raise DrainError(f"the admin port {self.host}:{self.port} refused the token "
                             "(--token-file: the sidecar's admin_token_file)")
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if response.status >= 300 or not isinstance(answer, dict) or "open_streams" not in answer:
            raise DrainError(f"{method} {path} on {self.host}:{self.port} answered {response.status}: "
                             f"{body[:200]!r} (a tokenwire sidecar's admin port?)")
        return answer


def drain(admin: AdminPort, wait_s: float, *, say: Callable[[str], None],
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Begin the drain, then wait up to ``wait_s`` for no open stream; the exit status."""
    began = clock()
    state = admin.ask("POST", "/drain")
    say(f"draining {admin.host}:{admin.port}: {state['open_streams']} open streams")
    while state["open_streams"] and clock() - began < wait_s:
        sleep(_POLL_S)
        state = admin.ask("GET", "/drain")
    if state["open_streams"] and wait_s > 0:
        say(f"{state['open_streams']} streams still open after {wait_s:g} s (the sidecar's "
            "drain_s ends them)")
        return 1
    if wait_s > 0:
        say(f"drained in {clock() - began:.1f} s: no open stream")
    return 0


def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise DrainError(f"cannot read the token file {path}: {error}") from None
    if not token:
        raise DrainError(f"the token file {path} is empty")
    return token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire drain`` flags."""
    parser.description = ("Drain a running sidecar (as on SIGTERM, but it stays up until its own "
                          "SIGTERM) and wait for its open streams to end: a Kubernetes preStop hook "
                          "of the engine container. Exit 0 drained, 1 streams still open, 2 not asked.")
    parser.add_argument("--admin", default="127.0.0.1:9090", metavar="HOST:PORT",
                        help="the sidecar's admin port (default %(default)s)")
    parser.add_argument("--token-file", default=os.environ.get("TOKENWIRE_ADMIN_TOKEN_FILE", ""),
                        metavar="PATH", help="the admin token's file, when the admin port asks for "
                                             "one (default $TOKENWIRE_ADMIN_TOKEN_FILE)")
    parser.add_argument("--after-s", type=float, default=0.0, metavar="S",
                        help="wait this long before the drain: the pod's endpoint removal reaching "
                             "the load balancers (default %(default)s)")
    parser.add_argument("--wait-s", type=float, default=0.0, metavar="S",
                        help="wait up to this long for the open streams to end; 0 = only begin "
                             "the drain (default %(default)s)")


def main(argv: list[str] | None = None) -> int:
    """``tokenwire drain``; the exit status (module docstring)."""
    parser = argparse.ArgumentParser(prog="tokenwire drain", allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.after_s < 0 or args.wait_s < 0:
        parser.error("--after-s and --wait-s must be >= 0")
    host, sep, port = args.admin.rpartition(":")
    if not sep or not host or not port.isdigit():
        parser.error(f"--admin must be HOST:PORT, got {args.admin!r}")
    try:
        token = _read_token(args.token_file) if args.token_file else ""
        time.sleep(args.after_s)
        return drain(AdminPort(host.strip("[]"), int(port), token), args.wait_s,
                     say=lambda line: print(f"tokenwire drain: {line}", flush=True))
    except DrainError as error:
        print(f"tokenwire drain: {error}", file=sys.stderr)
        return 2
