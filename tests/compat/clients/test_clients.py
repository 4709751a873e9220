"""Every client x every wire feature x both drivers, each compared with the
same client reading the same upstream script directly.

A row fails on any difference between what the client accumulated through
tokenwire and directly, unless README.md documents it as intended
(``outcome.compare``). Beside the comparison, each row checks what only
tokenwire can show: the upstream requests it caused (no retry storm), and
from the accounting record that a slow reader's events really were merged
and that heartbeats really were sent during a silent prefill.

Cases run in batches the first time a row needs one, many at once except
the slow readers: the Python clients' cases in threads of the test process,
the Node clients' in one ``node`` process, the browser clients' in one page
per server (headless Chromium).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from .outcome import Outcome, compare
from .py_clients import H2_CLIENTS, PY_CLIENTS, speaks_h2
from .scripts import FEATURES, PROFILE, SLOW_FEATURES
from .servers import DRIVERS, TARGETS, Servers, stall_max_s

NODE_DIR = Path(__file__).resolve().parent / "node"
NODE_CLIENTS = ("openai-node", "eventsource")
BROWSER_CLIENTS = ("browser-eventsource", "browser-fetch")
CLIENTS = (*PY_CLIENTS, *NODE_CLIENTS, *BROWSER_CLIENTS)
PYTHON_THREADS = 12
# The first case asked of a batch runs the whole batch (hundreds of cases): on a
# busy machine that takes longer than the suite's default per-test timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BROWSER_REPEATS = 8
GET_CLIENTS = frozenset({"browser-eventsource"})
"""A browser ``EventSource`` can only GET; every other client POSTs."""
CLOSE_AT_DONE = frozenset({"eventsource", "browser-eventsource"})
ROWS_ENV = "TOKENWIRE_GRID_ROWS"
"""``client.feature,...``: the batches run only these rows' cases (for a pass
over a few rows: ``test_pure_python.py``); unset, every case."""


def wanted(client: str, feature: str) -> bool:
    """Whether the batches run ``client`` x ``feature`` (see :data:`ROWS_ENV`)."""
    rows = os.environ.get(ROWS_ENV)
    return not rows or f"{client}.{feature}" in rows.split(",")


def case_id(client: str, feature: str, target: str) -> str:
    return f"{client}.{feature}.{target}"


def base_url(servers: Servers, client: str, feature: str, target: str) -> str:
    """The OpenAI ``base_url`` of one case (its path names the case and the script)."""
    root = servers.url(target, PROFILE.get(feature, "plain"))
    return f"{root}/{case_id(client, feature, target)}/{feature}/v1"


def stall_spec(servers: Servers, client: str, feature: str, target: str) -> dict[str, Any] | None:
    """How a Node or browser slow reader stalls: polls ``url`` until ``yes``, at most ``max_ms``."""
    if feature not in SLOW_FEATURES:
        return None
    key = case_id(client, feature, target)
    return {"url": f"{servers.url('direct', 'plain')}/finished/{key}", "max_ms": int(stall_max_s(key) * 1000)}


def _reachable(servers: Servers, target: str, feature: str) -> bool:
    return (target, PROFILE.get(feature, "plain")) not in servers.broken


def run_node(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Node cases, run by one ``node`` process (the npm packages come from
    ``scripts/node-deps.sh``): each case's outcome as JSON."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("no node: run scripts/system-deps.sh nodejs npm", pytrace=False)
    if not (NODE_DIR / "node_modules").is_dir():
        pytest.fail("the npm packages are missing: run scripts/node-deps.sh", pytrace=False)
    done = subprocess.run([node, str(NODE_DIR / "run_cases.mjs")], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=300, cwd=NODE_DIR)
    assert done.returncode == 0, f"node failed: {done.stderr[-3000:]}"
    results: dict[str, Any] = json.loads(done.stdout)
    return results


@pytest.fixture(scope="module")
def node_outcomes(servers: Servers) -> dict[str, Outcome]:
    """Every Node case of the grid, in one ``node`` process."""
    cases = [{"id": case_id(client, feature, target), "client": client,
              "base_url": base_url(servers, client, feature, target),
              "stall": stall_spec(servers, client, feature, target)}
             for client in NODE_CLIENTS for feature in FEATURES for target in TARGETS
             if _reachable(servers, target, feature) and wanted(client, feature)]
    return {key: Outcome.from_json(value) for key, value in run_node(cases).items()}


@pytest.fixture(scope="module")
def browser_outcomes(servers: Servers, browser: Any) -> dict[str, Outcome]:
    """Every browser case: one page per server, loaded from that server itself
    (``/page``), so the streams it reads are same-origin."""
    results: dict[str, Outcome] = {}
    for target in TARGETS:
        for profile in sorted({PROFILE.get(f, "plain") for f in FEATURES}):
            if (target, profile) in servers.broken or (target == "direct" and profile != "plain"):
                continue
            for slow in (False, True):
                if slow and profile != "plain":
                    continue
                features = [f for f in FEATURES if (f in SLOW_FEATURES) == slow
                            and (target == "direct" or PROFILE.get(f, "plain") == profile)]
                # The slow cases' page and streams come over a slow link (servers.SlowLink).
                origin = servers.url(f"slow-link-{target}" if slow else target, profile)
                results.update(_browser_cases(browser, servers, origin, target, features))
    return results


def _repeated(key: str, feature: str) -> list[str]:
    """A browser reads a body cut after its last event short now and then: such
    cases run ``BROWSER_REPEATS`` times (``key``, ``key~1``...), each compared."""
    count = BROWSER_REPEATS if feature in ("error_mid_stream", "upstream_death") else 1
    return [key, *(f"{key}~{i}" for i in range(1, count))]


def _browser_cases(browser: Any, servers: Servers, origin: str, target: str,
                   features: list[str]) -> dict[str, Outcome]:
    """One page from ``origin`` runs the cases; all at once, but slow readers one by one."""
    cases = [{"id": key, "client": client, "url": f"/{key}/{feature}/v1/chat/completions",
              "stall": stall_spec(servers, client, feature, target)}
             for feature in features for client in BROWSER_CLIENTS if wanted(client, feature)
             for key in _repeated(case_id(client, feature, target), feature)]
    if not cases:
        return {}
    page = browser.new_page()
    try:
        page.goto(f"{origin}/page")
        together = [c for c in cases if c["stall"] is None]
        slow = [c for c in cases if c["stall"] is not None]
        raws = page.evaluate("cs => Promise.all(cs.map(c => window.runCase(c)))", together)
        raws += [page.evaluate("c => window.runCase(c)", c) for c in slow]
    finally:
        page.close()
    return {c["id"]: Outcome.from_json(raw) for c, raw in zip(together + slow, raws, strict=True)}


@pytest.fixture(scope="module")
def python_outcomes(servers: Servers) -> dict[str, Outcome]:
    """Every Python case: all at once in threads (most of a case is waiting:
    retries' backoff, silences), the slow readers one by one after."""
    cases = [(client, feature, target) for client in PY_CLIENTS for feature in FEATURES
             for target in TARGETS if _reachable(servers, target, feature) and wanted(client, feature)]

    def run(client: str, feature: str, target: str) -> Outcome:
        key = case_id(client, feature, target)
        stall = (lambda: servers.stall(key)) if feature in SLOW_FEATURES else None
        return PY_CLIENTS[client](base_url(servers, client, feature, target), stall)

    with ThreadPoolExecutor(max_workers=PYTHON_THREADS) as pool:
        futures = {case_id(*case): pool.submit(run, *case) for case in cases if case[1] not in SLOW_FEATURES}
        results = {key: future.result() for key, future in futures.items()}
    results.update({case_id(*case): run(*case) for case in cases if case[1] in SLOW_FEATURES})
    return results


@pytest.fixture(scope="module")
def outcome_of(request: pytest.FixtureRequest,
               servers: Servers) -> Iterator[Callable[[str, str, str], Outcome]]:
    """``outcome_of(client, feature, target)``: look one case up in its batch
    (which runs the first time one of its cases is asked for)."""

    def get(client: str, feature: str, target: str) -> Outcome:
        if client in NODE_CLIENTS:
            batch = request.getfixturevalue("node_outcomes")
        elif client in BROWSER_CLIENTS:
            batch = request.getfixturevalue("browser_outcomes")
        else:
            batch = request.getfixturevalue("python_outcomes")
        servers.url(target, PROFILE.get(feature, "plain"))  # a broken target fails here, by name
        return batch[case_id(client, feature, target)]

    yield get


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("client", CLIENTS)
def test_client_through_tokenwire_as_directly(client: str, feature: str, driver: str, servers: Servers,
                                              outcome_of: Callable[[str, str, str], Outcome],
                                              request: pytest.FixtureRequest) -> None:
    direct = outcome_of(client, feature, "direct")
    through = outcome_of(client, feature, driver)
    compare(feature, client, direct, through)
    if client in BROWSER_CLIENTS:
        batch = request.getfixturevalue("browser_outcomes")
        for key in _repeated(case_id(client, feature, driver), feature)[1:]:
            compare(feature, client, direct, batch[key])

    requests_direct = len(servers.upstream.requests[case_id(client, feature, "direct")])
    requests_through = len(servers.upstream.requests[case_id(client, feature, driver)])
    if feature == "error_first_event":
        assert requests_through == 1, f"an engine's error was retried: {requests_through} requests"
    elif driver == "sidecar" and (feature == "upstream_503"
                                  or (feature == "upstream_502" and client in GET_CLIENTS)):
        # A 503 says the upstream did not take the request on, and a GET may be
        # repeated: the sidecar retries them (a POST's 502 it does not), and the
        # client must not multiply that (x-should-retry: false).
        assert requests_through == 1 + servers.sidecar_retries, \
            f"{requests_through} upstream requests (direct: {requests_direct})"
    else:
        assert requests_through == requests_direct, \
            f"{requests_through} upstream requests through tokenwire, {requests_direct} directly"

    if feature in SLOW_FEATURES:
        record = servers.record_of(case_id(client, feature, driver))
        # An EventSource is closed at [DONE], maybe before the upstream's own end.
        ends = ("complete", "client_gone") if client in CLOSE_AT_DONE else ("complete",)
        assert record.end_reason in ends, record
        assert record.coalesced_events > 0, f"the slow reader got no merged event: {record}"
    if feature == "heartbeat":
        record = servers.record_of(case_id(client, feature, driver))
        assert record.heartbeats > 0, f"no heartbeat during the silent prefill: {record}"


# Two rows beside the grid: one client, one feature each.

Reconnects = dict[str, tuple[Outcome, list[str | None]]]
"""Case → (outcome, the ``Last-Event-ID`` of each request the client made)."""


def row_url(servers: Servers, link: str, profile: str, case: str, script: str) -> str:
    """The OpenAI ``base_url`` of a row's case: ``case`` reads upstream ``script``."""
    return f"{servers.url(link, profile)}/{case}/{script}/v1"


@pytest.fixture(scope="module")
def reconnect_outcomes(servers: Servers) -> Reconnects:
    """The ``eventsource`` package with resume on and a resume grace, its first
    connection cut mid-answer (``servers.SlowLink``, ``cut-link-<driver>``): it
    reconnects by itself, re-sending its POST with ``Last-Event-ID``. Directly
    the same client reads the same script whole. Each outcome comes with the
    ``Last-Event-ID`` of every request the client made."""
    cases = [{"id": case_id("eventsource", "reconnect", "direct"), "client": "eventsource",
              "base_url": row_url(servers, "direct", "plain", case_id("eventsource", "reconnect", "direct"),
                                  "resume"), "stall": None, "reconnect": True}]
    cases += [{"id": case_id("eventsource", "reconnect", driver), "client": "eventsource",
               "base_url": row_url(servers, f"cut-link-{driver}", "reconnect",
                                   case_id("eventsource", "reconnect", driver), "resume"),
               "stall": None, "reconnect": True} for driver in DRIVERS]
    results = {}
    for key, value in run_node(cases).items():
        sent = value.pop("last_event_ids")
        results[key] = (Outcome.from_json(value), sent)
    return results


@pytest.mark.parametrize("driver", DRIVERS)
def test_eventsource_reconnects_by_itself_and_gets_the_answer_once(
        driver: str, servers: Servers, reconnect_outcomes: Reconnects) -> None:
    direct, sent_direct = reconnect_outcomes[case_id("eventsource", "reconnect", "direct")]
    key = case_id("eventsource", "reconnect", driver)
    through, sent = reconnect_outcomes[key]
    assert sent_direct == [None], f"the direct read was not one request: {sent_direct}"
    # The first connection was cut mid-answer, and the package re-sent its POST
    # naming the last event it had: an id tokenwire gave it, not its last one.
    assert len(sent) == 2 and sent[0] is None, f"requests' Last-Event-ID: {sent} ({through})"
    assert sent[1] in through.ids[:-1], f"re-sent Last-Event-ID {sent[1]!r}, ids seen {through.ids}"
    assert len(set(through.ids)) == len(through.ids), f"an event came twice: {through.ids}"
    # No duplicate, no gap: what it accumulated is the direct read's, exactly.
    compare("resume", "eventsource", direct, through)
    assert through.done and through.error is None, through
    requests = servers.upstream.requests[key]
    assert len(requests) == 1, f"the reconnect reached the upstream: {requests}"


@pytest.fixture(scope="module")
def drop_outcomes(servers: Servers) -> dict[str, Outcome]:
    """openai-python (sync) as a slow reader of the ``slow_reader`` script,
    directly and through tokenwire under the drop policy (profile ``drop``)."""
    client = PY_CLIENTS["openai-sync"]
    results = {}
    for target in TARGETS:
        key = case_id("openai-sync", "drop_policy", target)
        url = row_url(servers, target, "plain" if target == "direct" else "drop", key, "slow_reader")
        results[target] = client(url, partial(servers.stall, key))
    return results


@pytest.mark.parametrize("driver", DRIVERS)
def test_drop_policy_never_drops_an_openai_answer(driver: str, servers: Servers,
                                                   drop_outcomes: dict[str, Outcome]) -> None:
    compare("slow_reader", "openai-sync", drop_outcomes["direct"], drop_outcomes[driver])
    record = servers.record_of(case_id("openai-sync", "drop_policy", driver))
    assert record.end_reason.value == "complete", record
    assert record.coalesced_events > 0, f"the slow reader got no merged event: {record}"
    assert record.dropped_events == 0, f"events of an OpenAI answer were dropped: {record}"
    assert len(servers.upstream.requests[case_id("openai-sync", "drop_policy", driver)]) == 1


def test_h2_rows_speak_http2_to_the_sidecar_only(servers: Servers) -> None:
    """The ``-h2`` rows compare an HTTP/1.1 read (direct, middleware) with an
    HTTP/2 one (sidecar): that only holds if the sidecar is the one speaking it."""
    assert speaks_h2(servers.url("sidecar", "plain"))
    assert not speaks_h2(servers.url("direct", "plain"))
    assert not speaks_h2(servers.url("middleware", "plain"))


@pytest.mark.parametrize("client", sorted(H2_CLIENTS))
def test_h2_row_reached_the_sidecar_over_http2(client: str, servers: Servers,
                                               outcome_of: Callable[[str, str, str], Outcome]) -> None:
    """Each ``-h2`` row's client really spoke HTTP/2 to the sidecar (a client
    that quietly fell back to HTTP/1.1 would make its row a copy of the plain
    one), and its plain row's HTTP/1.1 twin did not."""
    outcome_of(client, "plain", "sidecar")  # runs the batch
    spoken = {}
    for name in (client, client.removesuffix("-h2")):
        record = servers.record_of(case_id(name, "plain", "sidecar"))
        spoken[name] = servers.http_versions[record.request_id]
    assert spoken == {client: "2", client.removesuffix("-h2"): "1.1"}
