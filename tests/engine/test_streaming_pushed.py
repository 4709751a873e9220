"""PushedEventStream: outputs pushed from loop callbacks are written by the caller
when the server's send completes at once, and by the response's task when it
suspends. The ASGI server here is a recorder whose ``send`` suspends on demand
(a gate), which is what a full socket does to uvicorn's; the end-to-end paths
(uvicorn, the middleware, real clients) are in ``test_api.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tokenwire.engine.streaming import SERVER_SEND_KEY, PushedEventStream


def _render(batch: list[str]) -> tuple[list[str], bool]:
    """Items are texts; "END" ends the stream with a last event of its own."""
    ended = batch[-1] == "END"
    texts = batch[:-1] if ended else batch
    events = [f"data: {''.join(texts)}\n\n"] if texts else []
    return ([*events, "data: [DONE]\n\n"] if ended else events), ended


class _Server:
    """An ASGI ``send`` that records bodies and, while ``gate`` is set, suspends on it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None
        self.fail_next: Exception | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        gate = self.gate
        if gate is not None:
            await gate.wait()
        self.messages.append(message)

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


async def _receive() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_writes_inline_merges_what_waited_and_ends() -> None:
    async def scenario() -> None:
        closed: list[bool] = []
        server = _Server()
        stream = PushedEventStream(_render, {"X-Request-Id": "r1"}, first_event="data: role\n\n",
                                   on_close=lambda: closed.append(True))
        stream.push("a")  # before the head went out: waits
        stream.push("b")
        task = asyncio.ensure_future(stream({"type": "http"}, _receive, server.send))
        await _settle()
        assert server.messages[0]["type"] == "http.response.start"
        assert (b"x-request-id", b"r1") in server.messages[0]["headers"]
        assert server.bodies == [b"data: role\n\n", b"data: ab\n\n"]
        stream.push("c")
        # Written by push itself: no loop iteration in between.
        assert server.bodies[-1] == b"data: c\n\n"
        stream.push("END")
        await asyncio.wait_for(task, 5)
        assert server.bodies[-2:] == [b"data: [DONE]\n\n", b""]
        assert server.messages[-1]["more_body"] is False
        assert closed == [True]
        stream.push("late")  # after the end: dropped
        assert server.bodies[-1] == b""

    asyncio.run(scenario())


def test_a_suspended_send_is_finished_by_the_task_and_later_outputs_merge() -> None:
    async def scenario() -> None:
        server = _Server()
        stream = PushedEventStream(_render, {})
        task = asyncio.ensure_future(stream({"type": "http"}, _receive, server.send))
        await _settle()
        server.gate = asyncio.Event()
        stream.push("x")  # its send suspends on the gate
        stream.push("y")
        stream.push("z")
        await _settle()
        assert server.bodies == []
        gate, server.gate = server.gate, None
        gate.set()
        await _settle()
        # The suspended send completed first, then what waited went out as one event.
        assert server.bodies == [b"data: x\n\n", b"data: yz\n\n"]
        stream.push("w")
        assert server.bodies[-1] == b"data: w\n\n"
        stream.push("END")
        await asyncio.wait_for(task, 5)
        assert server.bodies[-2:] == [b"data: [DONE]\n\n", b""]

    asyncio.run(scenario())


async def _started() -> tuple[list[bool], _Server, PushedEventStream, asyncio.Future[None]]:
    """A stream whose response task runs and has sent its head; ``closed`` records on_close."""
    closed: list[bool] = []
    server = _Server()
    stream = PushedEventStream(_render, {}, on_close=lambda: closed.append(True))
    task = asyncio.ensure_future(stream({"type": "http"}, _receive, server.send))
    await _settle()
    return closed, server, stream, task


def test_an_inline_send_error_is_raised_by_the_response_task() -> None:
    async def scenario() -> None:
        closed, server, stream, task = await _started()
        server.fail_next = OSError("connection reset")
        stream.push("a")  # the error is kept for the task, not raised here
        stream.push("b")
        with pytest.raises(OSError, match="connection reset"):
            await asyncio.wait_for(task, 5)
        assert closed == [True]
        assert server.bodies == []

    asyncio.run(scenario())


def test_cancelling_the_task_during_a_suspended_send_closes_the_stream() -> None:
    async def scenario() -> None:
        closed, server, stream, task = await _started()
        server.gate = asyncio.Event()
        stream.push("a")
        await _settle()
        task.cancel()  # what the middleware does when the client leaves
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == [True]
        server.gate = None
        stream.push("b")  # dropped: nobody sends any more
        await _settle()
        assert server.bodies == []

    asyncio.run(scenario())


def test_events_go_to_the_servers_send_past_the_frameworks_and_a_done_future_completes_inline() -> None:
    async def scenario() -> None:
        server = _Server()
        framework: list[str] = []

        async def wrapped_send(message: dict[str, Any]) -> None:  # a framework's wrapper
            framework.append(message["type"])
            await server.send(message)

        answered: list[asyncio.Future[None]] = []

        def server_send(message: dict[str, Any]) -> asyncio.Future[None]:
            # As tokenwire's middleware answers a send it completed at once.
            server.messages.append(message)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            answered.append(done)
            return done

        stream = PushedEventStream(_render, {}, first_event="data: role\n\n")
        task = asyncio.ensure_future(
            stream({"type": "http", SERVER_SEND_KEY: server_send}, _receive, wrapped_send))
        await _settle()
        assert framework == ["http.response.start"]  # the head through the wrapper
        stream.push("a")
        assert server.bodies == [b"data: role\n\n", b"data: a\n\n"]
        # Completed there and then: nothing was left for the task to finish.
        assert stream._suspended is None and stream._wake is not None and not stream._wake.done()
        stream.push("END")
        await asyncio.wait_for(task, 5)
        assert framework == ["http.response.start"]
        assert server.bodies[-2:] == [b"data: [DONE]\n\n", b""]
        assert len(answered) == 4

    asyncio.run(scenario())
