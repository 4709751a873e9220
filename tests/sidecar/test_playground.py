"""The playground page on the admin port, driven in headless Chromium (Debian's, never downloaded).

The page streams from the proxy port, another origin, so these tests also
prove the CORS path a real browser takes: preflight, exposed headers, a
``ReadableStream`` read while the sidecar writes. Every sidecar here is a plain
one (no ``cors_allow_origins``): the admin port's own origin is allowed by default.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chromium import new_page, served_page
from conftest import LoopThread, RunningSidecar
from tokenwire.sidecar.downstream.cors import admin_origins
from tokenwire.sidecar.process.playground import Playground
from upstreams import FakeUpstream, Request, expected_text

SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "results" / "playground.png"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class PageUpstream(FakeUpstream):
    """The fake engine at the paths a page calls (``/v1/...``), tuned by attributes.

    A browser page cannot send the fake's ``x-fake-*`` headers, so each test
    sets ``tokens`` and ``delay_s`` here instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 5
        self.delay_s = 0.0

    async def _respond(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        if request.path.startswith("/v1/models"):
            request.path = "/models" + request.path
        else:
            request.path = "/normal" + request.path
            request.headers.setdefault("x-fake-tokens", str(self.tokens))
            request.headers.setdefault("x-fake-delay-s", str(self.delay_s))
        return await super()._respond(request, writer)


@pytest.fixture(scope="module")
def page_upstream(loop_thread: LoopThread) -> Iterator[PageUpstream]:
    fake = PageUpstream()
    loop_thread.run(fake.start())
    yield fake
    loop_thread.run(fake.stop())


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with new_page(browser, viewport={"width": 1280, "height": 900}) as opened:
        yield opened


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _playground(start_sidecar: Any, page_upstream: PageUpstream, **overrides: Any) -> RunningSidecar:
    # A plain sidecar: nothing but the admin address (port 0) about CORS.
    return start_sidecar(page_upstream.url, admin_listen="127.0.0.1:0", **overrides)


def _open(page: Any, sidecar: RunningSidecar) -> None:
    page.goto(sidecar.admin_url + "/")
    page.wait_for_selector("#model[data-loaded=true]", state="attached")


def _send(page: Any, prompt: str) -> None:
    page.fill("#prompt", prompt)
    page.click("#send")


def _text(page: Any, selector: str) -> str:
    return str(page.text_content(selector))


def _shown_ms(shown: str) -> float:
    """A duration as the page shows it (``0.42 ms``, ``205.3 ms``, ``1.02 s``), in ms."""
    match = re.fullmatch(r"([\d.]+) (m?s)", shown)
    assert match is not None, shown
    return float(match.group(1)) * (1 if match.group(2) == "ms" else 1000)


@pytest.mark.slow
def test_admin_root_serves_the_self_contained_page_pointed_at_the_bound_proxy_port(start_sidecar) -> None:
    sidecar = start_sidecar()  # listen port 0: only the bound port is right
    response = httpx.get(sidecar.admin_url + "/")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    page = response.text
    assert f'<meta name="tokenwire-proxy" content="{sidecar.url}">' in page
    assert "{{PROXY_URL}}" not in page
    # Self-contained: nothing fetched from elsewhere (no CDN, no fonts).
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "@import" not in page


@pytest.mark.parametrize(("bound_host", "host_header", "expected"), [
    ("127.0.0.1", b"127.0.0.1:9", "http://127.0.0.1:8080"),
    ("0.0.0.0", b"box.example:9", "http://box.example:8080"),
    ("::", b"[::1]:9", "http://[::1]:8080"),
    ("0.0.0.0", None, "http://127.0.0.1:8080"),
    ("::1", b"[::1]:9", "http://[::1]:8080"),
])
def test_playground_proxy_url_is_what_the_browser_can_reach(bound_host: str, host_header: bytes | None,
                                                      expected: str) -> None:
    playground = Playground("{{PROXY_URL}}", "http", bound_host, 8080)
    assert playground.proxy_url(host_header) == expected
    assert playground.render(host_header) == expected.encode()


def test_up_allows_the_admin_origin_under_either_loopback_name() -> None:
    assert admin_origins("127.0.0.1", 8081) == ["http://127.0.0.1:8081", "http://localhost:8081",
                                                "http://[::1]:8081"]
    assert admin_origins("10.0.0.5", 8081) == ["http://10.0.0.5:8081"]


@pytest.mark.slow
def test_page_streams_the_answer_through_the_proxy_with_timings_and_screenshot(
        start_sidecar, page_upstream: PageUpstream, page: Any, tmp_path: Path) -> None:
    page_upstream.tokens, page_upstream.delay_s = 40, 0.01
    sidecar = _playground(start_sidecar, page_upstream)
    _open(page, sidecar)
    assert _text(page, "#proxy-url") == sidecar.url
    assert page.eval_on_selector_all("#model option", "options => options.map(o => o.value)") == ["fake"]
    _send(page, "Tell me about the sea.")
    page.wait_for_selector("#status[data-state=done]", timeout=15_000)

    assert _text(page, "#output") == expected_text(40)
    assert re.fullmatch(r"[\d.]+ m?s", _text(page, "#ttft"))
    assert re.fullmatch(r"[\d.]+ m?s", _text(page, "#itl-p95"))
    # The gaps are between reads (arrivals), and the labels say so.
    labels = page.eval_on_selector_all("#timing-panel dt", "dts => dts.map(d => d.textContent.trim())")
    assert labels == ["time to first token", "gap between arrivals p50", "gap between arrivals p95",
                      "elapsed"]
    toy = " ".join(_text(page, "#toy-model").split())
    assert "built-in toy" in toy and "not meant to answer well" in toy
    assert "tokenwire up --model FOLDER" in toy and "tokenwire sidecar --upstream URL" in toy
    assert page.is_visible("#toy-model")
    assert _text(page, "#tokens") == "40"
    content_events = int(_text(page, "#content-events"))
    assert 1 <= content_events <= 40
    assert _text(page, "#events-vs-tokens") == f"{content_events} / 40"
    # The request id comes from a response header the page may only read if the sidecar exposed it.
    request_id = _text(page, "#request-id")
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert sidecar.record(request_id).end_reason == "complete"
    assert page_upstream.requests_with(request_id)[-1].headers["content-type"] == "application/json"
    assert page.is_disabled("#resume")  # no stream id: the sidecar runs without --resume

    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    if os.environ.get("TOKENWIRE_UPDATE_SCREENSHOT"):
        # The README's picture; refreshed on request, so a test run leaves the tree clean.
        shutil.copyfile(shot, SCREENSHOT)


@pytest.mark.slow
def test_kill_button_mid_stream_stops_the_text_and_the_upstream_sees_the_disconnect(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    page_upstream.tokens, page_upstream.delay_s = 200, 0.05  # ten seconds of answer
    sidecar = _playground(start_sidecar, page_upstream)
    _open(page, sidecar)
    _send(page, "a long answer, please")
    page.wait_for_function("Number(document.getElementById('content-events').textContent) >= 5",
                           timeout=10_000)
    page.click("#kill")
    page.wait_for_selector("#status[data-state=killed]")

    request_id = _text(page, "#request-id")
    connection = page_upstream.connection_of(request_id)
    assert connection.closed.wait(5) and connection.peer_closed_at is not None
    assert page_upstream.requests_with(request_id)[-1].finished_at is None
    assert sidecar.record(request_id).end_reason == "client_gone"
    shown = _text(page, "#output")
    time.sleep(0.5)
    assert _text(page, "#output") == shown  # nothing more arrives after the kill
    assert expected_text(200).startswith(shown) and len(shown) < len(expected_text(200))
    assert page.is_disabled("#kill") and page.is_disabled("#resume")


@pytest.mark.slow
def test_throttled_reader_gets_several_events_per_read_and_still_the_whole_text(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    # About a second of answer: a 200 ms reader takes it in several reads, not one or two.
    page_upstream.tokens, page_upstream.delay_s = 120, 0.008
    sidecar = _playground(start_sidecar, page_upstream)
    _open(page, sidecar)
    page.eval_on_selector("#throttle", "e => { e.value = '200'; e.dispatchEvent(new Event('input')); }")
    assert _text(page, "#throttle-value") == "200 ms"
    _send(page, "quickly")
    page.wait_for_selector("#status[data-state=done]", timeout=20_000)
    assert _text(page, "#output") == expected_text(120)
    reads, events = int(_text(page, "#reads")), int(_text(page, "#events"))
    # A slow reader takes what piled up in one read: many events per read, none lost.
    assert reads * 3 < events
    assert _text(page, "#tokens") == "120"
    # The gaps the page shows are between reads, each at least the reader's own 200 ms
    # pause (it sleeps that long before every read), never the ~0 ms between the events
    # of one read (a margin for the timer firing a hair early).
    assert _shown_ms(_text(page, "#itl-p50")) >= 190
    assert _shown_ms(_text(page, "#itl-p95")) >= 190


@pytest.mark.slow
def test_resume_button_after_a_kill_appends_the_rest_from_the_replay_exactly_once(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    page_upstream.tokens, page_upstream.delay_s = 60, 0.03
    # Grace keeps the engine generating into the replay store while the page is away.
    sidecar = _playground(start_sidecar, page_upstream, resume=True, resume_grace_s=10.0)
    _open(page, sidecar)
    _send(page, "resume me")
    page.wait_for_function("Number(document.getElementById('content-events').textContent) >= 5",
                           timeout=10_000)
    page.click("#kill")
    page.wait_for_selector("#status[data-state=killed]")
    stream_id = _text(page, "#stream-id")
    last_id = _text(page, "#last-event-id")
    assert last_id.startswith(stream_id + ".")
    killed_at_seq = int(last_id.rpartition(".")[2])
    shown = _text(page, "#output")
    assert len(shown) < len(expected_text(60))
    assert page.is_enabled("#resume")

    page.click("#resume")
    page.wait_for_selector("#status[data-state=done]", timeout=15_000)
    assert _text(page, "#output") == expected_text(60)
    assert _text(page, "#note") == f"resumed at seq {killed_at_seq + 1}"
    assert _text(page, "#duplicates") == "0"
    assert page.eval_on_selector_all("#output .resumed", "spans => spans.map(s => s.textContent).join('')") \
        == expected_text(60)[len(shown):]
    request_id = _text(page, "#request-id")
    # One generation: the resume read the replay, it did not ask the engine again.
    assert len(page_upstream.requests_with(request_id)) == 1
    assert page_upstream.requests_with(request_id)[0].finished_at is not None


# ---------------------------------------------------------------- narrow screens, min tokens, errors


NARROW_PX = 400
NARROW_HEIGHT_PX = 800
NARROW_SCREENSHOT = SCREENSHOT.with_name("playground-400px.png")


@pytest.mark.slow
def test_narrow_page_at_400px_fits_without_side_scrolling_and_still_streams(
        start_sidecar, page_upstream: PageUpstream, browser: Any, tmp_path: Path) -> None:
    page_upstream.tokens, page_upstream.delay_s = 30, 0.005
    sidecar = _playground(start_sidecar, page_upstream)
    with new_page(browser, viewport={"width": NARROW_PX, "height": NARROW_HEIGHT_PX}) as page:
        _open(page, sidecar)
        _send(page, "Tell me about the sea.")
        page.wait_for_selector("#status[data-state=done]", timeout=15_000)
        assert _text(page, "#output") == expected_text(30)
        assert page.evaluate("document.documentElement.scrollWidth") <= NARROW_PX
        # Every control is on the screen, none cut off at the right edge.
        for selector in ("#prompt", "#model", "#max-tokens", "#min-tokens", "#send", "#kill", "#resume",
                         "#status", "#throttle", "#output", "#timeline", "#ttft", "#request-id"):
            box = page.locator(selector).bounding_box()
            assert box is not None and box["width"] > 0, selector
            assert box["x"] >= 0 and box["x"] + box["width"] <= NARROW_PX, (selector, box)
        # One column: the timing panel sits right below the answer, not beside it, and the
        # whole of it is on the first screen (not after every other panel, at the bottom).
        page.evaluate("window.scrollTo(0, 0)")
        answer = page.locator("#answer-panel").bounding_box()
        timing = page.locator("#timing-panel").bounding_box()
        assert answer is not None and timing is not None
        assert timing["y"] >= answer["y"] + answer["height"], (answer, timing)
        assert timing["y"] + timing["height"] <= NARROW_HEIGHT_PX, timing
        for selector in ("#ttft", "#itl-p50", "#itl-p95", "#elapsed"):
            box = page.locator(selector).bounding_box()
            assert box is not None and box["y"] + box["height"] <= NARROW_HEIGHT_PX, (selector, box)
        assert page.is_visible("#toy-model")
        shot = tmp_path / "playground-400px.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes().startswith(PNG_SIGNATURE)
        if os.environ.get("TOKENWIRE_UPDATE_SCREENSHOT"):
            shutil.copyfile(shot, NARROW_SCREENSHOT)


@pytest.mark.slow
def test_min_tokens_is_sent_as_the_engines_min_tokens_and_raises_max_tokens_to_match(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    page_upstream.tokens, page_upstream.delay_s = 5, 0.0
    sidecar = _playground(start_sidecar, page_upstream)
    _open(page, sidecar)
    page.fill("#max-tokens", "50")
    page.fill("#min-tokens", "120")
    _send(page, "long, please")
    page.wait_for_selector("#status[data-state=done]", timeout=15_000)
    sent = json.loads(page_upstream.requests_with(_text(page, "#request-id"))[-1].body)
    assert sent["min_tokens"] == 120 and sent["max_tokens"] == 120
    page.fill("#min-tokens", "0")
    _send(page, "short")
    page.wait_for_selector("#status[data-state=done]", timeout=15_000)
    sent = json.loads(page_upstream.requests_with(_text(page, "#request-id"))[-1].body)
    assert "min_tokens" not in sent and sent["max_tokens"] == 50


@pytest.mark.slow
def test_a_page_from_another_origin_is_told_which_flag_lets_it_in(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    sidecar = _playground(start_sidecar, page_upstream)
    with served_page(httpx.get(sidecar.admin_url + "/").content) as origin:
        page.goto(origin + "/")
        page.wait_for_selector("#model[data-loaded=true]", state="attached")
        # Already on load, the model list says why it failed.
        assert f"--cors-allow-origin {origin}" in _text(page, "#note")
        _send(page, "hello")
        page.wait_for_selector("#status[data-state=error]")
        page.wait_for_function("document.getElementById('note').textContent.includes('--cors-allow-origin')")
    assert _text(page, "#note") == (f"the sidecar at {sidecar.url} answered, but does not let pages from "
                                    f"{origin} read its answers: start it with --cors-allow-origin {origin}")


@pytest.mark.slow
def test_nothing_listening_says_so_in_words(page: Any) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    template = importlib.resources.files("tokenwire.sidecar.process").joinpath("static/playground.html")
    with served_page(template.read_text("utf-8").replace("{{PROXY_URL}}", dead).encode()) as origin:
        page.goto(origin + "/")
        page.wait_for_selector("#model[data-loaded=true]", state="attached")
        _send(page, "hello")
        page.wait_for_selector("#status[data-state=error]")
        page.wait_for_function("document.getElementById('note').textContent.startsWith('nothing answers')")
    assert _text(page, "#note").startswith(f"nothing answers at {dead}: is the sidecar running")


@pytest.mark.slow
def test_an_error_status_is_shown_with_the_sidecars_message(start_sidecar, page: Any) -> None:
    # An upstream that refuses connections: the sidecar answers 502 with its reason.
    sidecar = start_sidecar(f"http://127.0.0.1:{_free_port()}", admin_listen="127.0.0.1:0", retry_attempts=0)
    _open(page, sidecar)
    assert _text(page, "#note").startswith("could not list the models: the sidecar answered HTTP 502: ")
    _send(page, "hello")
    page.wait_for_selector("#status[data-state=error]")
    prefix = "the sidecar answered HTTP 502: "
    note = _text(page, "#note")
    assert note.startswith(prefix) and len(note) > len(prefix)


@pytest.mark.slow
def test_the_policy_menu_asks_for_block_and_the_page_shows_how_the_stream_was_carried(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    page_upstream.tokens, page_upstream.delay_s = 400, 0.0
    sidecar = _playground(start_sidecar, page_upstream,
                          client_settings=("slow_client_policy=coalesce|block|drop",))
    _open(page, sidecar)
    page.eval_on_selector("#throttle", "e => { e.value = '100'; e.dispatchEvent(new Event('input')); }")
    page.select_option("#policy", "block")
    _send(page, "slowly")
    page.wait_for_selector("#status[data-state=done]", timeout=30_000)
    assert _text(page, "#output") == expected_text(400)
    # From event: tokenwire.open and event: tokenwire.done, which the page asks for;
    # neither is counted among the stream's events.
    assert _text(page, "#policy-used") == "block"
    assert _text(page, "#coalesced") == "0"  # block merges nothing
    record = sidecar.record(_text(page, "#request-id"))
    assert record.coalesced_events == 0 and record.producer_wait_s >= 0.0
    assert _shown_ms(_text(page, "#producer-wait")) == pytest.approx(record.producer_wait_s * 1000, abs=0.01)
    assert int(_text(page, "#events")) == record.events_out - 2


@pytest.mark.slow
def test_a_policy_the_sidecar_does_not_allow_is_refused_in_words(
        start_sidecar, page_upstream: PageUpstream, page: Any) -> None:
    sidecar = _playground(start_sidecar, page_upstream)  # client_settings allow no policy
    _open(page, sidecar)
    page.select_option("#policy", "drop")
    _send(page, "hello")
    page.wait_for_selector("#status[data-state=error]")
    note = _text(page, "#note")
    assert note.startswith("the sidecar answered HTTP 400: ") and "tokenwire-slow-client-policy" in note, note
