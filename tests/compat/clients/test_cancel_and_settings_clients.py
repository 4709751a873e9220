"""Cancel by id and per-request settings from the clients users point at
tokenwire, on both drivers (the sidecar, and the ASGI middleware under
uvicorn), against an engine that notes when it was stopped
(``cancel_servers.py``). Resume is on with the default grace of 0, so a client
that leaves stops its answer unless it asked to keep it going
(``Tokenwire-Keep-Generating``); ``Tokenwire-Heartbeat-S: 0.1`` is asked for
and shows in the record (heartbeats during the engine's 0.35 s prefill,
where the default 15 s would give none). Every client starts its stream with
those headers, reads the stream's id as its API gives it, and is cancelled
by id while it reads (or after it left); each row asserts what the client
itself observed, and what the engine felt.

Rows (each on both drivers):

* anthropic-python ``messages.stream()`` with ``extra_headers``: the id from
  ``stream.response.headers["x-tokenwire-stream-id"]``; another caller's
  DELETE is a 404 and the stream reads on; the owner's DELETE stops the
  engine and the SDK raises the in-band cancel error (``APIStatusError``, its
  ``body`` the Anthropic error event with ``"tokenwire": {"code": "cancelled"}``);
* anthropic-python leaving its stream, with and without
  ``Tokenwire-Keep-Generating: true``: kept, the engine writes on after the
  client left until the DELETE stops it; not kept, the engine stops when the
  client leaves and a DELETE then says ``ended`` (and forgets it);
* httpx with ``http2=True``: the DELETE on the same client as the stream
  (over HTTP/2 to the sidecar, one connection; the middleware's uvicorn
  speaks HTTP/1.1, which httpx then uses), the stream's last event the
  cancel error;
* openai-node ``client.responses.cancel(id)`` and the Anthropic TypeScript
  SDK with a ``fetch`` DELETE (``node/cancel_cases.mjs``);
* a browser ``EventSource`` resuming ``GET /v1/streams/{id}`` of a stream the
  page started and left, ended by the page's ``fetch`` DELETE: cross-origin
  through the sidecar (CORS preflights for the settings header and the
  DELETE), same-origin through the middleware (which has no CORS of its own).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from chromium import new_page, served_page
from tokenwire.middleware import EndReason

from .cancel_servers import DELTAS, DRIVERS, HEARTBEAT_LOW_S, CancelServers, Case, running_cancel_servers
from .py_clients import speaks_h2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODE_DIR = Path(__file__).resolve().parent / "node"
SETTINGS = {"Tokenwire-Keep-Generating": "true", "Tokenwire-Heartbeat-S": f"{HEARTBEAT_LOW_S:g}"}
ALICE = "sk-alice"
MALLORY = "sk-mallory"
STOPPED_WITHIN_S = 5.0
"""How long a cancel may take to reach the engine here (the answer runs ~20 s)."""
NODE_CLIENTS = ("openai-node-responses-cancel", "anthropic-ts-delete")
STOP_DELAYS_S: dict[str, float] = {}
"""Owner's DELETE sent → engine stopped, by row (printed at the end of the module)."""

PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire cancel by id</title></head><body>
<script>
// Starts a chat stream asking to keep it generating, reads two events and
// leaves; resumes it with an EventSource (GET /v1/streams/{id}); after three
// of its events DELETEs the stream with fetch. Reports what it saw; every
// judgement is the test's.
window.run = async (base, name) => {
  const seen = {messages: [], errors: [], stage: "start"};
  // Never a hang: past this, the page reports where it was.
  const late = new Promise((resolve) => setTimeout(() => resolve({...seen, timedOut: true}), 20000));
  return await Promise.race([runSteps(base, name, seen), late]);
};
const runSteps = async (base, name, seen) => {
  try {
    const controller = new AbortController();
    const answer = await fetch(base + "/" + name + "/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: {"content-type": "application/json", "tokenwire-keep-generating": "true"},
      body: JSON.stringify({model: "compat-model", stream: true, messages: [{role: "user", content: "hi"}]}),
    });
    seen.status = answer.status;
    seen.streamId = answer.headers.get("x-tokenwire-stream-id");
    const reader = answer.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    while ((text.match(/\\n\\n/g) || []).length < 2) {
      const {value, done} = await reader.read();
      if (done) break;
      text += decoder.decode(value, {stream: true});
    }
    seen.readBeforeLeaving = text;
    seen.stage = "leaving";
    await reader.cancel();
    controller.abort();
    seen.stage = "resuming";
  } catch (error) {
    seen.startError = String(error);
    return seen;
  }
  let deleting = null;
  await new Promise((resolve) => {
    const source = new EventSource(base + "/v1/streams/" + encodeURIComponent(seen.streamId));
    source.onmessage = (event) => {
      seen.messages.push(event.data);
      seen.lastEventId = event.lastEventId;
      if (event.data.includes('"error"')) {
        seen.errorEvent = JSON.parse(event.data);
        source.close();
        resolve();
        return;
      }
      if (seen.messages.length === 3) {
        // The cancel error may reach the EventSource before this answer is read: awaited below.
        deleting = fetch(base + "/v1/streams/" + encodeURIComponent(seen.streamId), {method: "DELETE"})
          .then(async (deleted) => { seen.deleted = {status: deleted.status, body: await deleted.json()}; })
          .catch((error) => { seen.deleted = {error: String(error)}; });
      }
    };
    source.onerror = () => {
      // A dropped connection (it reconnects by itself: OPEN again later), or a
      // reconnect the server refused (CLOSED: the browser gives up).
      seen.errors.push(source.readyState);
      if (source.readyState === EventSource.CLOSED || seen.errors.length >= 3) { source.close(); resolve(); }
    };
  });
  seen.stage = "ended";
  await deleting;
  if (!seen.errorEvent) {
    // What the refused reconnect said, which an EventSource cannot read: the same GET by fetch.
    const again = await fetch(base + "/v1/streams/" + encodeURIComponent(seen.streamId),
                              {headers: {"last-event-id": seen.lastEventId}});
    seen.refusedReconnect = {status: again.status, body: await again.text()};
  }
  return seen;
};
</script></body></html>
"""


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """The browser row's page, served from an origin of its own (the sidecar's CORS allows it)."""
    with served_page(PAGE) as origin:
        yield origin


@pytest.fixture(scope="module")
def cancel_servers(page_origin: str) -> Iterator[CancelServers]:
    with running_cancel_servers(page_origin) as running:
        running.engine.pages["cancel"] = PAGE
        yield running
    if STOP_DELAYS_S:
        print("\nowner's DELETE sent -> engine stopped: " + ", ".join(
            f"{row} {delay * 1000:.1f} ms" for row, delay in sorted(STOP_DELAYS_S.items())))


def _delete(base: str, stream_id: str, key: str | None = ALICE,
            client: httpx.Client | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = (client or httpx).delete(f"{base}/v1/streams/{stream_id}", headers=headers, timeout=10)
    return answer.status_code, answer.json()


def _stopped(case: Case) -> bool:
    return case.stopped_at is not None


def _assert_settings_applied(servers: CancelServers, driver: str, stream_id: str, case: Case) -> None:
    """What the engine and the record say of the settings the client asked for."""
    assert not any(name.startswith("tokenwire-") for name in case.headers), case.headers  # not forwarded
    record = servers.record_of(stream_id)
    assert record.end_reason is EndReason.CANCELLED, record
    assert record.heartbeats >= 2, f"Tokenwire-Heartbeat-S was not applied: {record}"
    if driver == "sidecar":
        applied = str(servers.extras[record.request_id]["client_settings"]).split(",")
        assert sorted(applied) == [f"heartbeat_s={HEARTBEAT_LOW_S}", "keep_generating_s=60.0"], applied


# ---------------------------------------------------------------- anthropic-python


@pytest.mark.parametrize("driver", DRIVERS)
def test_anthropic_python_stream_cancelled_by_id_raises_the_cancel_error(
        driver: str, cancel_servers: CancelServers) -> None:
    servers = cancel_servers
    base, name = servers.url(driver), f"anthropic-py-{driver}"
    client = anthropic.Anthropic(base_url=f"{base}/{name}", api_key=ALICE, max_retries=0, timeout=30)
    texts: list[str] = []
    with (pytest.raises(anthropic.APIStatusError) as raised,
          client.messages.stream(model="claude-compat-1", max_tokens=1024, extra_headers=SETTINGS,
                                 messages=[{"role": "user", "content": "hi"}]) as stream):
        stream_id = stream.response.headers["x-tokenwire-stream-id"]
        for text in stream.text_stream:
            texts.append(text)
            if len(texts) == 3:
                status, body = _delete(base, stream_id, MALLORY)
                assert (status, body["error"]["code"]) == (404, "stream_not_found"), body
            if len(texts) == 6:  # it read on after the other caller's DELETE
                sent_at = time.monotonic()
                assert _delete(base, stream_id) == (200, {"id": stream_id, "object": "stream",
                                                          "status": "cancelled"})
    case = servers.engine.case(name)
    assert case.wait(_stopped, STOPPED_WITHIN_S) and case.stopped_at is not None
    STOP_DELAYS_S[f"anthropic-python/{driver}"] = case.stopped_at - sent_at
    # The SDK's own surfacing of the in-band error event: the event's body, status 200.
    error = raised.value
    assert type(error) is anthropic.APIStatusError and error.status_code == 200
    assert isinstance(error.body, dict) and error.body["type"] == "error", error.body
    assert error.body["error"]["type"] == "api_error"
    assert error.body["error"]["tokenwire"] == {"code": "cancelled", "number": "E7301"}
    assert texts[:6] == [f"w{i} " for i in range(6)] and len(texts) < DELTAS
    assert case.finished_at is None and case.sent < DELTAS
    assert case.headers["authorization"] == f"Bearer {ALICE}"  # the SDK's key: the owner
    _assert_settings_applied(servers, driver, stream_id, case)


@pytest.mark.parametrize("keep", [True, False], ids=["keep-generating", "default"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_anthropic_python_leaving_keeps_generating_only_if_asked_and_a_delete_then_stops_it(
        driver: str, keep: bool, cancel_servers: CancelServers) -> None:
    servers = cancel_servers
    base, name = servers.url(driver), f"anthropic-py-leave-{driver}-{keep}"
    client = anthropic.Anthropic(base_url=f"{base}/{name}", api_key=ALICE, max_retries=0, timeout=30)
    with client.messages.stream(model="claude-compat-1", max_tokens=1024,
                                extra_headers={"Tokenwire-Keep-Generating": "true"} if keep else None,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        stream_id = stream.response.headers["x-tokenwire-stream-id"]
        for i, _ in enumerate(stream.text_stream):
            if i == 2:
                break  # the application leaves; the with-block closes the response
    case = servers.engine.case(name)
    left_at_sent = case.sent
    if not keep:
        assert case.wait(_stopped, STOPPED_WITHIN_S), "the engine went on after its client left"
        assert servers.record_of(stream_id).end_reason is EndReason.CLIENT_GONE
        assert _delete(base, stream_id) == (200, {"id": stream_id, "object": "stream", "status": "ended"})
        assert _delete(base, stream_id)[0] == 404  # forgotten
        return
    # Kept: the engine writes on with nobody reading, until the owner's DELETE.
    assert case.wait(lambda c: c.sent >= left_at_sent + 100 or c.stopped_at is not None)
    assert case.stopped_at is None, "a stream that asked to keep generating stopped when its client left"
    sent_at = time.monotonic()
    assert _delete(base, stream_id) == (200, {"id": stream_id, "object": "stream", "status": "cancelled"})
    assert case.wait(_stopped, STOPPED_WITHIN_S) and case.stopped_at is not None
    STOP_DELAYS_S[f"anthropic-python-left/{driver}"] = case.stopped_at - sent_at
    assert case.finished_at is None
    assert servers.record_of(stream_id).end_reason is EndReason.CANCELLED


# ---------------------------------------------------------------- HTTP/2


@pytest.mark.parametrize("driver", DRIVERS)
def test_httpx_http2_deletes_on_the_client_it_streams_on_and_reads_the_cancel_error(
        driver: str, cancel_servers: CancelServers) -> None:
    servers = cancel_servers
    base, name = servers.url(driver), f"httpx-h2-{driver}"
    h2 = speaks_h2(base)
    assert h2 is (driver == "sidecar")  # uvicorn (h11) speaks HTTP/1.1 only
    events: list[dict[str, Any]] = []
    client = httpx.Client(http2=True, http1=not h2, timeout=30, headers={"Authorization": f"Bearer {ALICE}"})
    with client, client.stream("POST", f"{base}/{name}/v1/chat/completions", headers=SETTINGS,
                               json={"model": "compat-model", "stream": True, "messages": []}) as response:
        assert response.http_version == ("HTTP/2" if h2 else "HTTP/1.1")
        stream_id = response.headers["x-tokenwire-stream-id"]
        try:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    assert _delete(base, stream_id, MALLORY, client)[0] == 404
                if len(events) == 10:  # on the same client: over HTTP/2, the same connection
                    sent_at = time.monotonic()
                    assert _delete(base, stream_id, client=client)[1]["status"] == "cancelled"
            ended = "clean"
        except httpx.RemoteProtocolError:
            ended = "cut"  # HTTP/1.1: a body cut after the in-band error (README: intended)
    case = servers.engine.case(name)
    assert case.wait(_stopped, STOPPED_WITHIN_S) and case.stopped_at is not None
    STOP_DELAYS_S[f"httpx-http2/{driver}"] = case.stopped_at - sent_at
    assert events[-1]["error"]["code"] == "cancelled", events[-1]
    assert events[-1]["error"]["tokenwire"] == {"code": "cancelled", "number": "E7301"}
    assert all("choices" in event for event in events[:-1])
    assert ended == ("clean" if h2 else "cut")  # over HTTP/2 the stream ends after the error event
    _assert_settings_applied(servers, driver, stream_id, case)
    if driver == "sidecar":
        deletes = [extra for extra in servers.extras.values()
                   if extra.get("method") == "DELETE" and extra.get("path") == f"/v1/streams/{stream_id}"]
        assert deletes and all(extra["http_version"] == "2" for extra in deletes), deletes


# ---------------------------------------------------------------- Node


@pytest.fixture(scope="module")
def node_outcomes(cancel_servers: CancelServers) -> dict[str, dict[str, Any]]:
    """Every Node case, in one ``node`` process, all at once."""
    node = shutil.which("node")
    if node is None:
        raise AssertionError("no node: run scripts/system-deps.sh nodejs npm")
    for package in ("@anthropic-ai/sdk", "openai"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            raise AssertionError(f"the npm package {package} is missing: run scripts/node-deps.sh")
    cases = [{"id": f"{client}/{driver}", "client": client, "base": cancel_servers.url(driver),
              "case": f"{client}-{driver}"} for client in NODE_CLIENTS for driver in DRIVERS]
    done = subprocess.run([node, str(NODE_DIR / "cancel_cases.mjs")], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=120, cwd=NODE_DIR)
    assert done.returncode == 0, f"node failed: {done.stderr[-3000:]}"
    outcomes: dict[str, dict[str, Any]] = json.loads(done.stdout)
    return outcomes


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("client", NODE_CLIENTS)
def test_node_sdk_is_cancelled_by_id_while_it_reads(client: str, driver: str, cancel_servers: CancelServers,
                                                    node_outcomes: dict[str, dict[str, Any]]) -> None:
    outcome = node_outcomes[f"{client}/{driver}"]
    case = cancel_servers.engine.case(f"{client}-{driver}")
    assert case.wait(_stopped, STOPPED_WITHIN_S), outcome
    assert case.finished_at is None and not outcome["ended_cleanly"], outcome
    assert outcome["deltas"] >= 6
    error = outcome["error"]
    stream_id = outcome["stream_id"]  # the x-tokenwire-stream-id of the SDK's own response
    if client == "openai-node-responses-cancel":
        response_id = outcome["response_id"]
        assert response_id == f"resp_{client}-{driver}"
        # Another key: the store holds no such response for it, so the engine
        # is asked, and answers as it does for one it does not know.
        assert outcome["mallory"]["error"]["kind"] == "NotFoundError", outcome["mallory"]
        assert outcome["owner"] == {"id": response_id, "object": "response", "status": "cancelled"}
        # openai-node raises the Responses error event it read as an APIError.
        assert error["kind"] == "APIError", error
        assert error["body"]["tokenwire"] == {"code": "cancelled", "number": "E7301"}, error
    else:
        assert outcome["mallory"]["status"] == 404, outcome["mallory"]
        assert outcome["mallory"]["body"]["error"]["code"] == "stream_not_found"
        assert outcome["owner"] == {"status": 200, "body": {"id": stream_id, "object": "stream",
                                                            "status": "cancelled"}}
        assert error["kind"] == "APIError", error
        assert error["body"]["error"]["tokenwire"] == {"code": "cancelled", "number": "E7301"}, error
    _assert_settings_applied(cancel_servers, driver, stream_id, case)


# ---------------------------------------------------------------- browser


@pytest.mark.parametrize("driver", DRIVERS)
def test_browser_eventsource_resuming_a_stream_is_ended_by_a_fetch_delete(
        driver: str, cancel_servers: CancelServers, page_origin: str, browser: Any) -> None:
    servers = cancel_servers
    base, name = servers.url(driver), f"browser-{driver}"
    # The sidecar: another origin, through CORS. The middleware has no CORS:
    # its page comes from the server it calls.
    origin = page_origin if driver == "sidecar" else base
    with new_page(browser) as page:
        page.goto(origin + ("/" if driver == "sidecar" else "/page/cancel"))
        seen = page.evaluate("([b, n]) => window.run(b, n)", [base, name])
    assert seen.get("startError") is None and not seen.get("timedOut") and seen["status"] == 200, seen
    stream_id = seen["streamId"]
    assert stream_id, f"the page could not read x-tokenwire-stream-id: {seen}"
    assert seen["deleted"] == {"status": 200, "body": {"id": stream_id, "object": "stream",
                                                       "status": "cancelled"}}, seen
    # The EventSource read the stream from its start, then learnt of the cancel.
    assert json.loads(seen["messages"][0])["choices"][0]["delta"]["role"] == "assistant"
    texts = [json.loads(m)["choices"][0]["delta"].get("content") for m in seen["messages"][1:]
             if '"error"' not in m]
    assert texts == [f"w{i} " for i in range(len(texts))], texts  # no event twice, none missing
    if "errorEvent" in seen:
        # As an in-band event: the usual case. It closed there; any drop before
        # (Chromium's cut-body tail, below) it recovered from by itself
        # (CONNECTING, then the rest by Last-Event-ID).
        assert seen["errorEvent"]["error"]["tokenwire"] == {"code": "cancelled", "number": "E7301"}, seen
        assert all(state == 0 for state in seen["errors"]), seen
    else:
        # Chromium drops the tail of a chunked body cut without its terminator
        # now and then (README: "Known limitation"), here the error event; the
        # EventSource reconnects with Last-Event-ID, the cancel is then the first
        # thing left, so it is the answer's status and body, and an EventSource
        # cannot read a non-200 answer: it only closes (CLOSED, no more retries).
        # What it was refused with is the cancel, as the same GET by fetch shows.
        assert seen["errors"][-1] == 2, seen  # EventSource.CLOSED
        refused = seen["refusedReconnect"]
        assert refused["status"] != 200, seen
        assert json.loads(refused["body"])["error"]["tokenwire"]["code"] == "cancelled", seen
        print(f"\n{driver}: the EventSource lost the cancel event (Chromium's cut-body tail); "
              f"its reconnect was refused with {refused['status']}")
    case = servers.engine.case(name)
    assert case.wait(_stopped, STOPPED_WITHIN_S) and case.finished_at is None
    record = servers.record_of(stream_id)
    assert record.end_reason is EndReason.CANCELLED
