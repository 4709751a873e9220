"""Shared helpers for the wire core tests: chunk builders and a tiny driver."""

from __future__ import annotations

import json
from typing import Any

from tokenwire.middleware import (
    Action,
    CommitHeaders,
    Finished,
    Input,
    SSEEvent,
    SSEParser,
    UpstreamEvent,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
)
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

SSE_HEADERS = ((b"content-type", b"text/event-stream"),)


def chunk(text: str | None = None, *, ident: str = "chatcmpl-1", index: int = 0,
          field: str = "content", role: str | None = None, finish: str | None = None,
          extra_delta: dict[str, Any] | None = None, usage: dict[str, int] | None = None,
          logprobs: Any = None, extra: dict[str, Any] | None = None) -> str:
    """An OpenAI chat.completion.chunk as vLLM writes it (compact JSON)."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if text is not None:
        delta[field] = text
    delta.update(extra_delta or {})
    body: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk", "created": 1,
                            "model": "m", "choices": [{"index": index, "delta": delta,
                                                       "logprobs": logprobs,
                                                       "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    body.update(extra or {})
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def tool_args(arguments: str, *, call: int = 0, extra_delta: dict[str, Any] | None = None) -> str:
    """A later argument fragment of tool call ``call``, as OpenAI and vLLM send it."""
    return chunk(extra_delta={"tool_calls": [{"index": call, "function": {"arguments": arguments}}],
                              **(extra_delta or {})})


def completion_chunk(text: str, *, ident: str = "cmpl-1", index: int = 0) -> str:
    return json.dumps({"id": ident, "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": index, "text": text, "logprobs": None,
                                    "finish_reason": None}]}, separators=(",", ":"))


def event(data: str, **fields: Any) -> UpstreamEvent:
    return UpstreamEvent(SSEEvent(data=data, **fields))


def parse_all(data: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    events = parser.feed(data)
    parser.close()
    return events


def texts(events: list[SSEEvent], field: str = "content") -> str:
    """The concatenated delta text of OpenAI chunks among ``events``."""
    out = []
    for e in events:
        if e.data is None or not e.data.startswith("{"):
            continue
        obj = json.loads(e.data)
        for choice in obj.get("choices") or ():
            delta = choice.get("delta")
            value = delta.get(field) if isinstance(delta, dict) else choice.get(field)
            if isinstance(value, str):
                out.append(value)
    return "".join(out)


PROXY_DEFAULTS = SIDECAR_WIRE_DEFAULTS
"""The core's tests run with a proxy's wire defaults (retries, ``[DONE]``), the
richest rule set; the middleware's plainer defaults have tests of their own."""


def proxy_config(**changes: Any) -> WireConfig:
    """The sidecar's wire defaults with ``changes``."""
    return SIDECAR_WIRE_DEFAULTS.replace(**changes)


class Driver:
    """A minimal obedient driver: writes complete at once unless told otherwise."""

    def __init__(self, config: WireConfig | None = None, *, now: float = 0.0,
                 auto_complete: bool = True, **kwargs: Any) -> None:
        self.now = now
        self.config = config or PROXY_DEFAULTS
        self.stream = WireStream(self.config, now=now, request_id="req-1", **kwargs)
        self.actions: list[Action] = []
        self.writes: list[bytes] = []
        self.write_times: list[float] = []
        self.auto_complete = auto_complete
        self.in_flight = False

    @property
    def written(self) -> bytes:
        return b"".join(self.writes)

    def send(self, item: Input, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = at
        actions = self.stream.handle(item, self.now)
        self.actions.extend(actions)
        if not self.in_flight:
            self.flush()
        return actions

    def flush(self) -> None:
        data = self.stream.data_to_send(self.now)
        if data:
            self.writes.append(data)
            self.write_times.append(self.now)
            self.in_flight = True
            if self.auto_complete:
                self.complete()

    def complete(self) -> None:
        assert self.in_flight
        self.in_flight = False
        self.send(WriteCompleted())

    def sse_headers(self, at: float | None = None) -> list[Action]:
        return self.send(UpstreamHeaders(200, SSE_HEADERS), at)

    def of(self, kind: type[Any]) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def commit(self) -> CommitHeaders:
        commits = self.of(CommitHeaders)
        assert len(commits) == 1, commits
        return commits[0]  # type: ignore[no-any-return]

    @property
    def finished(self) -> Finished:
        done = self.of(Finished)
        assert len(done) == 1, done
        return done[0]  # type: ignore[no-any-return]
