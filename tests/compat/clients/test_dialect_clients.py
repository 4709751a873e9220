"""The dialect rows of the client grid: Anthropic Messages and OpenAI Responses
clients (and the Vercel AI SDK's ``openai.chat`` on Chat Completions), each
reading the same upstream script directly and through tokenwire (the sidecar,
and the ASGI middleware under uvicorn), compared as README.md ("Dialect rows")
says.

Each row also checks the upstream requests its case caused (as many as
directly), that the client asked for its dialect's route, and, for a slow
reader, from the accounting record, that the stream completed and its events
were merged; for a silent prefill (``heartbeats``, read through the
``heartbeat`` profile), that heartbeats were written and the engine's own
keepalives (Anthropic's ``ping``) were counted and forwarded as they came.
Cases run in batches the first time a row needs one: the Python clients' in
threads (the slow readers one by one after), the Node clients' in one
``node`` process beside them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .dialect_clients import (
    ANTHROPIC_CLIENTS,
    RESPONSES_CLIENTS,
    DialectOutcome,
    Stall,
    from_node,
    running_dialect_servers,
    wait_settled,
)
from .dialect_outcome import assert_tokenwire_ending, compare
from .dialect_scripts import (
    FEATURES,
    HEARTBEAT_FEATURES,
    PROFILE,
    ROUTES,
    SLOW_FEATURES,
    TOKENWIRE_ENDINGS,
    script_bytes,
    script_keepalives,
    script_name,
)
from .py_clients import speaks_h2
from .servers import DRIVERS, TARGETS, Servers, stall_max_s

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              # litellm's own usage objects, as it dumps them
              pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")]

NODE_DIR = Path(__file__).resolve().parent / "node"
PY_CLIENTS: dict[str, dict[str, Callable[[str, Stall | None], DialectOutcome]]] = {
    "anthropic": ANTHROPIC_CLIENTS, "responses": RESPONSES_CLIENTS, "chat": {}}
NODE_CLIENTS: dict[str, tuple[str, ...]] = {
    "anthropic": ("anthropic-ts-stream", "anthropic-ts-create", "ai-sdk-anthropic"),
    "responses": ("openai-node-responses-create", "openai-node-responses-stream", "ai-sdk-openai-responses"),
    "chat": ("ai-sdk-openai-chat",),
}
AT_ROOT = frozenset({"anthropic-stream", "anthropic-create", "anthropic-stream-h2", "anthropic-create-h2",
                     "langchain-anthropic", "litellm-anthropic", "anthropic-ts-stream",
                     "anthropic-ts-create"})
"""Clients configured with the server's root (they add ``/v1/messages``); the
rest with ``.../v1``."""
H2_CLIENTS = ("anthropic-stream-h2", "anthropic-create-h2", "openai-responses-create-h2",
              "openai-responses-stream-h2")
ENDS_AT_STOP_REASON = frozenset({("litellm-anthropic", "eof_no_terminal")})
"""litellm's Anthropic provider ends its stream at ``message_delta``'s stop reason
and reads nothing after it: an error event after it (tokenwire's, for a
missing ``message_stop``) never reaches the application (checked: an upstream
``overloaded_error`` there is not raised either). Its row is compared as
directly (the whole answer, no error), and the record says tokenwire failed it."""
PYTHON_THREADS = 12
HEARTBEAT = b": keepalive\n"
"""tokenwire's heartbeat: a comment line, no blank line after it."""
WIRE_CASES = [(dialect, feature) for dialect in FEATURES for feature in FEATURES[dialect]
              if feature in HEARTBEAT_FEATURES]
"""The silent prefills, also read by plain HTTP (``test_heartbeats_on_the_wire``)."""
ROWS = [(dialect, client, feature) for dialect in FEATURES
        for client in (*PY_CLIENTS[dialect], *NODE_CLIENTS[dialect]) for feature in FEATURES[dialect]]


def case_id(client: str, feature: str, target: str) -> str:
    return f"{client}.{feature}.{target}"


def base_url(servers: Servers, dialect: str, client: str, feature: str, target: str) -> str:
    """The base URL one case's client is configured with (its path names the case and the script)."""
    case = case_id(client, feature, target)
    root = f"{servers.url(target, PROFILE.get(feature, 'plain'))}/{case}/{script_name(dialect, feature)}"
    return root if client in AT_ROOT else f"{root}/v1"


def stall_spec(servers: Servers, feature: str, case: str) -> dict[str, Any] | None:
    """How a Node slow reader stalls: polls ``url`` until ``yes``, at most ``max_ms``."""
    if feature not in SLOW_FEATURES:
        return None
    return {"url": f"{servers.url('direct', 'plain')}/finished/{case}",
            "max_ms": int(stall_max_s(case) * 1000)}


@pytest.fixture(scope="module")
def dialect_servers() -> Iterator[Servers]:
    with running_dialect_servers() as running:
        yield running


def _run_node(cases: list[dict[str, Any]]) -> dict[str, DialectOutcome]:
    node = shutil.which("node")
    if node is None:
        raise AssertionError("no node: run scripts/system-deps.sh nodejs npm")
    for package in ("@anthropic-ai/sdk", "ai", "@ai-sdk/openai", "@ai-sdk/anthropic", "openai"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            raise AssertionError(f"the npm package {package} is missing: run scripts/node-deps.sh")
    done = subprocess.run([node, str(NODE_DIR / "dialect_cases.mjs")], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=400, cwd=NODE_DIR)
    assert done.returncode == 0, f"node failed: {done.stderr[-3000:]}"
    return {key: from_node(value) for key, value in json.loads(done.stdout).items()}


@pytest.fixture(scope="module")
def outcomes(dialect_servers: Servers) -> dict[str, DialectOutcome]:
    """Every case: the Node ones in one ``node`` process (in a thread of its own),
    meanwhile the Python ones in threads, their slow readers one by one after."""
    servers = dialect_servers
    node_cases = [{"id": case_id(client, feature, target), "client": client,
                   "base_url": base_url(servers, dialect, client, feature, target),
                   "stall": stall_spec(servers, feature, case_id(client, feature, target))}
                  for dialect, client, feature in ROWS if client in NODE_CLIENTS[dialect]
                  for target in TARGETS]
    py_cases = [(dialect, client, feature, target) for dialect, client, feature in ROWS
                if client in PY_CLIENTS[dialect] for target in TARGETS]
    fast = [case for case in py_cases if case[2] not in SLOW_FEATURES]
    slow = [case for case in py_cases if case[2] in SLOW_FEATURES]

    def run(dialect: str, client: str, feature: str, target: str) -> DialectOutcome:
        key = case_id(client, feature, target)
        stall = (lambda: wait_settled(servers, key)) if feature in SLOW_FEATURES else None
        return PY_CLIENTS[dialect][client](base_url(servers, dialect, client, feature, target), stall)

    with ThreadPoolExecutor(max_workers=PYTHON_THREADS + 1) as pool:
        node = pool.submit(_run_node, node_cases)
        futures = {case_id(*case[1:]): pool.submit(run, *case) for case in fast}
        results = {key: future.result() for key, future in futures.items()}
        results.update({case_id(*case[1:]): run(*case) for case in slow})
        results.update(node.result())
    return results


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(("dialect", "client", "feature"), ROWS, ids=[f"{c}-{f}" for _, c, f in ROWS])
def test_dialect_client_through_tokenwire_as_directly(dialect: str, client: str, feature: str, driver: str,
                                                      dialect_servers: Servers,
                                                      outcomes: dict[str, DialectOutcome]) -> None:
    servers = dialect_servers
    direct = outcomes[case_id(client, feature, "direct")]
    through = outcomes[case_id(client, feature, driver)]
    for target in ("direct", driver):
        paths = servers.upstream.paths[case_id(client, feature, target)]  # type: ignore[attr-defined]
        assert paths and all(p.endswith(f"/v1/{ROUTES[dialect]}") for p in paths), \
            f"{target}: the client did not ask for the {dialect} route: {paths}"
    if feature in TOKENWIRE_ENDINGS:
        record = servers.record_of(case_id(client, feature, driver))
        assert record.error_code is not None and record.error_code.value == "upstream_failed", \
            f"tokenwire did not record the stream as failed: {record}"
        if (client, feature) in ENDS_AT_STOP_REASON:
            compare(dialect, feature, client, direct, through)
        else:
            assert_tokenwire_ending(dialect, feature, client, direct, through)
    else:
        compare(dialect, feature, client, direct, through)

    requests_direct = len(servers.upstream.requests[case_id(client, feature, "direct")])
    requests_through = len(servers.upstream.requests[case_id(client, feature, driver)])
    assert requests_through == requests_direct, \
        f"{requests_through} upstream requests through tokenwire, {requests_direct} directly"
    if feature in SLOW_FEATURES:
        record = servers.record_of(case_id(client, feature, driver))
        assert record.end_reason.value == "complete", record
        assert record.coalesced_events > 0, f"the slow reader got no merged event: {record}"
    if feature in HEARTBEAT_FEATURES:
        assert_heartbeats(servers, dialect, client, feature, driver, direct, through)


def assert_heartbeats(servers: Servers, dialect: str, client: str, feature: str, driver: str,
                      direct: DialectOutcome, through: DialectOutcome) -> None:
    """The silent prefill: the stream completed, tokenwire wrote heartbeats, and
    the engine's own keepalives (``ping``) were counted and reached the client as
    they came (the SDKs drop ``ping`` before the application sees it: the bytes
    are checked on the wire, by ``test_heartbeats_on_the_wire``)."""
    record = servers.record_of(case_id(client, feature, driver))
    assert record.end_reason.value == "complete", record
    assert record.heartbeats > 0, f"no heartbeat during the silent prefill: {record}"
    pings = script_keepalives(script_name(dialect, feature))
    assert record.upstream_keepalives == pings, \
        f"{record.upstream_keepalives} upstream keepalives recorded, the script sent {pings}: {record}"
    for target, out in (("direct", direct), (driver, through)):
        assert out.error is None, f"{target}: {out.error}"


def test_slow_scripts_are_the_sizes_the_readme_gives() -> None:
    """~1 MB of Anthropic events and ~2.3 MB of Responses events, most of the
    latter envelopes: unmerged, each is more than a stalled client's kernel
    buffers hold; the Responses one twice ``max_pending_bytes``."""
    assert 0.9e6 < script_bytes("anthropic_slow_reader") < 1.2e6
    assert 2.2e6 < script_bytes("responses_slow_reader") < 2.5e6


@pytest.mark.parametrize("client", H2_CLIENTS)
def test_h2_row_reached_the_sidecar_over_http2(client: str, dialect_servers: Servers,
                                               outcomes: dict[str, DialectOutcome]) -> None:
    """Each ``-h2`` client really spoke HTTP/2 to the sidecar (and its plain twin
    HTTP/1.1): one that fell back quietly would make its rows copies."""
    servers = dialect_servers
    assert speaks_h2(servers.url("sidecar", "plain")) and not speaks_h2(servers.url("middleware", "plain"))
    spoken = {}
    for name in (client, client.removesuffix("-h2")):
        record = servers.record_of(case_id(name, "text", "sidecar"))
        spoken[name] = servers.http_versions[record.request_id]
    assert spoken == {client: "2", client.removesuffix("-h2"): "1.1"}


def wire_client(dialect: str) -> str:
    """The bare HTTP reader's name in its case ids (configured with ``.../v1``)."""
    return f"raw-http-{dialect}"


@pytest.fixture(scope="module")
def wire_bodies(dialect_servers: Servers) -> dict[str, bytes]:
    """Each silent prefill's body as it came on the wire, read with a bare HTTP
    client (no SDK between), directly and through each driver, all at once."""
    servers = dialect_servers

    def read(dialect: str, feature: str, target: str) -> bytes:
        url = f"{base_url(servers, dialect, wire_client(dialect), feature, target)}/{ROUTES[dialect]}"
        with httpx.stream("POST", url, json={"stream": True}, timeout=30) as response:
            assert response.status_code == 200, response
            return b"".join(response.iter_raw())

    cases = [(dialect, feature, target) for dialect, feature in WIRE_CASES for target in TARGETS]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = {case_id(wire_client(dialect), feature, target): pool.submit(read, dialect, feature, target)
                   for dialect, feature, target in cases}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(("dialect", "feature"), WIRE_CASES, ids=[f"{d}-{f}" for d, f in WIRE_CASES])
def test_heartbeats_on_the_wire(dialect: str, feature: str, driver: str, dialect_servers: Servers,
                                wire_bodies: dict[str, bytes]) -> None:
    """What the SDKs hide (they skip comments, and Anthropic's drop ``ping``): through
    tokenwire the body is the upstream's byte for byte, with heartbeat lines between
    its events only (after an event's blank line, none after them), as many as the
    record says, several during the prefill; the engine's pings are there as they came."""
    direct = wire_bodies[case_id(wire_client(dialect), feature, "direct")]
    through = wire_bodies[case_id(wire_client(dialect), feature, driver)]
    assert HEARTBEAT not in direct
    assert through.replace(HEARTBEAT, b"") == direct, "through tokenwire, beside heartbeats, the body differs"
    beats = [m.start() for m in re.finditer(re.escape(HEARTBEAT), through)]
    assert all(through[:at].endswith((b"\n\n", HEARTBEAT)) for at in beats), "a heartbeat inside an event"
    assert not any(through[at + len(HEARTBEAT):].startswith(b"\n") for at in beats), \
        "a blank line after a heartbeat (it would end an empty event)"
    record = dialect_servers.record_of(case_id(wire_client(dialect), feature, driver))
    assert record.end_reason.value == "complete", record
    assert len(beats) == record.heartbeats >= 2, f"{len(beats)} heartbeats on the wire: {record}"
    pings = script_keepalives(script_name(dialect, feature))
    assert through.count(b'event: ping\ndata: {"type":"ping"}\n\n') == pings == record.upstream_keepalives
