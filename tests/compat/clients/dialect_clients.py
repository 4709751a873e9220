"""The Python clients of the dialect rows, each used as its documentation
shows, each returning a :class:`DialectOutcome` (what the application using it
ends up with), and the servers they read.

Servers (``running_dialect_servers``): the dialect upstream
(``dialect_scripts.DialectUpstream``) directly under uvicorn, inside
``TokenWireMiddleware`` (its defaults) under uvicorn, and behind a sidecar
built from the flags a user types (``tokenwire sidecar --upstream URL``), as
``servers.py`` builds the Chat Completions grid's ``plain`` profile; and the
same two again with its ``heartbeat`` profile (``--heartbeat-s 0.15``).

A slow reader (``stall`` given) takes the first event, calls ``stall()``
(:func:`wait_settled`: until the upstream wrote the whole answer, at most 0.5 s
directly), then reads on, as in ``py_clients.py``. Every client keeps its own
defaults (retries included) but for the base URL, a timeout and the API key.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from behaviour.drivers import serve
from tokenwire.middleware import StreamRecord, TokenWireMiddleware
from tokenwire.sidecar import Sidecar

from tokenwire.tools.cli import load_sidecar_config

from .dialect_scripts import SLOW_TOOL, DialectUpstream
from .outcome import jsonable
from .py_clients import TIMEOUT_S, _http2_client, speaks_h2
from .servers import MIDDLEWARE_CONFIG, SIDECAR_FLAGS, Servers, _Records, loop_in_thread, stall_max_s

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch at import

ANTHROPIC_MODEL = "claude-compat-1"
RESPONSES_MODEL = "gpt-compat-1"
LITELLM_RESPONSES_MODEL = "gpt-4.1"
"""litellm fakes a Responses stream (asks for a whole response, then replays it)
for a model its model map does not list: the litellm row names a listed one."""
PROMPT = "Write the file."
MAX_TOKENS = 1024
WRITE_FILE_SCHEMA = {"type": "object", "required": ["path", "content"],
                     "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}
ANTHROPIC_TOOLS = [{"name": SLOW_TOOL, "description": "Write a file.", "input_schema": WRITE_FILE_SCHEMA}]
LITELLM_TOOLS = [{"type": "function", "function": {"name": SLOW_TOOL, "description": "Write a file.",
                                                  "parameters": WRITE_FILE_SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": SLOW_TOOL, "description": "Write a file.",
                    "parameters": WRITE_FILE_SCHEMA, "strict": False}]

Stall = Callable[[], None]
DIALECT_PROFILES = ("plain", "heartbeat")
"""The tokenwire configurations the dialect rows read through (``servers.py``'s):
the defaults, and heartbeats every ``servers.HEARTBEAT_S`` (the ``heartbeats`` rows)."""


@dataclass
class DialectOutcome:
    """What a client ended up with. Which fields a client fills depends on
    what it exposes: ``events`` (the raw stream events it handed over, as
    JSON), or its own accumulation (``text``, ``thinking``, ``tools``,
    ``stop``, ``usage``, ``final``)."""

    status: int | None = None
    events: list[Any] | None = None
    text: str | None = None
    thinking: str | None = None
    tools: list[dict[str, Any]] | None = None
    """Tool calls: ``name``, ``arguments`` (the JSON text, or the parsed input where
    the client only gives that), ``id`` where the client gives it."""
    stop: Any = None
    """Stop reason, status or finish reason, as the client names it."""
    usage: Any = None
    final: Any = None
    """The client's final message or response object (``get_final_message()``...)."""
    error: dict[str, Any] | None = None
    """``kind`` (exception class), ``status``, ``type`` (the error object's), ``message``,
    ``body``; from the AI SDK also ``count`` and ``all`` (kind and message of each error)."""
    parts: list[Any] | None = None
    """The Vercel AI SDK's ``fullStream`` part types (runs of one type as one)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _body_error(body: Any) -> dict[str, Any] | None:
    """The error object inside an SDK error's body: ``body["error"]`` (Anthropic's
    ``{"type": "error", "error": {...}}``, or OpenAI's ``{"error": {...}}``), or the
    body itself when it is the error object."""
    if not isinstance(body, dict):
        return None
    inner = body.get("error")
    return inner if isinstance(inner, dict) else body


def error_fields(kind: str, status: Any, body: Any, message: str, **extra: Any) -> dict[str, Any]:
    """An error as the rows compare it: the error object's ``type`` and ``message``
    where the client hands one over (its body), else the exception's message."""
    inner = _body_error(body) or {}
    if isinstance(inner.get("message"), str):
        message = inner["message"]
    kind_of_error = inner.get("type") if isinstance(inner.get("type"), str) else None
    return {"kind": kind, "status": status, "type": kind_of_error, "message": message, "body": body, **extra}


def sdk_error(error: BaseException) -> dict[str, Any]:
    return error_fields(type(error).__name__, getattr(error, "status_code", None),
                        jsonable(getattr(error, "body", None)), str(error))


def from_node(obj: dict[str, Any]) -> DialectOutcome:
    """A Node case's outcome (``node/dialect_cases.mjs``), its error completed as a Python one's."""
    out = DialectOutcome(**obj)
    if out.error is not None:
        e = out.error
        out.error = error_fields(e["kind"], e["status"], e["body"], e["message"],
                                 **{k: e[k] for k in ("count", "all") if k in e})
    return out


# Servers --------------------------------------------------------------------

class _Noting(list[StreamRecord]):
    """The accounting records, each also noted by the upstream as an ended stream."""

    def __init__(self, upstream: DialectUpstream) -> None:
        super().__init__()
        self.upstream = upstream

    def append(self, record: StreamRecord) -> None:
        super().append(record)
        self.upstream.ended.add(record.request_id)


def wait_settled(servers: Servers, case: str) -> None:
    """A slow reader's pause, ``servers.Servers.stall``'s (until the upstream wrote
    all of ``case``'s answer, at most ``servers.stall_max_s(case)``), also woken
    when tokenwire ends the stream early (the upstream then never finishes)."""
    deadline = time.monotonic() + stall_max_s(case)
    upstream: DialectUpstream = servers.upstream  # type: ignore[assignment]
    while not upstream.settled(case) and time.monotonic() < deadline:
        time.sleep(0.01)


async def _start(servers: Servers, stack: contextlib.AsyncExitStack) -> None:
    app = servers.upstream
    direct = f"http://127.0.0.1:{await stack.enter_async_context(serve(app))}"
    for profile in DIALECT_PROFILES:
        servers.urls[("direct", profile)] = direct
        config = MIDDLEWARE_CONFIG[profile]
        wrapped = (TokenWireMiddleware(app, on_finished=servers.records.append) if config is None
                   else TokenWireMiddleware(app, config, on_finished=servers.records.append))
        port = await stack.enter_async_context(
            serve(wrapped, send_buffer_bytes=wrapped.config.socket_send_buffer_bytes))
        servers.urls[("middleware", profile)] = f"http://127.0.0.1:{port}"
        sidecar_config = load_sidecar_config(["--upstream", direct, "--listen", "127.0.0.1:0",
                                              "--admin-listen", "", "--drain-s", "0",
                                              *SIDECAR_FLAGS[profile]], {})
        sidecar = Sidecar(sidecar_config, log=_Records(servers.records, servers.http_versions))
        await sidecar.start()
        stack.push_async_callback(sidecar.shutdown)
        servers.urls[("sidecar", profile)] = f"http://127.0.0.1:{sidecar.address[1]}"


@contextlib.contextmanager
def running_dialect_servers() -> Iterator[Servers]:
    with loop_in_thread() as loop:
        upstream = DialectUpstream()
        servers = Servers(loop, upstream, records=_Noting(upstream))  # type: ignore[arg-type]
        stack = contextlib.AsyncExitStack()
        try:
            servers.run(_start(servers, stack))
            yield servers
        finally:
            servers.run(stack.aclose())


# Anthropic ------------------------------------------------------------------

def _anthropic_http2(base_url: str) -> Any:
    """anthropic-python's HTTP client is httpx2's (``http_client=httpx2.Client(...)``):
    HTTP/2 with prior knowledge where the server speaks it, as ``py_clients._http2_client``."""
    import httpx2

    return httpx2.Client(http2=True, http1=not speaks_h2(base_url), timeout=TIMEOUT_S)


def _anthropic(base_url: str, http2: bool) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key="compat", timeout=TIMEOUT_S,
                               http_client=_anthropic_http2(base_url) if http2 else None)


ANTHROPIC_ARGS: dict[str, Any] = {"model": ANTHROPIC_MODEL, "max_tokens": MAX_TOKENS,
                                  "tools": ANTHROPIC_TOOLS, "messages": [{"role": "user", "content": PROMPT}]}


def anthropic_stream(base_url: str, stall: Stall | None, *, http2: bool = False) -> DialectOutcome:
    """``client.messages.stream()``: ``text_stream``, then ``get_final_message()``
    (the SDK accumulates thinking, text and the tool input itself)."""
    out = DialectOutcome(text="")
    client = _anthropic(base_url, http2)
    try:
        with client.messages.stream(**ANTHROPIC_ARGS) as stream:
            out.status = stream.response.status_code
            for i, text in enumerate(stream.text_stream):
                out.text += text
                if stall is not None and i == 0:
                    stall()
            message = stream.get_final_message()
        out.final = jsonable(message.to_dict())
        out.stop = message.stop_reason
        out.usage = jsonable(message.usage.to_dict())
    except Exception as error:
        out.error = sdk_error(error)
    finally:
        client.close()
    return out


def _raw_events(client: Any, create: Callable[[], Any], stall: Stall | None) -> DialectOutcome:
    """The events of ``create()``'s stream as the SDK yields them (each SDK's
    ``create(stream=True)``), the client closed after."""
    out = DialectOutcome(events=[])
    try:
        stream = create()
        out.status = stream.response.status_code
        for event in stream:
            out.events.append(jsonable(event.to_dict()))
            if stall is not None and len(out.events) == 1:
                stall()
    except Exception as error:
        out.error = sdk_error(error)
    finally:
        client.close()
    return out


def anthropic_create(base_url: str, stall: Stall | None, *, http2: bool = False) -> DialectOutcome:
    """``client.messages.create(stream=True)``: the raw events."""
    client = _anthropic(base_url, http2)
    return _raw_events(client, lambda: client.messages.create(**ANTHROPIC_ARGS, stream=True), stall)


def langchain_anthropic(base_url: str, stall: Stall | None) -> DialectOutcome:
    """LangChain's ``ChatAnthropic(...).bind_tools(...).stream``, the chunks added
    up in one go (as ``py_clients.langchain`` does)."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages.ai import add_ai_message_chunks

    out = DialectOutcome()
    llm = ChatAnthropic(model=ANTHROPIC_MODEL, base_url=base_url, api_key="compat",  # type: ignore[call-arg,arg-type]
                        max_tokens=MAX_TOKENS, timeout=TIMEOUT_S).bind_tools(ANTHROPIC_TOOLS)
    pieces: list[Any] = []
    try:
        for piece in llm.stream(PROMPT):
            pieces.append(piece)
            if stall is not None and len(pieces) == 1:
                stall()
    except Exception as error:
        out.error = sdk_error(error)
    if pieces:
        merged = add_ai_message_chunks(pieces[0], *pieces[1:])
        blocks = merged.content if isinstance(merged.content, list) else [merged.content]
        out.text = "".join(b if isinstance(b, str) else b.get("text", "") for b in blocks
                           if isinstance(b, str) or b.get("type") == "text")
        out.thinking = "".join(b.get("thinking", "") for b in blocks if isinstance(b, dict)
                               and b.get("type") == "thinking")
        out.tools = [{"id": c["id"], "name": c["name"], "arguments": c["args"]} for c in merged.tool_calls]
        out.stop = merged.response_metadata.get("stop_reason")
        out.usage = jsonable(merged.usage_metadata)
        out.final = jsonable({"invalid_tool_calls": merged.invalid_tool_calls})
    return out


def litellm_anthropic(base_url: str, stall: Stall | None) -> DialectOutcome:
    """litellm's Anthropic provider: ``completion(model="anthropic/...",
    api_base=..., stream=True)``; the chunks are OpenAI-shaped."""
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    out = DialectOutcome(text="", thinking="")
    calls: dict[int, dict[str, Any]] = {}
    try:
        response = litellm.completion(model=f"anthropic/{ANTHROPIC_MODEL}", stream=True,
                                      messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
                                      api_base=base_url, api_key="compat", timeout=TIMEOUT_S,
                                      tools=LITELLM_TOOLS, stream_options={"include_usage": True})
        for i, chunk in enumerate(response):
            _litellm_chunk(out, calls, chunk)
            if stall is not None and i == 0:
                stall()
    except Exception as error:
        out.error = _litellm_error(error)
    out.tools = [calls[i] for i in sorted(calls)]
    return out


def _litellm_chunk(out: DialectOutcome, calls: dict[int, dict[str, Any]], chunk: Any) -> None:
    if getattr(chunk, "usage", None):
        out.usage = jsonable(chunk.usage.model_dump())
    for choice in chunk.choices:
        delta = choice.delta
        out.text += delta.content or ""
        out.thinking += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            into = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            into["id"] = call.id or into["id"]
            into["name"] = call.function.name or into["name"]
            into["arguments"] += call.function.arguments or ""
        out.stop = choice.finish_reason or out.stop


def _litellm_error(error: BaseException) -> dict[str, Any]:
    """litellm maps provider errors to its own classes; the provider's error
    object survives only in the message."""
    return {"kind": type(error).__name__, "status": getattr(error, "status_code", None), "type": None,
            "message": str(getattr(error, "message", error)), "body": None}


# OpenAI Responses -----------------------------------------------------------

RESPONSES_ARGS: dict[str, Any] = {"model": RESPONSES_MODEL, "input": PROMPT, "tools": RESPONSES_TOOLS}


def _openai(base_url: str, http2: bool) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url, api_key="compat", timeout=TIMEOUT_S,
                         http_client=_http2_client(base_url) if http2 else None)


def responses_create(base_url: str, stall: Stall | None, *, http2: bool = False) -> DialectOutcome:
    """openai-python ``client.responses.create(stream=True)``: the raw events."""
    client = _openai(base_url, http2)
    return _raw_events(client, lambda: client.responses.create(**RESPONSES_ARGS, stream=True), stall)


def responses_stream(base_url: str, stall: Stall | None, *, http2: bool = False) -> DialectOutcome:
    """openai-python ``client.responses.stream()``: its events (text and argument
    deltas added up as its docs show), then ``get_final_response()``."""
    out = DialectOutcome(text="", thinking="", tools=[])
    client = _openai(base_url, http2)
    arguments: dict[str, str] = {}
    try:
        with client.responses.stream(**RESPONSES_ARGS) as stream:
            for i, event in enumerate(stream):
                if event.type == "response.output_text.delta":
                    out.text += event.delta
                elif event.type == "response.reasoning_text.delta":
                    out.thinking += event.delta
                elif event.type == "response.function_call_arguments.delta":
                    arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
                elif event.type == "error":
                    out.events = [*(out.events or []), jsonable(event.to_dict())]
                if stall is not None and i == 0:
                    stall()
            response = stream.get_final_response()
        out.final = jsonable(response.to_dict())
        out.stop = response.status
        out.usage = jsonable(response.usage.to_dict()) if response.usage else None
    except Exception as error:
        out.error = sdk_error(error)
    finally:
        client.close()
    out.tools = [{"id": k, "arguments": v} for k, v in arguments.items()]
    return out


def litellm_responses(base_url: str, stall: Stall | None) -> DialectOutcome:
    """``litellm.responses(model="openai/...", api_base=..., stream=True)``: its events."""
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    out = DialectOutcome(events=[])
    try:
        stream = litellm.responses(model=f"openai/{LITELLM_RESPONSES_MODEL}", input=PROMPT, stream=True,
                                   tools=RESPONSES_TOOLS, api_base=base_url, api_key="compat",
                                   timeout=TIMEOUT_S)
        for event in stream:
            out.events.append(jsonable(event.model_dump(warnings=False)))
            if stall is not None and len(out.events) == 1:
                stall()
    except Exception as error:
        out.error = _litellm_error(error)
    return out


ANTHROPIC_CLIENTS: dict[str, Callable[[str, Stall | None], DialectOutcome]] = {
    "anthropic-stream": anthropic_stream,
    "anthropic-create": anthropic_create,
    "langchain-anthropic": langchain_anthropic,
    "litellm-anthropic": litellm_anthropic,
    "anthropic-stream-h2": partial(anthropic_stream, http2=True),
    "anthropic-create-h2": partial(anthropic_create, http2=True),
}
RESPONSES_CLIENTS: dict[str, Callable[[str, Stall | None], DialectOutcome]] = {
    "openai-responses-create": responses_create,
    "openai-responses-stream": responses_stream,
    "litellm-responses": litellm_responses,
    "openai-responses-create-h2": partial(responses_create, http2=True),
    "openai-responses-stream-h2": partial(responses_stream, http2=True),
}
