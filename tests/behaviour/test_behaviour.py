"""The shared behaviour suite: every driver writes the same SSE bytes for the
same upstream events and client behaviour.

Each registered driver (``drivers.DRIVERS``) plays each scenario over a real
socket; its response is held to ``scenarios.reference`` — the wire core's own
output for the same inputs in virtual time — and therefore to every other
driver. Normalised away, because they legitimately differ: header order,
headers no wire rule covers (date, server, transfer framing, the request id
the sidecar echoes), the reason phrase, chunk boundaries, the wording of an
error message (it names the driver's view of the failure; its type and code
must match), and for ``timing_sensitive`` scenarios how many text deltas
happened to merge.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from tokenwire.tools.sse_client import parse_response

from .drivers import DRIVERS
from .scenarios import SCENARIOS, WireResult, reference

# Headers a driver legitimately adds on its own: the server's (date, server),
# the HTTP/1.1 framing (checked separately for SSE), and the request id the
# sidecar echoes to the client. Every other header is the core's, exactly.
DRIVER_HEADERS = frozenset({b"date", b"server", b"transfer-encoding", b"connection", b"x-request-id"})
_MESSAGE = re.compile(rb'"message":"(?:[^"\\]|\\.)*"')


def parse(raw: bytes) -> WireResult:
    """A client's view of a raw HTTP/1.1 response."""
    response = parse_response(raw)
    headers = {name.encode("latin-1"): value.encode("latin-1") for name, value in response.headers.items()}
    return WireResult(response.status, headers, response.body, complete=response.clean_end)


def merged_text_deltas(body: bytes) -> list[Any]:
    """The body's events with consecutive text deltas merged (coalescing is
    timing-dependent; the text and every barrier event are not)."""
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        if block.startswith(b"data: {"):
            obj = json.loads(block[6:])
            choices = obj.get("choices") or []
            delta = choices[0].get("delta", {}) if len(choices) == 1 else {}
            if set(delta) == {"content"} and choices[0].get("finish_reason") is None:
                if out and isinstance(out[-1], str):
                    out[-1] += delta["content"]
                else:
                    out.append(delta["content"])
                continue
        out.append(block)
    return out


def normalised(result: WireResult, *, timing_sensitive: bool) -> dict[str, Any]:
    body = _MESSAGE.sub(b'"message":"<message>"', result.body)
    return {
        "status": result.status,
        "headers": {name: value for name, value in result.headers.items() if name not in DRIVER_HEADERS},
        "body": merged_text_deltas(body) if timing_sensitive else body,
        "complete": result.complete,
    }


def run(driver_name: str, scenario_name: str) -> WireResult:
    scenario = next(s for s in SCENARIOS if s.name == scenario_name)
    return parse(asyncio.run(DRIVERS[driver_name]().run(scenario)))


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_driver_writes_the_reference_bytes(driver: str, scenario: str) -> None:
    spec = next(s for s in SCENARIOS if s.name == scenario)
    got = run(driver, scenario)
    expected = reference(spec)
    if expected.status == 200 and spec.headers[0][1] == b"text/event-stream":
        # Framing is a wire rule too: SSE responses are never length-delimited.
        assert got.headers.get(b"transfer-encoding") == b"chunked"
    assert normalised(got, timing_sensitive=spec.timing_sensitive) == \
        normalised(expected, timing_sensitive=spec.timing_sensitive)
    if spec.timing_sensitive:
        # The stalled client must have made the driver coalesce (else the
        # scenario did not test what it says).
        assert got.body.count(b"data: ") < expected.body.count(b"data: ")


def test_reference_matches_hand_written_bytes() -> None:
    """Pin a few references so the oracle itself cannot drift unnoticed."""
    chat = reference(next(s for s in SCENARIOS if s.name == "heartbeat_mid_stream"))
    assert chat.body.count(b": keepalive\n") == 2 and chat.complete
    assert chat.body.endswith(b"data: [DONE]\n\n")
    framing = reference(next(s for s in SCENARIOS if s.name == "sse_framing"))
    assert framing.body == (b"event: progress\ndata: a\ndata: b\nid: 7\nretry: 1500\n\n"
                            b"data: split across sends\n\n"
                            b"data: no-space\ndata:  two spaces\n\n"
                            b"id: 8\n\n"
                            b"data: [DONE]\n\n")
    failed = reference(next(s for s in SCENARIOS if s.name == "fail_after_events"))
    assert not failed.complete and b'"code":"upstream_failed"' in failed.body
    empty = reference(next(s for s in SCENARIOS if s.name == "empty_stream"))
    assert empty.status == 502 and empty.complete


@pytest.mark.slow
@pytest.mark.skipif(len(DRIVERS) < 2, reason="only one driver registered (the sidecar slot is empty)")
@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS if not s.timing_sensitive])
def test_drivers_write_the_same_bytes_as_each_other(scenario: str) -> None:
    results = {name: normalised(run(name, scenario), timing_sensitive=False) for name in sorted(DRIVERS)}
    first = next(iter(results.values()))
    assert all(result == first for result in results.values()), results
