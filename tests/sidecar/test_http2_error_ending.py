"""How an HTTP/2 stream ends after an in-band error, as the clients people use
see it: the error event in full, the text before it, and an ending that does
not pass for a finished answer.

The fake upstream's ``/die`` path sends the role chunk, ``t0``, ``t1`` and then
drops its socket mid-body; the wire core answers with its error event
(``upstream_failed``) and ``CloseClient(abrupt=True)``. Over HTTP/2 the stream
then ends with trailers naming the error (``tokenwire-error-code``,
``tokenwire-error-number``) on END_STREAM, after every DATA byte. A
RST_STREAM(INTERNAL_ERROR) there made curl drop the error event every time
(and sometimes ``t1``), and Chromium (fetch, EventSource) most of the body even
when a PING round trip proved its network stack had read every DATA frame: a
reset errors the body and drops what the page had not read yet. A client that
stops reading is still reset, after ``close_flush_timeout_s``.

Every run is repeated (``_RUNS``): the drop was a race, won most of the time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme
from chromium import new_page, served_page
from clients import sse_datas, tls_server_files
from conftest import RunningSidecar
from h2client import H2Client, chat_headers
from upstreams import expected_text

CHAT = b'{"model":"m","stream":true,"messages":[]}'
DIE_PATH = "/die/v1/chat/completions"
_RUNS = 5
_TEXT = expected_text(2)  # what /die sends before it dies: "t0 t1 "
_TRAILERS = {b"tokenwire-error-code": b"upstream_failed", b"tokenwire-error-number": b"E7307"}
# A bound for a run that went wrong, never the pace of one that goes right.
_BOUND_S = 30


def _text(datas: list[str]) -> str:
    text = ""
    for data in datas:
        if data.startswith("{"):
            for choice in json.loads(data).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def _assert_failed_answer(datas: list[str]) -> None:
    """The SSE body of a dead answer: the text before the cut, the whole error
    event last, no terminal marker."""
    assert datas, "no event at all"
    error = json.loads(datas[-1])["error"]  # a cut event would not parse
    assert error["code"] == "upstream_failed" and error["tokenwire"]["number"] == "E7307", error
    assert "[DONE]" not in datas
    assert _text(datas[:-1]) == _TEXT


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    return tls_server_files(trustme.CA(), tmp_path)


# ------------------------------------------------------------------ the frames


def test_h2_when_upstream_dies_then_error_event_then_error_trailers_on_end_stream_and_a_finished_one_has_none(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    with H2Client(sidecar.port) as client:
        for _ in range(_RUNS):
            good = client.request("/normal/v1/chat/completions", method="POST", body=CHAT,
                                  headers=chat_headers(3))
            dead = client.request(DIE_PATH, method="POST", body=CHAT, headers=chat_headers(5))
            finished, died = client.response(good, _BOUND_S), client.response(dead, _BOUND_S)
            assert finished.ended and finished.reset_code is None and finished.trailers == []
            assert sse_datas(bytes(finished.body))[-1] == "[DONE]"
            assert died.ended and died.reset_code is None and died.status == 200
            assert dict(died.trailers) == _TRAILERS
            _assert_failed_answer(sse_datas(bytes(died.body)))


def test_h2_when_the_window_lets_sixteen_bytes_at_a_time_then_the_trailers_come_after_the_whole_error_event(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    """A stream window of 16 bytes, credited as each DATA frame is read: the
    error event leaves in pieces, each waiting for a WINDOW_UPDATE, and the
    trailers (which flow control does not hold) still come after its last one."""
    sidecar = start_sidecar()
    with H2Client(sidecar.port, settings={4: 16}) as client:
        dead = client.request(DIE_PATH, method="POST", body=CHAT, headers=chat_headers(5))
        died = client.response(dead, _BOUND_S)
    assert died.ended and died.reset_code is None and dict(died.trailers) == _TRAILERS
    assert len(died.data_times) > 20  # it did come 16 bytes at a time
    _assert_failed_answer(sse_datas(bytes(died.body)))


def test_h2_when_the_client_stops_reading_before_the_error_event_then_reset_after_close_flush_timeout(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    """The error event and its trailers wait for a window that never opens:
    ``close_flush_timeout_s`` later the stream is reset (INTERNAL_ERROR), which
    still says the answer failed, and the sidecar holds nothing for it."""
    sidecar = start_sidecar(close_flush_timeout_s=0.5, write_deadline_s=300.0)
    with H2Client(sidecar.port, settings={4: 16}) as client:
        dead = client.request(DIE_PATH, method="POST", body=CHAT,
                              headers=[*chat_headers(5), (b"x-request-id", b"h2-stops-reading")])
        state = client.streams[dead]
        # Credit each frame until the one that completes t1's event: then the window stays shut.
        client.credits = lambda stream_id: _text(sse_datas(bytes(state.body))) != _TEXT
        assert client.read_until(lambda: state.reset_code is not None, _BOUND_S), bytes(state.body)
        assert state.reset_code == 2 and not state.ended and state.trailers == []
        datas = sse_datas(bytes(state.body))
        assert _text(datas) == _TEXT and not any('"error"' in data for data in datas)
        # The in-band error's ending (the core's), not a slow reader's (write_deadline_s).
        assert sidecar.record("h2-stops-reading").end_reason.value == "upstream_error"


# ------------------------------------------------------------------ curl


def _curl(url: str, headers_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    curl = shutil.which("curl")
    assert curl is not None, "no curl"
    return subprocess.run(
        [curl, "-sS", "-N", "--max-time", str(_BOUND_S), "-D", str(headers_file),
         "-w", "\n%{http_version}", "-X", "POST", "-H", "content-type: application/json",
         "--data-binary", CHAT.decode(), *extra, url],
        capture_output=True, text=True, timeout=_BOUND_S + 10, check=False)


def _trailers(headers_file: Path) -> dict[bytes, bytes]:
    """curl's -D file holds the head, a blank line, then the trailers."""
    _head, _, tail = headers_file.read_bytes().partition(b"\r\n\r\n")
    fields = (line.split(b":", 1) for line in tail.split(b"\r\n") if b":" in line)
    return {name.strip().lower(): value.strip() for name, value in fields}


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["prior-knowledge", "tls-alpn"])
def test_curl_when_upstream_dies_then_every_run_shows_the_error_event_and_the_error_trailers(
        start_sidecar: Callable[..., RunningSidecar], tls_files: dict[str, str], tmp_path: Path,
        tls: bool) -> None:
    """``curl -N`` over HTTP/2: the text, the whole error event, and the
    trailers in its header dump. curl exits 0 (END_STREAM is a clean HTTP/2
    ending); what says the answer failed is the body (the error event, no
    ``[DONE]``) and the trailers, which a finished answer never has."""
    options: tuple[str, ...]
    if tls:
        sidecar = start_sidecar(tls_cert=tls_files["tls_cert"], tls_key=tls_files["tls_key"])
        base, options = f"https://localhost:{sidecar.port}", ("--http2", "--cacert", tls_files["ca"])
    else:
        sidecar = start_sidecar()
        base, options = sidecar.url, ("--http2-prior-knowledge",)
    headers_file = tmp_path / "headers"
    for _ in range(_RUNS):
        run = _curl(base + DIE_PATH, headers_file, *options)
        body, _, version = run.stdout.rpartition("\n")
        assert run.returncode == 0 and version == "2", (run.returncode, run.stderr, version)
        _assert_failed_answer(sse_datas(body.encode()))
        assert _trailers(headers_file) == _TRAILERS
    run = _curl(base + "/normal/v1/chat/completions", headers_file, *options)
    body, _, _ = run.stdout.rpartition("\n")
    assert run.returncode == 0 and sse_datas(body.encode())[-1] == "[DONE]"
    assert _trailers(headers_file) == {}


# ------------------------------------------------------------------ the OpenAI SDK


def test_openai_sdk_over_http2_httpx_when_upstream_dies_then_the_text_then_api_error_from_the_event(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    with httpx.Client(http1=False, http2=True) as http_client:
        client = openai.OpenAI(base_url=f"{sidecar.url}/die/v1", api_key="sk-test",
                               http_client=http_client, max_retries=0)
        for _ in range(_RUNS):
            text = ""
            with pytest.raises(openai.APIError, match="upstream failed"):
                for chunk in client.chat.completions.create(
                        model="fake", messages=[{"role": "user", "content": "hi"}], stream=True):
                    text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            assert text == _TEXT
    assert {extra["http_version"] for extra in sidecar.log.extras.values()} == {"2"}


# ------------------------------------------------------------------ Chromium

PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire HTTP/2 error ending</title></head><body>
<script>
const bound = (ms) => new Promise((resolve) => setTimeout(() => resolve({outcome: "no end in time"}), ms));
window.viaFetch = (url, ms) => Promise.race([bound(ms), (async () => {
  const seen = {body: "", outcome: null};
  try {
    const response = await fetch(url, {method: "POST", headers: {"content-type": "application/json"},
                                       body: '{"model":"m","stream":true,"messages":[]}'});
    seen.status = response.status;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      seen.body += decoder.decode(value, {stream: true});
    }
    seen.outcome = "ended";
  } catch (error) {
    seen.outcome = "failed: " + error;
  }
  return seen;
})()]);
window.viaEventSource = (url, ms) => Promise.race([bound(ms), new Promise((resolve) => {
  const seen = {datas: [], outcome: null};
  const source = new EventSource(url);
  source.onmessage = (event) => seen.datas.push(event.data);
  // The end of the body (clean or not): no reconnect, the run is over.
  source.onerror = () => { source.close(); seen.outcome = "ended"; resolve(seen); };
})]);
</script></body></html>
"""


@pytest.fixture
def page_origin() -> Iterator[str]:
    with served_page(PAGE) as origin:
        yield origin


@pytest.fixture
def tls_sidecar(start_sidecar: Callable[..., RunningSidecar], tls_files: dict[str, str],
                page_origin: str) -> RunningSidecar:
    """Chromium speaks HTTP/2 only under TLS (ALPN); the page calls it cross-origin."""
    return start_sidecar(tls_cert=tls_files["tls_cert"], tls_key=tls_files["tls_key"],
                         cors_allow_origins=(page_origin,))


@pytest.mark.slow
def test_chromium_fetch_over_h2_when_upstream_dies_then_every_run_reads_the_text_and_the_whole_error_event(
        tls_sidecar: RunningSidecar, browser: Any, page_origin: str) -> None:
    url = f"https://localhost:{tls_sidecar.port}{DIE_PATH}"
    with new_page(browser, ignore_https_errors=True) as page:
        page.goto(page_origin + "/")
        for _ in range(_RUNS):
            seen = page.evaluate("([url, ms]) => window.viaFetch(url, ms)", [url, _BOUND_S * 1000])
            assert seen["outcome"] == "ended" and seen["status"] == 200, seen
            _assert_failed_answer(sse_datas(seen["body"].encode()))
    versions = [extra["http_version"] for extra in tls_sidecar.log.extras.values()]
    assert versions.count("2") >= _RUNS and set(versions) == {"2"}, versions


@pytest.mark.slow
def test_chromium_event_source_over_h2_when_upstream_dies_then_every_run_dispatches_the_text_and_the_error_event(  # noqa: E501
        tls_sidecar: RunningSidecar, browser: Any, page_origin: str) -> None:
    url = f"https://localhost:{tls_sidecar.port}{DIE_PATH}"
    with new_page(browser, ignore_https_errors=True) as page:
        page.goto(page_origin + "/")
        for _ in range(_RUNS):
            seen = page.evaluate("([url, ms]) => window.viaEventSource(url, ms)", [url, _BOUND_S * 1000])
            assert seen["outcome"] == "ended", seen
            _assert_failed_answer(seen["datas"])
    versions = [extra["http_version"] for extra in tls_sidecar.log.extras.values()]
    assert len(versions) >= _RUNS and set(versions) == {"2"}, versions
