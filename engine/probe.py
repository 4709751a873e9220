"""``python -m tokenwire.engine.probe unix:/PATH /readyz``: a probe of an engine on a Unix socket.

The kubelet's ``httpGet`` probes reach the pod's IP, and an engine that listens
only on a Unix socket (the Kubernetes example: nothing but the sidecar can
reach it) has none, so its probes are ``exec`` probes running this: one
``GET``, exit 0 on a 2xx answer, 1 on anything else (no answer within the
timeout, a refused connect, a 503 while the model loads), the status line on
stdout. The standard library only, so a probe costs an interpreter's start
(about 40 ms), not an import of the engine. ``HOST:PORT`` works too.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

_TIMEOUT_S = 2.0
_USAGE = "usage: python -m tokenwire.engine.probe unix:/PATH|HOST:PORT PATH [TIMEOUT_S]"


def probe(address: str, path: str, timeout_s: float = _TIMEOUT_S) -> int:
    """The HTTP status ``GET path`` gets at ``address`` (``unix:/PATH`` or ``HOST:PORT``); 0 if none."""
    target: str | tuple[str, int]
    if address.startswith("unix:"):
        family, target = socket.AF_UNIX, address[len("unix:"):]
    else:
        host, _, port = address.rpartition(":")
        family, target = socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))
    try:
        with socket.socket(family, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(target)
            conn.sendall(f"GET {path} HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n".encode())
            head = b""
            while b"\r\n" not in head and len(head) < 1024:
                data = conn.recv(1024)
                if not data:
                    break
                head += data
    except OSError:
        return 0
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def main(argv: Sequence[str]) -> int:
    """Exit status: 0 for a 2xx answer, 1 otherwise, 2 for bad arguments."""
    if len(argv) not in (2, 3):
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        status = probe(argv[0], argv[1], float(argv[2]) if len(argv) == 3 else _TIMEOUT_S)
    except ValueError:
        print(_USAGE, file=sys.stderr)
        return 2
    print(f"{argv[1]}: {status or 'no answer'}")
    return 0 if 200 <= status < 300 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
