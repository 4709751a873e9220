"""Every request of the payload corpus against the sidecar, compared with a
checked-in expectation: what the client was answered and what reached the
upstream.

The corpus (``payloads/corpus.jsonl``, see ``payloads/README.md``) holds raw
requests: malformed request lines, header and framing ambiguities, smuggling
mutations, spoofed forwarding headers, pipelines. Each is sent on its own
connection to one sidecar in front of a :class:`ScriptedUpstream`, which
records every byte it receives; the connection is read until the sidecar
closes it (a short keep-alive timeout ends the well-formed ones). The outcome
of each case, the statuses in order and each forwarded request (its line,
headers minus the per-run ones, and body), must equal
``payloads/expected.json``. A change in behaviour shows as a diff to review;
``TOKENWIRE_UPDATE_CORPUS=1`` rewrites the file instead (then read the diff).

Independently of the file, every case must hold the invariants a smuggling
defence rests on: nothing forwarded with a framing other than one
Content-Length, nothing forwarded for a request refused, and no error message
that quotes bytes back as a Python repr.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningSidecar
from upstreams import ScriptedUpstream

PAYLOADS = Path(__file__).resolve().parent / "payloads"
CORPUS = PAYLOADS / "corpus.jsonl"
EXPECTED = PAYLOADS / "expected.json"
# Different on every run, so not compared: the sidecar's request id, the ports.
_VOLATILE = frozenset({"x-request-id", "host", "x-forwarded-port"})


def _cases() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    data = bytearray()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not got:
            break
        data += got
    return bytes(data)


def _responses(data: bytes) -> list[dict[str, Any]]:
    """The responses in ``data``: status and, for the sidecar's own errors, the message."""
    found: list[dict[str, Any]] = []
    at = 0
    while at < len(data):
        end = data.find(b"\r\n\r\n", at)
        if end == -1:
            found.append({"status": None, "truncated": data[at:at + 60].decode("latin-1")})
            break
        head = data[at:end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        status = int(head[0].split(" ")[1])
        body_start = end + 4
        if headers.get("transfer-encoding") == "chunked":
            body, at = b"", body_start
            while True:
                line_end = data.index(b"\r\n", at)
                size = int(data[at:line_end], 16)
                body += data[line_end + 2:line_end + 2 + size]
                at = line_end + 2 + size + 2
                if size == 0:
                    break
        elif 100 <= status < 200:
            body, at = b"", body_start
        else:
            length = int(headers.get("content-length", "0"))
            body, at = data[body_start:body_start + length], body_start + length
        response: dict[str, Any] = {"status": status}
        if headers.get("content-type") == "application/json" and b'"error"' in body:
            response["message"] = json.loads(body)["error"]["message"]
        found.append(response)
    return found


def _forwarded(received: bytes) -> list[dict[str, Any]]:
    """The requests in what the upstream received (always Content-Length framed)."""
    requests: list[dict[str, Any]] = []
    at = 0
    while at < len(received):
        end = received.index(b"\r\n\r\n", at)
        lines = received[at:end].decode("latin-1").split("\r\n")
        headers = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
        lengths = [v for k, v in headers if k == "content-length"]
        framing = [k for k, _ in headers if k in ("content-length", "transfer-encoding")]
        assert framing == ["content-length"], f"forwarded with framing {framing}: {lines}"
        length = int(lengths[0])
        body = received[end + 4:end + 4 + length]
        at = end + 4 + length
        requests.append({
            "line": lines[0],
            "headers": [f"{k}: {v}" for k, v in headers if k not in _VOLATILE],
            "body": body.decode("latin-1"),
        })
    return requests


def _run_case(sidecar: RunningSidecar, recorder: ScriptedUpstream, raw: bytes) -> dict[str, Any]:
    before = len(recorder.received)
    with socket.create_connection((sidecar.host, sidecar.port)) as sock:
        sock.settimeout(0.2)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw)
        data = _read_until_closed(sock, timeout_s=10.0)
    # Every forwarded request was answered by the recorder before the sidecar
    # answered the client (and the client read until the sidecar closed), so
    # the recorder has seen everything it will see of this case.
    received = bytes(recorder.received[before:])
    return {"responses": _responses(data), "forwarded": _forwarded(received)}


@pytest.mark.slow  # seconds each (the README's rule): the full run has it
def test_payload_corpus_each_case_answered_and_forwarded_as_expected(
        start_sidecar: Any, recorder: ScriptedUpstream) -> None:
    # The corpus is HTTP/1.1's: with http2 on, its preface case would start HTTP/2
    # (test_http2*.py), where here it checks HTTP/1.1's answer to a version it does not serve.
    sidecar = start_sidecar(recorder.url, keepalive_timeout_s=0.05, header_read_timeout_s=0.3,
                            body_read_timeout_s=0.3, http2=False)
    cases = _cases()
    outcomes = {case["name"]: _run_case(sidecar, recorder, case["raw"].encode("latin-1"))
                for case in cases}
    for name, outcome in outcomes.items():
        statuses = [r["status"] for r in outcome["responses"]]
        assert statuses, f"{name}: no answer at all"
        for response in outcome["responses"]:
            message = response.get("message", "")
            assert not re.search(r"b'|bytearray|\\x[0-9a-f]{2}", message), f"{name}: {message!r}"
        if statuses[0] is not None and statuses[0] >= 400:
            assert outcome["forwarded"] == [], f"{name}: refused but forwarded"
    if os.environ.get("TOKENWIRE_UPDATE_CORPUS"):
        EXPECTED.write_text(json.dumps(outcomes, indent=1, ensure_ascii=True) + "\n")
        pytest.skip("expectations rewritten; review the diff")
    expected = json.loads(EXPECTED.read_text())
    assert set(outcomes) == set(expected), "the corpus and the expectations name different cases"
    differing = [name for name in outcomes if outcomes[name] != expected[name]]
    assert not differing, "\n".join(
        f"{name}:\n  expected {json.dumps(expected[name])}\n  got      {json.dumps(outcomes[name])}"
        for name in differing)
