"""HTTP/2 through the sidecar with the clients people use: h2load and nghttp
(nghttp2's), the OpenAI SDK over an HTTP/2 httpx client, and a headless
Chromium page holding 20 EventSource streams on one TLS connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme
from chromium import new_page, served_page
from clients import sse_datas, tls_server_files
from conftest import LoopThread, RunningSidecar
from upstreams import expected_text

CHAT = b'{"model":"m","stream":true,"messages":[]}'


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"no {name}: install Debian's nghttp2-client (scripts/system-deps.sh nghttp2-client)",
                    pytrace=False)
    return path


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    return tls_server_files(trustme.CA(), tmp_path)


def _h2load(url: str, body: Path, *, requests: int, clients: int, streams: int) -> dict[str, int]:
    run = subprocess.run(
        [_tool("h2load"), "-n", str(requests), "-c", str(clients), "-m", str(streams), "-d", str(body),
         "-H", "content-type: application/json", "-H", "x-fake-tokens: 20", url],
        capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr + run.stdout
    found = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed",
                      run.stdout)
    assert found, run.stdout
    total, _started, done, succeeded, failed = map(int, found.groups())
    assert "Application protocol: h2" in run.stdout, run.stdout
    return {"total": total, "done": done, "succeeded": succeeded, "failed": failed}


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["prior-knowledge", "tls-alpn"])
def test_h2load_when_many_streams_per_connection_then_every_one_succeeds(
        start_sidecar: Callable[..., RunningSidecar], tmp_path: Path, tls_files: dict[str, str],
        tls: bool) -> None:
    options = {"tls_cert": tls_files["tls_cert"], "tls_key": tls_files["tls_key"]} if tls else {}
    sidecar = start_sidecar(**options)
    body = tmp_path / "chat.json"
    body.write_bytes(CHAT)
    counts = _h2load(f"{sidecar.url}/normal/v1/chat/completions", body, requests=400, clients=4, streams=50)
    assert counts == {"total": 400, "done": 400, "succeeded": 400, "failed": 0}
    records = list(sidecar.log.records)
    assert len(records) >= 400 and all(r.end_reason.value == "complete" for r in records)
    assert {extra["http_version"] for extra in sidecar.log.extras.values()} == {"2"}


@pytest.mark.slow
def test_nghttp_when_streamed_then_the_whole_answer_and_end_stream(
        start_sidecar: Callable[..., RunningSidecar], tmp_path: Path) -> None:
    sidecar = start_sidecar()
    body = tmp_path / "chat.json"
    body.write_bytes(CHAT)
    run = subprocess.run(
        [_tool("nghttp"), "-v", "-d", str(body), "-H", "content-type: application/json",
         "-H", "x-fake-tokens: 9", f"{sidecar.url}/normal/v1/chat/completions"],
        capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 0, run.stderr + run.stdout
    datas = sse_datas(run.stdout.encode())
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in datas if d.startswith("{") and json.loads(d).get("choices"))
    assert text == expected_text(9)
    assert re.search(r"recv DATA frame <length=\d+, flags=0x01, stream_id=13>", run.stdout), run.stdout
    assert "RST_STREAM" not in run.stdout


def test_openai_sdk_over_http2_httpx_then_streams_and_creates(
        start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar()
    with httpx.Client(http1=False, http2=True) as http_client:
        client = openai.OpenAI(base_url=f"{sidecar.url}/normal/v1", api_key="sk-test",
                               http_client=http_client, max_retries=0)
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_headers={"x-fake-tokens": "12"})
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        whole = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                               extra_headers={"x-fake-tokens": "4"})
    assert text == expected_text(12)
    assert whole.choices[0].message.content == expected_text(4)
    assert {extra["http_version"] for extra in sidecar.log.extras.values()} == {"2"}


# ------------------------------------------------------------------ Chromium

_STREAMS = 20
_TICKS = 400  # 20 s at 50 ms: over HTTP/1.1 the seventh stream would wait this long

PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire HTTP/2</title></head><body>
<pre id="log"></pre>
<script>
window.seen = [];
window.sources = [];
window.open_all = (base, count) => {
  for (let i = 0; i < count; i++) {
    const entry = {first: null, count: 0, errors: 0};
    window.seen.push(entry);
    const source = new EventSource(base + "/tick/" + i);
    source.onmessage = () => { if (entry.first === null) entry.first = performance.now(); entry.count += 1; };
    source.onerror = () => { entry.errors += 1; };
    window.sources.push(source);
  }
};
</script></body></html>
"""


@pytest.fixture
def page_origin() -> Iterator[str]:
    with served_page(PAGE) as origin:
        yield origin


class _TickerUpstream:
    """An upstream that answers each GET with an endless-looking SSE stream (an
    event every 50 ms) and notes when the sidecar closes each one."""

    def __init__(self) -> None:
        self.port = 0
        self.opened: dict[str, float] = {}
        self.closed: dict[str, float] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = "?"
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            self.opened[path] = time.monotonic()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            watcher = asyncio.ensure_future(reader.read(1))
            for i in range(_TICKS):
                event = b"data: tick %d\n\n" % i
                writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                await writer.drain()
                done, _ = await asyncio.wait({watcher}, timeout=0.05)
                if done:
                    break
            watcher.cancel()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed[path] = time.monotonic()
            writer.close()


@pytest.mark.slow
def test_chromium_when_twenty_event_sources_over_tls_then_all_flow_at_once_and_a_closed_one_aborts_its_upstream(  # noqa: E501
        start_sidecar: Callable[..., RunningSidecar], loop_thread: LoopThread, browser: Any, page_origin: str,
        tls_files: dict[str, str]) -> None:
    ticker = _TickerUpstream()
    loop_thread.run(ticker.start())
    try:
        sidecar = start_sidecar(f"http://127.0.0.1:{ticker.port}", tls_cert=tls_files["tls_cert"],
                                tls_key=tls_files["tls_key"], cors_allow_origins=(page_origin,),
                                terminal_marker="", heartbeat_s=0.0)
        # The certificate is trustme's, which Chromium does not know: the test's own CA.
        with new_page(browser, ignore_https_errors=True) as page:
            page.goto(page_origin + "/")
            page.evaluate("([base, n]) => window.open_all(base, n)",
                          [f"https://localhost:{sidecar.port}", _STREAMS])
            page.wait_for_function(f"window.seen.filter(e => e.count >= 3).length === {_STREAMS}",
                                   timeout=15_000)
            seen = page.evaluate("window.seen")
            firsts = [entry["first"] for entry in seen]
            # Together: the spread of the first events is far below one stream's life (20 s).
            assert max(firsts) - min(firsts) < 2_000, firsts
            assert all(entry["errors"] == 0 for entry in seen)
            # The page closes one: its upstream is aborted; the others keep going.
            closed_path = "/tick/0"
            assert closed_path not in ticker.closed
            page.evaluate("window.sources[0].close()")
            deadline = time.monotonic() + 5
            while closed_path not in ticker.closed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert closed_path in ticker.closed, "closing the EventSource did not abort its upstream"
            counts = [entry["count"] for entry in page.evaluate("window.seen")]
            time.sleep(0.3)
            later = [entry["count"] for entry in page.evaluate("window.seen")]
            assert all(b > a for a, b in zip(counts[1:], later[1:], strict=True))
            assert len([p for p in ticker.closed if p != closed_path]) == 0
        metrics = httpx.get(sidecar.admin_url + "/metrics").text
        assert f'tokenwire_client_requests_total{{protocol="h2"}} {_STREAMS}.0' in metrics
    finally:
        with contextlib.suppress(Exception):
            loop_thread.run(ticker.stop())
