"""The Python clients, each used as its documentation shows, each returning an
*outcome*: what the application using it ends up with (see ``outcome.py``).

A slow reader (``stall`` given) takes the first event, calls ``stall()`` (which
returns once the upstream has written its whole answer, or after a while when
nothing in between can take it), then reads on: the answer piles up in
tokenwire meanwhile, which must merge it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx

from .outcome import Outcome, jsonable, sse_outcome

TIMEOUT_S = 30.0
MODEL = "compat-model"
MESSAGES = [{"role": "user", "content": "Write the file."}]
BODY = {"model": MODEL, "messages": MESSAGES, "stream": True}

Stall = Callable[[], None]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch at import


def _sdk_error(error: BaseException) -> dict[str, Any]:
    return {"kind": type(error).__name__, "status": getattr(error, "status_code", None),
            "body": jsonable(getattr(error, "body", None)), "message": str(error)}


def speaks_h2(base_url: str) -> bool:
    """Whether the server at ``base_url`` answers the HTTP/2 preface (tokenwire's
    sidecar does; the fake upstream and uvicorn speak HTTP/1.1 only). It stands
    for configuration: a deployment sets prior knowledge for a server it knows."""
    url = httpx.URL(base_url)
    key = (url.host, url.port or 80)
    if key not in _H2_SERVERS:
        try:
            with socket.create_connection(key, timeout=2) as sock:
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                head = sock.recv(9)
            _H2_SERVERS[key] = len(head) == 9 and head[3] == 0x4  # a SETTINGS frame
        except OSError:
            _H2_SERVERS[key] = False
    return _H2_SERVERS[key]


_H2_SERVERS: dict[tuple[str, int], bool] = {}


def _http2_client(base_url: str) -> httpx.Client:
    """httpx with ``http2=True``: HTTP/2 with prior knowledge where the server speaks it."""
    return httpx.Client(http2=True, http1=not speaks_h2(base_url), timeout=TIMEOUT_S)


def _http2_async_client(base_url: str) -> httpx.AsyncClient:
    """:func:`_http2_client`'s asyncio twin."""
    return httpx.AsyncClient(http2=True, http1=not speaks_h2(base_url), timeout=TIMEOUT_S)


def openai_sync(base_url: str, stall: Stall | None, *, http2: bool = False) -> Outcome:
    import openai

    out = Outcome()
    client = openai.OpenAI(base_url=base_url, api_key="compat", timeout=TIMEOUT_S,
                           http_client=_http2_client(base_url) if http2 else None)
    try:
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                stream=True)
        out.status = stream.response.status_code
        for chunk in stream:
            out.chunks.append(chunk.to_dict())
            if stall is not None and len(out.chunks) == 1:
                stall()
    except Exception as error:
        out.error = _sdk_error(error)
    finally:
        client.close()
    return out


def openai_async(base_url: str, stall: Stall | None, *, http2: bool = False) -> Outcome:
    import openai

    async def main() -> Outcome:
        out = Outcome()
        async with openai.AsyncOpenAI(base_url=base_url, api_key="compat", timeout=TIMEOUT_S,
                                      http_client=_http2_async_client(base_url) if http2 else None) as client:
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
                out.status = stream.response.status_code
                async for chunk in stream:
                    out.chunks.append(chunk.to_dict())
                    if stall is not None and len(out.chunks) == 1:
                        stall()
            except Exception as error:
                out.error = _sdk_error(error)
        return out

    return asyncio.run(main())


def openai_stream_helper(base_url: str, stall: Stall | None) -> Outcome:
    """``client.chat.completions.stream()``: the SDK accumulates the message
    (text and tool calls) itself; ``final`` is its ``get_final_completion()``."""
    import openai

    out = Outcome()
    client = openai.OpenAI(base_url=base_url, api_key="compat", timeout=TIMEOUT_S)
    try:
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES) as stream:  # type: ignore[arg-type]
            for event in stream:
                if event.type == "chunk":
                    out.chunks.append(event.chunk.to_dict())
                    if stall is not None and len(out.chunks) == 1:
                        stall()
            final = stream.get_final_completion()
        out.final = final.to_dict()
    except Exception as error:
        out.error = _sdk_error(error)
    finally:
        client.close()
    return out


def langchain(base_url: str, stall: Stall | None, *, http2: bool = False) -> Outcome:
    """LangChain's ``ChatOpenAI.stream``, the chunks added up in one go
    (``full = full + chunk`` re-parses the tool-call arguments each time:
    quadratic, minutes for a long tool call; the sum is the same). With
    ``http2``, over the httpx client LangChain documents for that
    (``http_client=httpx.Client(http2=True)``; ``.stream`` uses the sync one)."""
    from langchain_core.messages.ai import add_ai_message_chunks
    from langchain_openai import ChatOpenAI

    out = Outcome()
    http_client = _http2_client(base_url) if http2 else None
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="compat",  # type: ignore[arg-type]
                     timeout=TIMEOUT_S, logprobs=True, http_client=http_client)
    pieces: list[Any] = []
    try:
        for piece in llm.stream("Write the file."):
            pieces.append(piece)
            if stall is not None and len(pieces) == 1:
                stall()
    except Exception as error:
        out.error = _sdk_error(error)
    finally:
        if http_client is not None:
            http_client.close()
    if pieces:
        merged = add_ai_message_chunks(pieces[0], *pieces[1:])
        out.final = jsonable({
            "content": merged.content, "tool_calls": merged.tool_calls,
            "invalid_tool_calls": merged.invalid_tool_calls, "additional_kwargs": merged.additional_kwargs,
            "response_metadata": merged.response_metadata, "usage_metadata": merged.usage_metadata})
    return out


def litellm_client(base_url: str, stall: Stall | None, *, http2: bool = False) -> Outcome:
    """litellm as a client: ``completion(..., stream=True, api_base=...)``. With
    ``http2``, through the per-call ``client=`` litellm accepts for its OpenAI
    provider: an ``openai.OpenAI`` over an httpx client with ``http2=True``
    (litellm's global ``litellm.client_session`` would do too, but it is one
    for the whole process, and the cases here run in parallel threads)."""
    import litellm
    import openai

    litellm.telemetry = False
    out = Outcome()
    client = (openai.OpenAI(base_url=base_url, api_key="compat", timeout=TIMEOUT_S,
                            http_client=_http2_client(base_url)) if http2 else None)
    try:
        response = litellm.completion(model=f"openai/{MODEL}", messages=MESSAGES, stream=True,
                                      api_base=base_url, api_key="compat", timeout=TIMEOUT_S,
                                      client=client)
        for chunk in response:
            out.chunks.append(jsonable(chunk.model_dump()))
            if stall is not None and len(out.chunks) == 1:
                stall()
    except Exception as error:
        out.error = _sdk_error(error)
    finally:
        if client is not None:
            client.close()
    return out


def httpx_sse_client(base_url: str, stall: Stall | None, *, http2: bool = False) -> Outcome:
    from httpx_sse import connect_sse

    datas: list[str] = []
    ids: list[str] = []
    events: list[str] = []
    out = Outcome()
    with _http2_client(base_url) if http2 else httpx.Client(timeout=TIMEOUT_S) as http:
        try:
            with connect_sse(http, "POST", f"{base_url}/chat/completions", json=BODY) as source:
                out.status = source.response.status_code
                if out.status != 200:
                    out.body = source.response.read().decode()
                else:
                    for sse in source.iter_sse():
                        datas.append(sse.data)
                        events.append(sse.event)
                        if sse.id:
                            ids.append(sse.id)
                        if stall is not None and len(datas) == 1:
                            stall()
        except Exception as error:
            out.error = {"kind": type(error).__name__, "status": None, "body": None, "message": str(error)}
    return sse_outcome(out, datas, ids, events)


def curl(base_url: str, stall: Stall | None) -> Outcome:
    """curl -N; a slow reader is curl writing into a pipe nobody reads for a while."""
    out = Outcome()
    process = subprocess.Popen(
        ["curl", "-sS", "-N", "-X", "POST", "-H", "content-type: application/json",
         "--data", json.dumps(BODY), "-w", "%{stderr}status=%{http_code}\n",
         "--max-time", str(int(TIMEOUT_S)), f"{base_url}/chat/completions"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if stall is not None:
        stall()
    stdout, stderr = process.communicate(timeout=TIMEOUT_S + 5)
    text = stderr.decode()
    out.status = int(text.rsplit("status=", 1)[1].strip()) if "status=" in text else None
    if process.returncode != 0:
        out.error = {"kind": f"curl exit {process.returncode}", "status": None, "body": None, "message": ""}
    return out.with_body(stdout)


PY_CLIENTS: dict[str, Callable[[str, Stall | None], Outcome]] = {
    "openai-sync": openai_sync,
    "openai-async": openai_async,
    "openai-stream-helper": openai_stream_helper,
    "langchain": langchain,
    "litellm": litellm_client,
    "httpx-sse": httpx_sse_client,
    "curl": curl,
    # HTTP/2 to the sidecar (prior knowledge), HTTP/1.1 to the rest.
    "openai-sync-h2": partial(openai_sync, http2=True),
    "openai-async-h2": partial(openai_async, http2=True),
    "langchain-h2": partial(langchain, http2=True),
    "litellm-h2": partial(litellm_client, http2=True),
    "httpx-sse-h2": partial(httpx_sse_client, http2=True),
}
H2_CLIENTS = frozenset(name for name in PY_CLIENTS if name.endswith("-h2"))
"""The rows that speak HTTP/2 to the sidecar."""
