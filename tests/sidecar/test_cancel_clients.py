"""Cancel by id from real clients, over real sockets: openai-python's
``client.responses.cancel(id)`` (the Responses API's ``POST
.../responses/{id}/cancel``, the ``response.id`` the engine named) and a
browser page's ``fetch(url, {method: "DELETE"})`` of ``/v1/streams/{id}``,
cross-origin, so through a CORS preflight.

Both clients leave their stream first: with resume on and a grace of 10 s
the answer goes on generating, and only the cancel can stop it within the
5 s each test waits (the grace's own end would come later, and be recorded
as another end reason).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from chromium import new_page, served_page
from clients import wait_for
from conftest import LoopThread, RunningSidecar
from tokenwire.middleware import EndReason
from upstreams import FakeUpstream, Request, client_request_id

GRACE_S = 10.0
# How long a cancel may take to reach the upstream here: well inside the grace.
CLOSED_WITHIN_S = 5.0
RESPONSES_DELTAS = 5000
DELAY_S = 0.005
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def frame(kind: str, seq: int, **fields: Any) -> bytes:
    """One Responses API event, as OpenAI writes it (``event:`` and the same ``type``)."""
    data = json.dumps({"type": kind, **fields, "sequence_number": seq}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class CancelUpstream(FakeUpstream):
    """:class:`FakeUpstream` with two more modes (first path segment):

    * ``/resp/...``: ``POST .../responses`` streams a Responses answer named
      ``resp_<client request id>`` (``response.created``, 5000 text deltas
      5 ms apart, ``response.completed``); ``POST .../responses/{id}/cancel``
      is the engine's own cancel, which knows no response here: 404.
    * ``/long/...``: a chat answer of 5000 tokens 5 ms apart, chosen by the
      path alone (a browser page cannot send the ``x-fake-*`` headers: CORS
      allows only the headers an API client sends).
    """

    async def _respond(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        mode = request.path.split("/")[1]
        if mode == "long":
            request.headers.setdefault("x-fake-tokens", str(RESPONSES_DELTAS))
            request.headers.setdefault("x-fake-delay-s", str(DELAY_S))
        if mode != "resp":
            return await super()._respond(request, writer)
        if request.path.endswith("/cancel"):
            body = b'{"error":{"message":"No response found","type":"invalid_request_error","code":null}}'
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            request.finished_at = time.monotonic()
            return True
        response = {"id": f"resp_{client_request_id(request.headers)}", "object": "response",
                    "created_at": 0, "model": "fake", "status": "in_progress", "output": []}
        writer.write(HEAD)
        await self._send(writer, frame("response.created", 0, response=response))
        for seq in range(1, RESPONSES_DELTAS + 1):
            await asyncio.sleep(DELAY_S)
            await self._send(writer, frame("response.output_text.delta", seq, item_id="msg_1",
                                           output_index=0, content_index=0, delta=f"w{seq} ", logprobs=[]))
        await self._send(writer, frame("response.completed", RESPONSES_DELTAS + 1,
                                       response={**response, "status": "completed"}))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        request.finished_at = time.monotonic()
        return True


@pytest.fixture(scope="module")
def engine(loop_thread: LoopThread) -> Iterator[CancelUpstream]:
    fake = CancelUpstream()
    loop_thread.run(fake.start())
    yield fake
    loop_thread.run(fake.stop())


def _cancel_requests(engine: CancelUpstream, response_id: str) -> list[Request]:
    return [r for r in engine.requests if r.path.endswith(f"/responses/{response_id}/cancel")]


def _still_live(sidecar: RunningSidecar, engine: CancelUpstream, request_id: str) -> bool:
    """The stream generates on: its upstream connection open, no record written yet."""
    return (engine.connection_of(request_id).peer_closed_at is None
            and request_id not in [r.request_id for r in sidecar.log.records])


def test_openai_python_responses_cancel_stops_the_stream_it_left_and_another_key_cannot(
        start_sidecar: Callable[..., RunningSidecar], engine: CancelUpstream) -> None:
    sidecar = start_sidecar(engine.url, resume=True, resume_grace_s=GRACE_S)
    base_url = sidecar.url + "/resp/v1"
    alice = openai.OpenAI(base_url=base_url, api_key="sk-alice", max_retries=0)
    mallory = openai.OpenAI(base_url=base_url, api_key="sk-mallory", max_retries=0)
    request_id = "sdk-responses-cancel"
    seen: list[Any] = []
    with alice.responses.create(model="fake", input="hi", stream=True,
                                extra_headers={"x-request-id": request_id}) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 4:
                break  # the client leaves; the grace keeps the answer generating
    assert seen[0].type == "response.created", seen
    response_id = seen[0].response.id
    assert response_id == f"resp_{request_id}"
    assert [e.type for e in seen[1:]] == ["response.output_text.delta"] * 3
    assert _still_live(sidecar, engine, request_id)

    # Another key: the store holds no such response for it, so the engine is
    # asked, and answers as it does for a response it does not know.
    with pytest.raises(openai.NotFoundError):
        mallory.responses.cancel(response_id)
    assert len(_cancel_requests(engine, response_id)) == 1
    assert _still_live(sidecar, engine, request_id)

    # The owner's cancel: answered by the sidecar (the engine never sees it),
    # and the upstream aborted at once, in the grace.
    cancelled = alice.responses.cancel(response_id)
    assert (cancelled.id, cancelled.object, cancelled.status) == (response_id, "response", "cancelled")
    assert len(_cancel_requests(engine, response_id)) == 1
    connection = engine.connection_of(request_id)
    wait_for(lambda: connection.peer_closed_at is not None, timeout_s=CLOSED_WITHIN_S)
    assert sidecar.record(request_id).end_reason is EndReason.CANCELLED
    assert engine.requests_with(request_id)[0].finished_at is None  # never generated to its end

    # The SDK's own resume of it reads the rest of what was stored, then why it stopped.
    rest: list[Any] = []
    with pytest.raises(openai.APIError) as told:
        for event in alice.responses.retrieve(response_id, stream=True,
                                              starting_after=seen[-1].sequence_number):
            rest.append(event)
    assert told.value.code == "cancelled", told.value.body
    assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
    assert all(e.type == "response.output_text.delta" for e in rest)
    alice.close()
    mallory.close()


# The page reports what its fetches saw; every judgement is the test's.
PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tokenwire cancel</title></head><body>
<script>
window.seen = {};
// Starts a long answer, reads its first three events, then leaves (reader
// cancelled, request aborted): the stream id is what it keeps.
window.startAndLeave = async (base, auth, requestId) => {
  const seen = window.seen;
  try {
    const controller = new AbortController();
    const answer = await fetch(base + "/long/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: {"content-type": "application/json", "authorization": auth, "x-request-id": requestId},
      body: JSON.stringify({model: "fake", stream: true, messages: [{role: "user", content: "hi"}]}),
    });
    seen.status = answer.status;
    seen.streamId = answer.headers.get("x-tokenwire-stream-id");
    const reader = answer.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    while ((text.match(/\\n\\n/g) || []).length < 3) {
      const {value, done} = await reader.read();
      if (done) { seen.endedEarly = true; break; }
      text += decoder.decode(value, {stream: true});
    }
    seen.read = text;
    await reader.cancel();
    controller.abort();
    seen.left = true;
  } catch (error) {
    seen.startError = String(error);
  }
  return seen;
};
// DELETE /v1/streams/{id}: not a simple method, so the browser preflights it.
window.cancelStream = async (base, auth, streamId) => {
  try {
    const answer = await fetch(base + "/v1/streams/" + encodeURIComponent(streamId),
                               {method: "DELETE", headers: {"authorization": auth}});
    return {status: answer.status, body: await answer.json()};
  } catch (error) {
    return {error: String(error)};
  }
};
</script></body></html>
"""


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """Where the page is served: another origin than the sidecar's proxy port."""
    with served_page(PAGE) as origin:
        yield origin


@pytest.mark.slow
def test_browser_page_cancels_the_stream_it_left_with_a_cross_origin_delete(
        start_sidecar: Callable[..., RunningSidecar], engine: CancelUpstream, page_origin: str,
        browser: Any) -> None:
    sidecar = start_sidecar(engine.url, resume=True, resume_grace_s=GRACE_S,
                            cors_allow_origins=(page_origin,))
    request_id = "browser-cancel"
    auth = "Bearer sk-alice"
    with new_page(browser) as page:
        page.goto(page_origin + "/")
        started = page.evaluate("([b, a, r]) => window.startAndLeave(b, a, r)",
                                [sidecar.url, auth, request_id])
        assert started.get("startError") is None, started
        assert started["status"] == 200 and started.get("left") and not started.get("endedEarly"), started
        stream_id = started["streamId"]
        # Readable only if the sidecar exposes it (Access-Control-Expose-Headers).
        assert stream_id, f"the page could not read x-tokenwire-stream-id: {started}"
        assert "t0 " in started["read"], started
        assert _still_live(sidecar, engine, request_id)

        answer = page.evaluate("([b, a, s]) => window.cancelStream(b, a, s)", [sidecar.url, auth, stream_id])
    assert answer == {"status": 200, "body": {"id": stream_id, "object": "stream", "status": "cancelled"}}, \
        answer
    connection = engine.connection_of(request_id)
    wait_for(lambda: connection.peer_closed_at is not None, timeout_s=CLOSED_WITHIN_S)
    assert sidecar.record(request_id).end_reason is EndReason.CANCELLED
    assert engine.requests_with(request_id)[0].finished_at is None
