"""The app's ``send`` writing inline (``asgi.exchange.app_send``, ``asgi.writer.start_send``).

The server here is a hand-written ASGI ``send``/``receive`` pair, because the
cases under test are the server's ``send`` suspending in the middle of a
stream and raising from it (an ASGI 2.4 server whose client left), at chosen
events, which a real server does only by timing. The middleware is the real one.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tokenwire.middleware import EndReason, StreamRecord, TokenWireMiddleware

EVENTS = 40


def event(i: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i


def text_of(body: bytes) -> str:
    return "".join(json.loads(line[len(b"data: "):])["choices"][0]["delta"]["content"]
                   for line in body.split(b"\n") if line.startswith(b"data: "))


class Server:
    """An ASGI server's half of one request: records what it is sent.
    ``suspend_at``: the body message (counting from 0) whose ``send`` waits
    until ``release()``; ``raise_at``: the one whose ``send`` raises ``error``."""

    def __init__(self, *, suspend_at: int | None = None, raise_at: int | None = None,
                 error: Exception | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.suspend_at = suspend_at
        self.raise_at = raise_at
        self.error = error
        self.released = asyncio.Event()
        self.suspended = asyncio.Event()
        self.gone = asyncio.Event()
        self.bodies = 0

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            index = self.bodies
            self.bodies += 1
            if index == self.raise_at:
                assert self.error is not None
                self.gone.set()
                raise self.error
            if index == self.suspend_at:
                self.suspended.set()
                await self.released.wait()
        self.messages.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def streaming_app(finished: asyncio.Event, *, half_sent: asyncio.Event | None = None,
                  go_on: asyncio.Event | None = None) -> Any:
    """``EVENTS`` events; with ``half_sent``/``go_on``, it says when half are
    sent and waits to be told to send the rest."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(EVENTS):
            if i == EVENTS // 2 and half_sent is not None and go_on is not None:
                half_sent.set()
                await go_on.wait()
            await send({"type": "http.response.body", "body": event(i), "more_body": True})
            await asyncio.sleep(0)
        finished.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
         "path": "/", "headers": []}


def test_inline_send_when_server_send_suspends_then_app_goes_on_and_every_event_arrives_in_order() -> None:
    records: list[StreamRecord] = []

    async def main() -> tuple[Server, bool, int]:
        server = Server(suspend_at=5)
        finished, half_sent, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()
        middleware = TokenWireMiddleware(streaming_app(finished, half_sent=half_sent, go_on=go_on),
                                         on_finished=records.append)
        call = asyncio.ensure_future(middleware(dict(SCOPE), server.receive, server.send))
        await asyncio.wait_for(server.suspended.wait(), 5)
        # The app is not held by the suspended send: it goes on sending.
        await asyncio.wait_for(half_sent.wait(), 5)
        app_went_on = not server.released.is_set()
        server.released.set()
        # The writer finishes the suspended send and what queued behind it.
        while b"t%d" % (EVENTS // 2 - 1) not in server.body():
            await asyncio.sleep(0.001)
        sent_before_rest = len(server.messages)
        go_on.set()
        await asyncio.wait_for(call, 5)
        server.gone.set()
        return server, app_went_on, sent_before_rest

    server, app_went_on, sent_before_rest = asyncio.run(main())
    assert app_went_on
    body = server.body()
    # The events that queued behind the suspended send may be coalesced
    # (their deltas merged); each token arrives once and in order.
    assert body.startswith(b"".join(event(i) for i in range(5)))
    assert text_of(body) == "".join(f"t{i}" for i in range(EVENTS))
    # The second half went out one send per event again, after the suspended one.
    rest = server.messages[sent_before_rest:]
    assert [m["body"] for m in rest[:-1]] == [event(i) for i in range(EVENTS // 2, EVENTS)]
    assert rest[-1]["type"] == "http.response.body" and not rest[-1].get("more_body", False)
    assert [r.end_reason for r in records] == [EndReason.COMPLETE]


def test_inline_send_when_server_send_raises_os_error_then_stream_ends_as_client_gone_and_nothing_more_is_sent() -> None:  # noqa: E501
    records: list[StreamRecord] = []

    async def main() -> Server:
        server = Server(raise_at=7, error=ConnectionResetError("client gone"))
        finished = asyncio.Event()
        middleware = TokenWireMiddleware(streaming_app(finished), on_finished=records.append)
        await asyncio.wait_for(middleware(dict(SCOPE), server.receive, server.send), 5)
        return server

    server = asyncio.run(main())
    # Events 0-6 were sent; the 8th send raised; nothing was sent after it.
    assert server.body() == b"".join(event(i) for i in range(7))
    assert server.bodies == 8
    assert [r.end_reason for r in records] == [EndReason.CLIENT_GONE]
