"""The fake OpenAI upstream of the client suite: one script per wire feature,
and the ASGI app that plays them.

The same app is the upstream a client reads *directly*, the app inside
``TokenWireMiddleware``, and the upstream behind the sidecar, so every client
sees the same bytes with the same timing whichever way it comes. A request's
path picks the script: ``/<case>/<feature>/v1/chat/completions`` (any method,
body ignored), so an OpenAI client's ``base_url`` is ``.../<case>/<feature>/v1``
and a browser ``EventSource`` can GET the same URL. ``/page`` is the browser
suite's page (same origin as the stream it reads, so no CORS is involved).
``/finished/<case>`` answers ``yes`` once the case's answer is all written
(a slow reader stalls until then, so tokenwire surely holds the rest).

The steps are the behaviour suite's (``Send``/``Silence``/``Fail``); ``Fail``
makes the app raise, which is how an upstream dies mid-body (uvicorn cuts the
connection without the chunked terminator; the middleware sees the exception).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from behaviour.scenarios import Fail, Send, Silence, Step, play_steps

from ..replay import Transcript

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

GAP_S = 0.002
"""Between events of the short scripts: each one its own write, as an engine's."""
SLOW_TEXT_CHUNKS = 500
SLOW_TOOL_FRAGMENTS = 300
SLOW_PIECE_CHARS = 1000
"""A slow reader's answer: 500 chunks of text, then a tool call of 300 argument
fragments, ~1 kB each (an engine that sends several tokens per chunk): ~1 MB,
far more than kernel and client buffers hold, so tokenwire must hold (and
merge) the rest while the client stalls."""
BROWSER_SLOW_SCALE = 5
"""A browser reads its slow answers over a slow link (``servers.SlowLink``),
so they are five times smaller."""
SILENCE_S = 0.5
"""The silent prefill; the heartbeat profile beats every 0.15 s."""

ERROR_MID = {"message": "CUDA error: an illegal memory access was encountered",
             "type": "InternalServerError", "param": None, "code": 500, "object": "error"}
"""vLLM's in-band error after some text: an ``ErrorResponse`` with a numeric code."""
ERROR_FIRST = {"message": "This model's maximum context length is 4096 tokens. However, you "
                          "requested 5000 tokens.", "type": "BadRequestError", "param": "messages",
               "code": 400, "object": "error"}
"""vLLM's answer to a bad prompt once streaming has started: the first and only event."""
OVERLOADED = {"error": {"message": "The server is overloaded", "type": "server_error",
                        "param": None, "code": "overloaded"}}
BAD_GATEWAY = {"error": {"message": "no healthy engine behind the gateway", "type": "server_error",
                         "param": None, "code": None}}


def chunk(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk`` as vLLM writes it."""
    return {"id": "chatcmpl-compat", "object": "chat.completion.chunk", "created": 1767225600,
            "model": "compat-model", "system_fingerprint": "fp_compat", "choices": list(choices), **extra}


def choice(index: int = 0, *, finish: str | None = None, logprobs: Any = None,
           **delta: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def event(obj: Any, gap_s: float = GAP_S) -> Send:
    return Send(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n", gap_s=gap_s)


DONE = Send(b"data: [DONE]\n\n", gap_s=GAP_S)
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
         " Ünïcödé", " ✓", " 日本", " done", "\n"]


def asks_usage(body: bytes) -> bool:
    """The request asked for the usage chunk (``stream_options.include_usage``)."""
    try:
        options = json.loads(body or b"{}").get("stream_options") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(options, dict) and options.get("include_usage") is True


def _usage_only(step: Step) -> bool:
    return isinstance(step, Send) and b'"choices":[]' in step.data and b'"usage"' in step.data


def usage(completion_tokens: int, choices: int = 1) -> Send:
    return event(chunk(usage={"prompt_tokens": 7, "completion_tokens": completion_tokens * choices,
                              "total_tokens": 7 + completion_tokens * choices}))


def _text(words: list[str], **extra: Any) -> list[Step]:
    return [event(chunk(choice(role="assistant", content=""), **extra)),
            *(event(chunk(choice(content=word), **extra)) for word in words),
            event(chunk(choice(finish="stop"), **extra)), usage(len(words)), DONE]


def _arguments(call: int, fragments: int, lines_per_fragment: int = 1) -> list[str]:
    """A JSON argument string cut in ``fragments`` pieces (an agent writing a file)."""
    lines = fragments * lines_per_fragment
    body = json.dumps({"path": f"src/file_{call}.py",
                       "content": "".join(f"line {i}: print({i} * {call})\n" for i in range(lines))})
    size = -(-len(body) // fragments)
    return [body[i:i + size] for i in range(0, len(body), size)]


def _tool_calls() -> list[Step]:
    """Two parallel tool calls, their argument fragments interleaved, as vLLM streams them
    (a fast engine: no pause between fragments)."""
    gap_s = 0.0
    steps: list[Step] = [event(chunk(choice(role="assistant", content=None)))]
    args = [_arguments(0, 120), _arguments(1, 120)]
    for call in (0, 1):
        steps.append(event(chunk(choice(tool_calls=[{
            "index": call, "id": f"call_compat_{call}", "type": "function",
            "function": {"name": "write_file", "arguments": ""}}])), gap_s))
    for i in range(max(len(a) for a in args)):
        for call in (0, 1):
            if i < len(args[call]):
                steps.append(event(chunk(choice(tool_calls=[{
                    "index": call, "function": {"arguments": args[call][i]}}])), gap_s))
    steps += [event(chunk(choice(finish="tool_calls")), gap_s), usage(240), DONE]
    return steps


def _slow(obfuscation: bool, divide: int = 1) -> list[Step]:
    """Much text and one long tool call, sent as fast as the server takes it."""
    rng = random.Random(13)

    def pad() -> dict[str, str]:
        # OpenAI's `obfuscation`: random padding of random length on every chunk.
        return {"obfuscation": "".join(rng.choices("abcdefghXYZ0123456789", k=rng.randint(1, 16)))} \
            if obfuscation else {}

    steps: list[Step] = [event(chunk(choice(role="assistant", content=""), **pad()), 0.0)]
    filler = "lorem ipsum dolor sit amet, " * (SLOW_PIECE_CHARS // 28)
    texts = SLOW_TEXT_CHUNKS // divide
    steps += [event(chunk(choice(content=f"[{i}] {filler}"), **pad()), 0.0) for i in range(texts)]
    steps.append(event(chunk(choice(tool_calls=[{
        "index": 0, "id": "call_slow", "type": "function",
        "function": {"name": "write_file", "arguments": ""}}]), **pad()), 0.0))
    steps += [event(chunk(choice(tool_calls=[{"index": 0, "function": {"arguments": piece}}]), **pad()), 0.0)
              for piece in _arguments(7, SLOW_TOOL_FRAGMENTS // divide, SLOW_PIECE_CHARS // 25)]
    steps += [event(chunk(choice(finish="tool_calls"), **pad())), usage(texts), DONE]
    return steps


def _n2() -> list[Step]:
    steps: list[Step] = [event(chunk(choice(0, role="assistant", content=""), choice(1, role="assistant",
                                                                                     content="")))]
    for i, word in enumerate(WORDS):
        steps.append(event(chunk(choice(i % 2, content=word))))
        steps.append(event(chunk(choice(1 - i % 2, content=word.upper()))))
    steps += [event(chunk(choice(0, finish="stop"))), event(chunk(choice(1, finish="length"))),
              usage(len(WORDS), 2), DONE]
    return steps


def _logprobs() -> list[Step]:
    def lp(word: str, i: int) -> dict[str, Any]:
        top = [{"token": word, "logprob": -0.25 * i, "bytes": list(word.encode())},
               {"token": "x", "logprob": -3.5, "bytes": [120]}]
        return {"content": [{"token": word, "logprob": -0.25 * i, "bytes": list(word.encode()),
                             "top_logprobs": top}]}

    return [event(chunk(choice(role="assistant", content="", logprobs={"content": []}))),
            *(event(chunk(choice(content=w, logprobs=lp(w, i)))) for i, w in enumerate(WORDS)),
            event(chunk(choice(finish="stop"))), usage(len(WORDS)), DONE]


def _reasoning() -> list[Step]:
    thoughts = ["Let", " me", " think", " about", " foxes", "."]
    return [event(chunk(choice(role="assistant", content=""))),
            *(event(chunk(choice(reasoning_content=t))) for t in thoughts),
            *(event(chunk(choice(content=w))) for w in WORDS),
            event(chunk(choice(finish="stop"))), usage(len(WORDS) + len(thoughts)), DONE]


DEATH_AFTER_WORDS = 4
"""The in-band error and the upstream's death come after the role chunk and this many words."""


@dataclass(frozen=True)
class Script:
    steps: tuple[Step, ...]
    status: int = 200
    body: bytes = b""
    """The JSON body of a non-200 answer."""


SCRIPTS: dict[str, Script] = {
    "plain": Script(tuple(_text(WORDS))),
    "resume": Script(tuple(_text(WORDS))),
    "heartbeat": Script((event(chunk(choice(role="assistant", content=""))), Silence(SILENCE_S),
                         *_text(WORDS)[1:])),
    "slow_reader": Script(tuple(_slow(obfuscation=False))),
    "error_mid_stream": Script((*_text(WORDS)[:DEATH_AFTER_WORDS + 1], event({"error": ERROR_MID}))),
    "error_first_event": Script((event({"error": ERROR_FIRST}),)),
    "upstream_502": Script((), status=502, body=json.dumps(BAD_GATEWAY).encode()),
    "upstream_503": Script((), status=503, body=json.dumps(OVERLOADED).encode()),
    "upstream_death": Script((*_text(WORDS)[:DEATH_AFTER_WORDS + 1], Fail())),
    "tool_calls": Script(tuple(_tool_calls())),
    "n2": Script(tuple(_n2())),
    "logprobs": Script(tuple(_logprobs())),
    "reasoning": Script(tuple(_reasoning())),
    "obfuscation": Script(tuple(_slow(obfuscation=True))),
}
ENGINE_TRANSCRIPTS = ("vllm_chat_reasoning", "vllm_reasoning_field", "vllm_tool_calls", "tgi_chat",
                      "sglang_chat_reasoning", "sglang_tool_calls", "llamacpp_chat_reasoning",
                      "llamacpp_tool_calls", "ollama_chat_reasoning", "ollama_tool_calls")
"""The engines' own stream shapes (``tests/compat/transcripts``, OpenAI route, no error),
played one event per write: each is a feature ``engine_<name>`` too."""
SCRIPTS.update({f"engine_{name}": Script(tuple(Send(raw, gap_s=GAP_S)
                                               for raw in Transcript.load(name).raw_events()))
                for name in ENGINE_TRANSCRIPTS})
FEATURES = tuple(SCRIPTS)
SMALL_SCRIPTS = {"slow_reader": Script(tuple(_slow(obfuscation=False, divide=BROWSER_SLOW_SCALE))),
                 "obfuscation": Script(tuple(_slow(obfuscation=True, divide=BROWSER_SLOW_SCALE)))}
SMALL_CLIENTS = ("browser-eventsource", "browser-fetch")
"""Cases (``<client>.<feature>.<target>``) of these clients get ``SMALL_SCRIPTS``."""

SLOW_FEATURES = frozenset({"slow_reader", "obfuscation"})
"""The client stalls after its first event, then reads on."""
PROFILE = {"resume": "resume", "heartbeat": "heartbeat"}
"""The tokenwire configuration (profile) a feature runs under; every other one runs on ``plain``."""


class UpstreamFailure(Exception):
    """Raised by the app for a ``Fail`` step: the upstream dies mid-body."""


PAGE_FILE = Path(__file__).resolve().parent / "page.html"


class ScriptedUpstream:
    """The ASGI app; ``requests[case]`` lists the request id of every request
    a case made (the sidecar's forwarded ``x-request-id``, the middleware's
    own id, or ``""`` when read directly)."""

    def __init__(self) -> None:
        self.requests: defaultdict[str, list[str]] = defaultdict(list)
        self.finished: set[str] = set()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        parts = scope["path"].strip("/").split("/")
        if parts[0] == "page":
            body = PAGE_FILE.read_bytes()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if parts[0] == "finished":
            answer = b"yes" if parts[1] in self.finished else b"no"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain"),
                                    (b"content-length", b"%d" % len(answer)),
                                    (b"access-control-allow-origin", b"*")]})
            await send({"type": "http.response.body", "body": answer})
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        case, feature = parts[0], parts[1]
        control = (scope.get("extensions") or {}).get("tokenwire")
        headers = dict(scope["headers"])
        request_id = control.request_id if control is not None else headers.get(b"x-request-id", b"").decode()
        self.requests[case].append(request_id)
        small = case.split(".")[0] in SMALL_CLIENTS and feature in SMALL_SCRIPTS
        script = SMALL_SCRIPTS[feature] if small else SCRIPTS[feature]
        if script.status != 200:
            await send({"type": "http.response.start", "status": script.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(script.body)).encode())]})
            await send({"type": "http.response.body", "body": script.body})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        # As OpenAI and vLLM do: the usage-only chunk only for a request that asked
        # (stream_options.include_usage), which the sidecar does for a client that did not.
        steps = script.steps if asks_usage(bytes(body)) else tuple(
            step for step in script.steps if not _usage_only(step))
        await play_steps(steps, send, lambda: UpstreamFailure(f"{case}: the upstream dies mid-body"))
        self.finished.add(case)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
