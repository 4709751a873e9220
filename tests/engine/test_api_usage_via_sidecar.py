"""The tiny engine behind a default sidecar: a streamed chat request that did not
ask for usage is sent to the engine with ``stream_options.include_usage``, the
client still gets no usage chunk, and the record counts the engine's own tokens."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from tokenwire.middleware import StreamRecord
from tokenwire.sidecar import Sidecar, SidecarConfig, StreamLog

if TYPE_CHECKING:
    from conftest import RunningServer


class Records(StreamLog):
    def __init__(self) -> None:
        super().__init__(None)
        self.records: list[StreamRecord] = []
        self.ended = threading.Condition()

    def write(self, record: StreamRecord, **extra: object) -> None:
        with self.ended:
            self.records.append(record)
            self.ended.notify_all()

    def of(self, request_id: str) -> StreamRecord:
        with self.ended:
            assert self.ended.wait_for(lambda: any(r.request_id == request_id for r in self.records), 30)
            return next(r for r in self.records if r.request_id == request_id)


@pytest.fixture
def sidecar(engine_server: RunningServer) -> Iterator[tuple[str, Records]]:
    records = Records()
    server = Sidecar(SidecarConfig(upstream=(engine_server.base_url,), listen="127.0.0.1:0", log_file=""),
                     log=records)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sidecar-usage", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(15)
    try:
        host, port = server.address
        yield f"http://{host}:{port}", records
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)


def chunks(url: str, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": request_id}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_a_client_that_did_not_ask_gets_no_usage_and_the_record_has_the_engines_count(
        engine_server: RunningServer, sidecar: tuple[str, Records]) -> None:
    url, records = sidecar
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
               "temperature": 0, "stream": True}
    theirs = chunks(url, request, "no-usage")
    assert theirs and all("usage" not in c or c["usage"] is None for c in theirs)
    record = records.of("no-usage")
    direct = chunks(engine_server.base_url, {**request, "stream_options": {"include_usage": True}}, "direct")
    engine_usage = next(c["usage"] for c in direct if c.get("usage"))
    assert record.tokens_out == (engine_usage["completion_tokens"], "usage")
    # A client that asked gets the usage chunk, as directly.
    asked = chunks(url, {**request, "stream_options": {"include_usage": True}}, "asked")
    assert [c["usage"] for c in asked if c.get("usage")] == [engine_usage]
    # One that said no is heard: no usage asked of the engine, none forwarded.
    refused = chunks(url, {**request, "stream_options": {"include_usage": False}}, "refused")
    assert not any(c.get("usage") for c in refused)
    assert records.of("refused").tokens_out[1] == "counted"
