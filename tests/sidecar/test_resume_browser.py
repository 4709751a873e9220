"""Resume in a real browser: a headless Chromium ``EventSource`` (Debian's, never
downloaded) follows a stream, the server drops it mid-answer, and the browser
reconnects by itself with ``Last-Event-ID`` and still shows the whole answer.

The page is served by a tiny HTTP server of this test on its own port, so the
``EventSource`` is cross-origin to the sidecar: that is how a web app reaches
its API, and it exercises the CORS headers on ``GET /v1/streams/{stream}``
(without ``Access-Control-Allow-Origin`` Chromium refuses the stream and never
reconnects). A ``data:`` page would have an opaque ``null`` origin instead,
which no real deployment has.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from chromium import new_page, served_page
from clients import chat_body
from conftest import RunningSidecar
from resume_client import open_stream
from upstreams import FakeUpstream, expected_text

pytestmark = pytest.mark.slow

PATH = "/normal/v1/chat/completions"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS = 60
# role, the tokens, finish, usage, [DONE]: each one numbered event.
EVENTS = TOKENS + 4

# The page only records what the EventSource reports; every judgement is the test's.
# It never closes the source itself: the 204 after the last event must stop it.
PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire resume</title>
<style>body{font:14px monospace;margin:1em} pre{white-space:pre-wrap;border:1px solid #999}</style>
</head><body>
<h1>EventSource resume</h1>
<div>readyState: <span id="ready">-</span>, opens: <span id="opens">0</span>,
last id: <span id="last-id">-</span></div>
<pre id="text"></pre>
<pre id="log"></pre>
<script>
const seen = {text: "", ids: [], opens: 0, log: [], inband: [], done: false};
window.seen = seen;
function show() {
  document.getElementById("ready").textContent = String(window.source.readyState);
  document.getElementById("opens").textContent = String(seen.opens);
  document.getElementById("last-id").textContent = seen.ids[seen.ids.length - 1] || "-";
  document.getElementById("text").textContent = seen.text;
  document.getElementById("log").textContent = seen.log.join("\\n");
}
window.follow = (url) => {
  const source = new EventSource(url);
  window.source = source;
  source.onopen = () => { seen.opens += 1; seen.log.push("open"); show(); };
  // readyState tells a reconnect (0, CONNECTING) from giving up (2, CLOSED).
  source.onerror = () => { seen.log.push("error " + source.readyState); show(); };
  source.onmessage = (event) => {
    if (event.data === "[DONE]") {
      seen.done = true;
      seen.ids.push(event.lastEventId);
    } else {
      const chunk = JSON.parse(event.data);
      if (chunk.error) {
        seen.inband.push({code: chunk.error.code, lastEventId: event.lastEventId, after: seen.ids.length});
        seen.log.push("in-band " + chunk.error.code);
      } else {
        seen.ids.push(event.lastEventId);
        const choice = (chunk.choices || [])[0];
        seen.text += (choice && choice.delta && choice.delta.content) || "";
      }
    }
    show();
  };
};
</script></body></html>
"""


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """``http://127.0.0.1:<port>``: where the page is served, another origin than the sidecar."""
    with served_page(PAGE) as origin:
        yield origin


def _admin(sidecar: RunningSidecar, method: str, path: str) -> Any:
    request = urllib.request.Request(sidecar.admin_url + path, method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _wait(page: Any, condition: str, timeout_ms: int) -> None:
    """``page.wait_for_function``, failing with what the page saw rather than a bare timeout."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=timeout_ms)
    except PlaywrightTimeout:
        seen = page.evaluate("window.seen")
        raise AssertionError(f"page never reached {condition!r}; log ends {seen['log'][-8:]}, "
                             f"{len(seen['ids'])} ids ending {seen['ids'][-3:]}") from None


def _open_reader(sidecar: RunningSidecar, stream_id: str, timeout_s: float = 5.0) -> str:
    """The request id of the browser's replay connection, from the admin list."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readers = [entry["request_id"] for entry in _admin(sidecar, "GET", "/streams")
                   if entry["replay"] and entry["resumable"]]
        if len(readers) == 1:
            return str(readers[0])
        time.sleep(0.02)
    raise AssertionError(f"no single open reader of {stream_id}: {_admin(sidecar, 'GET', '/streams')}")


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_event_source_dropped_by_the_server_reconnects_with_last_event_id_and_shows_the_whole_answer_once(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream, page_origin: str,
        browser: Any, request: pytest.FixtureRequest, tmp_path: Path, store: str) -> None:
    resume_store = request.getfixturevalue("redis_url") if store == "redis" else "memory"
    # A short retry so the reconnect is prompt; a grace that outlives the whole test,
    # so the answer goes on being generated while nobody is connected.
    sidecar = start_sidecar(resume=True, resume_grace_s=30.0, resume_retry_ms=200,
                            resume_store=resume_store, cors_allow_origins=(page_origin,),
                            resume_owner_secret="browser-test")

    with new_page(browser, viewport={"width": 900, "height": 700}) as page:
        # The page is loaded first, so a slow browser start cannot eat the answer's time.
        stream_requests: list[Any] = []
        page.on("request", lambda req: stream_requests.append(req) if "/v1/streams/" in req.url else None)
        page.goto(page_origin + "/")

        # A client starts the answer (6 s of tokens) and loses its network after three events.
        first = open_stream(sidecar.port, "POST", PATH, body=chat_body(), stop_after=3,
                            headers={"x-fake-tokens": str(TOKENS), "x-fake-delay-s": "0.1"})
        assert first.status == 200 and first.stopped
        stream_id = first.stream_id
        page.evaluate("url => window.follow(url)", f"{sidecar.url}/v1/streams/{stream_id}")

        # Mid-answer, the server drops the browser's connection: the admin cancel
        # sends an in-band error (no id) and cuts the body without its terminator.
        _wait(page, "window.seen.ids.length >= 15", 10_000)
        reader = _open_reader(sidecar, stream_id)
        assert _admin(sidecar, "DELETE", f"/streams/{reader}") == {"cancelled": reader}

        # The page never closes the source: only the sidecar's 204 after [DONE] can make it CLOSED.
        _wait(page, "window.source.readyState === 2", 15_000)
        seen = page.evaluate("window.seen")
        shot = tmp_path / "resume.png"
        page.screenshot(path=str(shot), full_page=True)
        headers = [req.all_headers() for req in stream_requests]

    # The whole answer, exactly once, as if nothing had happened.
    assert seen["text"] == expected_text(TOKENS)
    assert seen["ids"] == [f"{stream_id}.{seq}" for seq in range(1, EVENTS + 1)]
    assert seen["done"]
    # The drop's error event carried no id, so the browser resumed after the last real event.
    assert [entry["code"] for entry in seen["inband"]] == ["cancelled"]
    ids_before_drop = seen["inband"][0]["after"]
    assert 15 <= ids_before_drop < EVENTS, "the answer was over before the drop: nothing was tested"
    assert seen["inband"][0]["lastEventId"] == seen["ids"][ids_before_drop - 1]
    # Open; dropped (CONNECTING); reopened by itself; the answer's clean end (CONNECTING);
    # the reconnect after [DONE] answered 204 (CLOSED).
    assert seen["log"] == ["open", "in-band cancelled", "error 0", "open", "error 0", "error 2"]
    # Three requests, and the browser itself sent Last-Event-ID on the two reconnects.
    assert [h.get("last-event-id") for h in headers] == [
        None, seen["ids"][ids_before_drop - 1], f"{stream_id}.{EVENTS}"]
    assert [r.status for r in sidecar.log.records].count(204) == 1
    assert shot.read_bytes().startswith(PNG_SIGNATURE)
