"""A fake engine pod with a controllable queue, speed and prefix cache (balancing tests and bench).

It serves what a real engine serves, over real sockets, with none of the GPU:

* ``POST .../chat/completions`` (and ``.../completions``): the answer is an
  OpenAI event stream. The head goes out at once (as vLLM's does), then the
  request waits for one of ``--concurrency`` slots (``waiting``), is
  prefilled (``running``) for ``--prefill-s``, or ``--cached-prefill-s`` when
  this pod saw the same prompt prefix recently (an LRU of
  ``--cache-prefixes`` prefixes of the first ``--prefix-bytes`` bytes of the
  system message), then sends ``max_tokens`` (default ``--tokens``) chunks
  ``--token-s`` apart and ``[DONE]``. Every time is multiplied by
  ``--slowdown`` (a slower GPU). Each chunk names the pod (``"pod"``).
* ``GET /health``: 200 after ``health_delay_s`` (0 unless set by /control).
* ``GET /metrics``: ``tokenwire_engine_waiting`` and ``tokenwire_engine_running``.
* ``POST /control``: a JSON object that changes any of ``slowdown``,
  ``prefill_s``, ``cached_prefill_s``, ``token_s``, ``health_delay_s``,
  ``health_status``; answers the state.
* ``GET /stats``: requests received, streams completed, the most running at
  once, prefix cache hits, the ``user`` field of each request received.

Prints ``ready port=N`` when listening. ``python testbed/fake_engine.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import OrderedDict
from typing import Any


class FakeEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name: str = args.name
        self.state: dict[str, Any] = {
            "slowdown": args.slowdown, "prefill_s": args.prefill_s, "cached_prefill_s": args.cached_prefill_s,
            "token_s": args.token_s, "health_delay_s": 0.0, "health_status": 200,
        }
        self.tokens: int = args.tokens
        self.prefix_bytes: int = args.prefix_bytes
        self.cache_prefixes: int = args.cache_prefixes
        self.slots = asyncio.Semaphore(args.concurrency)
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.waiting = 0
        self.running = 0
        self.max_running = 0
        self.received = 0
        self.completed = 0
        self.cache_hits = 0
        self.users: list[str] = []
        """The ``user`` field of each request received (a client's tag for it)."""

    def _scaled(self, key: str) -> float:
        return float(self.state[key]) * float(self.state["slowdown"])

    def _prefix(self, payload: dict[str, Any]) -> bytes | None:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
            return None
        if messages[0].get("role") != "system":
            return None
        return str(messages[0].get("content", "")).encode()[: self.prefix_bytes]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                path = target.split("?", 1)[0]
                if method == "POST" and path.endswith("/completions"):
                    await self._complete(body, writer)
                elif path == "/health":
                    await asyncio.sleep(float(self.state["health_delay_s"]))
                    await self._json(writer, int(self.state["health_status"]), {"pod": self.name})
                elif path == "/metrics":
                    text = (f"# TYPE tokenwire_engine_waiting gauge\n"
                            f"tokenwire_engine_waiting {self.waiting}\n"
                            f"# TYPE tokenwire_engine_running gauge\n"
                            f"tokenwire_engine_running {self.running}\n")
                    await self._plain(writer, 200, b"text/plain; version=0.0.4", text.encode())
                elif method == "POST" and path == "/control":
                    self.state.update(json.loads(body or b"{}"))
                    await self._json(writer, 200, self.state)
                elif path == "/stats":
                    await self._json(writer, 200, {
                        "pod": self.name, "received": self.received, "completed": self.completed,
                        "max_running": self.max_running, "cache_hits": self.cache_hits,
                        "waiting": self.waiting, "running": self.running, "users": self.users})
                else:
                    await self._json(writer, 404, {"error": "no route"})
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _plain(self, writer: asyncio.StreamWriter, status: int, content_type: bytes,
                     body: bytes) -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                     % (status, content_type, len(body), body))
        await writer.drain()

    async def _json(self, writer: asyncio.StreamWriter, status: int, payload: object) -> None:
        await self._plain(writer, status, b"application/json", json.dumps(payload).encode())

    async def _chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        await writer.drain()

    async def _complete(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        self.received += 1
        payload = json.loads(body or b"{}")
        if isinstance(payload.get("user"), str):
            self.users.append(payload["user"])
        tokens = int(payload.get("max_tokens") or self.tokens)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            prefix = self._prefix(payload)
            cached = prefix is not None and prefix in self.cache
            if prefix is not None:
                self.cache[prefix] = None
                self.cache.move_to_end(prefix)
                while len(self.cache) > self.cache_prefixes:
                    self.cache.popitem(last=False)
            if cached:
                self.cache_hits += 1
            await asyncio.sleep(self._scaled("cached_prefill_s" if cached else "prefill_s"))
            for i in range(tokens):
                if i:
                    await asyncio.sleep(self._scaled("token_s"))
                chunk = {"id": "fake", "object": "chat.completion.chunk", "pod": self.name,
                         "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                await self._chunk(writer, b"data: %b\n\n" % json.dumps(chunk).encode())
            last = {"id": "fake", "object": "chat.completion.chunk", "pod": self.name,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            await self._chunk(writer, b"data: %b\n\ndata: [DONE]\n\n" % json.dumps(last).encode())
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.completed += 1
        finally:
            self.running -= 1
            self.slots.release()


async def main(args: argparse.Namespace) -> None:
    engine = FakeEngine(args)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", args.port, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"ready port={port}", flush=True)
    async with server:
        await server.serve_forever()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="pod")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8, help="requests running at once; more wait")
    parser.add_argument("--prefill-s", type=float, default=0.02)
    parser.add_argument("--cached-prefill-s", type=float, default=0.02)
    parser.add_argument("--token-s", type=float, default=0.005)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--prefix-bytes", type=int, default=8000)
    parser.add_argument("--cache-prefixes", type=int, default=4)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main(arguments))
