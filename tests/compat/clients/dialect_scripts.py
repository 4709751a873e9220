"""The fake upstream of the dialect rows: Anthropic Messages and OpenAI
Responses streams (and a few Chat Completions ones, for the Vercel AI SDK's
``openai.chat``), and the ASGI app that plays them.

The scripts are **written**, not captured: from the public references (OpenAI's
"Responses streaming events" and Anthropic's "Streaming Messages"), checked
against the SDKs' own event types (``openai/types/responses/``,
``anthropic/types/``). Event names, field names and their order are the
references'; ids, models and texts are made up.

A request's path picks the script, as in ``scripts.py``:
``/<case>/<script>/v1/<route>`` (any method, body ignored); the route's ending
(``messages``, ``responses``, ``chat/completions``) is the client's own and is
what tells tokenwire the dialect. ``/finished/<case>`` answers ``yes`` once the
case's answer is all written, or tokenwire ended its stream (a slow reader
stalls until then). The ``heartbeats`` scripts are read through tokenwire's
``heartbeat`` profile (``PROFILE``: heartbeats every ``servers.HEARTBEAT_S``),
every other one through ``plain``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from behaviour.scenarios import Fail, Send, Silence, Step, play_steps

from .scripts import GAP_S, SCRIPTS, WORDS, Message, Scope, Script, UpstreamFailure, _arguments
from .servers import HEARTBEAT_S

THOUGHTS = ["Let", " me", " think", " about", " the", " file", "."]
BEFORE_FAILURE = 4
"""An error, a cut or a failure comes after this many words of text."""
ANTHROPIC_SLOW = {"delta_chars": 160, "thoughts": 400, "words": 2650, "tool_lines": 3300}
"""The Anthropic slow reader's answer (~1 MB): thinking, text and tool-input
deltas of 160 characters (an engine sending several tokens per event)."""
RESPONSES_SLOW = {"delta_chars": 12, "thoughts": 1000, "words": 7000, "tool_lines": 620}
"""The Responses slow reader's answer (~2.3 MB): 9,500 deltas of 12 characters
(a few tokens each), so their envelopes (~200 bytes an event) are most of the
bytes: unmerged, twice ``max_pending_bytes`` (1 MiB); merged, well under it.
The ``*.done`` events and ``response.completed`` repeat the text, as the API's
do (~0.45 MB that no merging can save)."""
SLOW_TOOL = "write_file"
PREFILL_S = 4 * HEARTBEAT_S
"""The ``heartbeats`` scripts' silent prefill (after the first event(s)): four
heartbeat intervals of the ``heartbeat`` profile, so tokenwire writes several."""
PING_EVERY_S = 2 * HEARTBEAT_S
"""``heartbeats_pings``: the engine's own ``ping`` every two heartbeat intervals
of the prefill, so tokenwire's heartbeats and the engine's pings interleave."""


def sse(event_type: str, obj: dict[str, Any], gap_s: float = GAP_S) -> Send:
    """One named event, ``event:`` line first, as both APIs write them."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return Send(f"event: {event_type}\ndata: {data}\n\n".encode(), gap_s=gap_s)


def _cut_inside(step: Send) -> Send:
    """The first half of an event's bytes: the connection dies inside it."""
    return Send(step.data[:len(step.data) // 2], gap_s=GAP_S)


def _pieces(prefix: str, count: int, size: int) -> list[str]:
    """``count`` text deltas of ``size`` characters."""
    filler = "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor. "
    filler *= size // len(filler) + 1
    return [f"{prefix}{i} {filler}"[:size] for i in range(count)]


def _split(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _tool_arguments(call: int, lines: int) -> str:
    return "".join(_arguments(call, 1, lines))


# Anthropic Messages ---------------------------------------------------------

ANTHROPIC_MODEL = "claude-compat-1"
ANTHROPIC_OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
"""The reference's example of an error event mid-stream (HTTP 200 already sent)."""


class _Anthropic:
    """Writes one Messages stream: ``message_start``, content blocks (start,
    deltas, stop), ``message_delta`` (stop reason, cumulative usage), ``message_stop``."""

    def __init__(self, message_id: str, gap_s: float = GAP_S) -> None:
        self.message_id = message_id
        self.gap_s = gap_s

    def _e(self, event_type: str, obj: dict[str, Any]) -> Send:
        return sse(event_type, {"type": event_type, **obj}, self.gap_s)

    def start(self) -> Send:
        return self._e("message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "content": [],
            "model": ANTHROPIC_MODEL, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 25, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 1}}})

    @staticmethod
    def ping() -> Send:
        return sse("ping", {"type": "ping"})

    def block_start(self, index: int, block: dict[str, Any]) -> Send:
        return self._e("content_block_start", {"index": index, "content_block": block})

    def delta(self, index: int, delta: dict[str, Any]) -> Send:
        return self._e("content_block_delta", {"index": index, "delta": delta})

    def block_stop(self, index: int) -> Send:
        return self._e("content_block_stop", {"index": index})

    def text_block(self, index: int, words: list[str]) -> list[Send]:
        return [self.block_start(index, {"type": "text", "text": ""}),
                *(self.delta(index, {"type": "text_delta", "text": w}) for w in words),
                self.block_stop(index)]

    def thinking_block(self, index: int, thoughts: list[str]) -> list[Send]:
        return [self.block_start(index, {"type": "thinking", "thinking": "", "signature": ""}),
                *(self.delta(index, {"type": "thinking_delta", "thinking": t}) for t in thoughts),
                self.delta(index, {"type": "signature_delta", "signature": "EqQBCgIYAhIMcompatSignature=="}),
                self.block_stop(index)]

    def tool_block(self, index: int, tool_id: str, fragments: list[str]) -> list[Send]:
        return [self.block_start(index, {"type": "tool_use", "id": tool_id, "name": SLOW_TOOL, "input": {}}),
                self.delta(index, {"type": "input_json_delta", "partial_json": ""}),
                *(self.delta(index, {"type": "input_json_delta", "partial_json": f}) for f in fragments),
                self.block_stop(index)]

    def end(self, stop_reason: str, output_tokens: int) -> list[Send]:
        return [self._e("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                          "usage": {"output_tokens": output_tokens}}),
                self._e("message_stop", {})]


def _anthropic_text() -> list[Step]:
    a = _Anthropic("msg_01CompatText")
    blocks = a.text_block(0, WORDS)
    # The reference's order: message_start, content_block_start, ping, deltas...
    return [a.start(), blocks[0], a.ping(), *blocks[1:], *a.end("end_turn", len(WORDS))]


def _anthropic_heartbeats(*, pings: bool) -> list[Step]:
    """``text`` with a silent prefill after ``message_start`` (``PREFILL_S``); with
    ``pings`` the engine keeps the connection alive itself meanwhile: a ``ping``
    right away and every ``PING_EVERY_S`` (three in the prefill, one more after
    ``content_block_start``, as in ``text``)."""
    a = _Anthropic("msg_01CompatPings" if pings else "msg_01CompatHeartbeats")
    blocks = a.text_block(0, WORDS)
    prefill: list[Step] = [Silence(PREFILL_S)]
    if pings:
        gaps = round(PREFILL_S / PING_EVERY_S)
        prefill = [a.ping(), *(s for _ in range(gaps) for s in (Silence(PING_EVERY_S), a.ping()))]
    return [a.start(), *prefill, blocks[0], a.ping(), *blocks[1:], *a.end("end_turn", len(WORDS))]


def _anthropic_tools() -> list[Step]:
    """Extended thinking, a sentence, then a tool call (``tool_use``)."""
    a = _Anthropic("msg_01CompatTools")
    fragments = _split(_tool_arguments(3, 12), 23)
    return [a.start(), a.ping(), *a.thinking_block(0, THOUGHTS),
            *a.text_block(1, ["I'll", " write", " the", " file", "."]),
            *a.tool_block(2, "toolu_01CompatWriteFile", fragments), *a.end("tool_use", 90)]


def _anthropic_head(a: _Anthropic) -> list[Step]:
    """``message_start``, a text block's start and ``BEFORE_FAILURE`` words (its stop not yet)."""
    return [a.start(), *a.text_block(0, WORDS[:BEFORE_FAILURE])[:-1]]


def _anthropic_slow() -> list[Step]:
    """``ANTHROPIC_SLOW``: thinking, text, then a tool call in ``input_json_delta``
    fragments, sent as fast as the server takes them."""
    a, size = _Anthropic("msg_01CompatSlow", gap_s=0.0), ANTHROPIC_SLOW["delta_chars"]
    return [a.start(), *a.thinking_block(0, _pieces("t", ANTHROPIC_SLOW["thoughts"], size)),
            *a.text_block(1, _pieces("w", ANTHROPIC_SLOW["words"], size)),
            *a.tool_block(2, "toolu_01CompatSlow",
                          _split(_tool_arguments(7, ANTHROPIC_SLOW["tool_lines"]), size)),
            *a.end("tool_use", 9000)]


def _anthropic() -> dict[str, list[Step]]:
    text = _anthropic_text()
    cut = _Anthropic("msg_01CompatCut")
    return {
        "text": text,
        "tools": _anthropic_tools(),
        "error_event": [*_anthropic_head(_Anthropic("msg_01CompatError")),
                        sse("error", ANTHROPIC_OVERLOADED)],
        "cut_mid_event": [*_anthropic_head(cut),
                          _cut_inside(cut.delta(0, {"type": "text_delta", "text": WORDS[BEFORE_FAILURE]})),
                          Fail()],
        # Everything but the terminal event: the stop reason came, message_stop did not.
        "eof_no_terminal": text[:-1],
        "slow_reader": _anthropic_slow(),
        "heartbeats": _anthropic_heartbeats(pings=False),
        "heartbeats_pings": _anthropic_heartbeats(pings=True),
    }


# OpenAI Responses -----------------------------------------------------------

RESPONSES_MODEL = "gpt-compat-1"
RESPONSES_ERROR = {"code": "server_error", "message": "The server had an error while processing your "
                   "request. Sorry about that!", "param": None}
"""A ``ResponseErrorEvent``'s fields (``type`` and ``sequence_number`` besides)."""
RESPONSES_FAILURE = {"code": "server_error", "message": "The model failed to generate a response."}


class _Responses:
    """Writes one Responses stream; numbers every event (``sequence_number``
    from 0, contiguous) and builds the ``*.done`` events and the final
    ``response`` object from what the deltas said, as the API does."""

    def __init__(self, response_id: str, gap_s: float = GAP_S) -> None:
        self.response_id = response_id
        self.gap_s = gap_s
        self.seq = 0
        self.output: list[dict[str, Any]] = []

    def _e(self, event_type: str, **fields: Any) -> Send:
        obj = {"type": event_type, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(event_type, obj, self.gap_s)

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": 1767225600, "status": status,
                "background": False, "error": None, "incomplete_details": None, "instructions": None,
                "max_output_tokens": None, "model": RESPONSES_MODEL, "output": [],
                "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": True,
                "temperature": 1.0, "text": {"format": {"type": "text"}, "verbosity": "medium"},
                "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
                "usage": None, "user": None, "metadata": {}, **fields}

    def head(self) -> list[Send]:
        return [self._e("response.created", response=self.response("in_progress")),
                self._e("response.in_progress", response=self.response("in_progress"))]

    def message(self, item_id: str, words: list[str], *, done: bool = True) -> list[Send]:
        index = len(self.output)
        item = {"id": item_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        steps = [self._e("response.output_item.added", output_index=index, item=item),
                 self._e("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                         part=part)]
        steps += [self._e("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                          delta=w, logprobs=[]) for w in words]
        if not done:
            return steps
        text = "".join(words)
        part = {**part, "text": text}
        item = {**item, "status": "completed", "content": [part]}
        self.output.append(item)
        return [*steps,
                self._e("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text, logprobs=[]),
                self._e("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                        part=part),
                self._e("response.output_item.done", output_index=index, item=item)]

    def reasoning(self, item_id: str, thoughts: list[str]) -> list[Send]:
        """A reasoning item with its raw reasoning text (``reasoning_text`` parts, as
        open-weight models serve it), deltas and all."""
        index = len(self.output)
        item = {"id": item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        part = {"type": "reasoning_text", "text": ""}
        text = "".join(thoughts)
        done_item = {**item, "status": "completed", "content": [{**part, "text": text}]}
        self.output.append(done_item)
        return [self._e("response.output_item.added", output_index=index, item=item),
                self._e("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                        part=part),
                *(self._e("response.reasoning_text.delta", item_id=item_id, output_index=index,
                          content_index=0, delta=t) for t in thoughts),
                self._e("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text),
                self._e("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                        part={**part, "text": text}),
                self._e("response.output_item.done", output_index=index, item=done_item)]

    def function_call(self, item_id: str, call_id: str, fragments: list[str]) -> list[Send]:
        index = len(self.output)
        item = {"id": item_id, "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call_id, "name": SLOW_TOOL}
        arguments = "".join(fragments)
        done_item = {**item, "status": "completed", "arguments": arguments}
        self.output.append(done_item)
        return [self._e("response.output_item.added", output_index=index, item=item),
                *(self._e("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                          delta=f) for f in fragments),
                self._e("response.function_call_arguments.done", item_id=item_id, output_index=index,
                        name=SLOW_TOOL, arguments=arguments),
                self._e("response.output_item.done", output_index=index, item=done_item)]

    def completed(self, output_tokens: int, reasoning_tokens: int = 0) -> Send:
        usage = {"input_tokens": 37, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": output_tokens,
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": 37 + output_tokens}
        return self._e("response.completed",
                       response=self.response("completed", output=self.output, usage=usage))

    def failed(self) -> Send:
        return self._e("response.failed", response=self.response("failed", error=RESPONSES_FAILURE,
                                                                 output=self.output))

    def error(self) -> Send:
        return self._e("error", **RESPONSES_ERROR)


def _responses_text() -> list[Step]:
    r = _Responses("resp_compat_text")
    return [*r.head(), *r.message("msg_compat_text", WORDS), r.completed(len(WORDS))]


def _responses_heartbeats() -> list[Step]:
    """``text`` with a silent prefill (``PREFILL_S``) after ``response.created`` and
    ``response.in_progress``."""
    r = _Responses("resp_compat_heartbeats")
    return [*r.head(), Silence(PREFILL_S), *r.message("msg_compat_heartbeats", WORDS),
            r.completed(len(WORDS))]


def _responses_tools() -> list[Step]:
    """Reasoning, a sentence, then a function call with its arguments in fragments."""
    r = _Responses("resp_compat_tools")
    fragments = _split(_tool_arguments(3, 12), 23)
    return [*r.head(), *r.reasoning("rs_compat_tools", THOUGHTS),
            *r.message("msg_compat_tools", ["I'll", " write", " the", " file", "."]),
            *r.function_call("fc_compat_tools", "call_compat_tools", fragments), r.completed(90, 7)]


def _responses_head(response_id: str) -> tuple[_Responses, list[Step]]:
    r = _Responses(response_id)
    return r, [*r.head(), *r.message(f"msg_{response_id}", WORDS[:BEFORE_FAILURE], done=False)]


def _responses_slow() -> list[Step]:
    """``RESPONSES_SLOW``: reasoning, text, then a function call in argument
    fragments, sent as fast as the server takes them."""
    r, size = _Responses("resp_compat_slow", gap_s=0.0), RESPONSES_SLOW["delta_chars"]
    return [*r.head(), *r.reasoning("rs_compat_slow", _pieces("t", RESPONSES_SLOW["thoughts"], size)),
            *r.message("msg_compat_slow", _pieces("w", RESPONSES_SLOW["words"], size)),
            *r.function_call("fc_compat_slow", "call_compat_slow",
                             _split(_tool_arguments(7, RESPONSES_SLOW["tool_lines"]), size)),
            r.completed(9000, RESPONSES_SLOW["thoughts"])]


def _responses() -> dict[str, list[Step]]:
    text = _responses_text()
    error, error_head = _responses_head("resp_compat_error")
    failed, failed_head = _responses_head("resp_compat_failed")
    cut, cut_head = _responses_head("resp_compat_cut")
    return {
        "text": text,
        "tools": _responses_tools(),
        "error_event": [*error_head, error.error()],
        "failed": [*failed_head, failed.failed()],
        "cut_mid_event": [*cut_head, _cut_inside(cut._e(
            "response.output_text.delta", item_id="msg_resp_compat_cut", output_index=0, content_index=0,
            delta=WORDS[BEFORE_FAILURE], logprobs=[])), Fail()],
        # Everything but the terminal event: every item is done, response.completed never comes.
        "eof_no_terminal": text[:-1],
        "slow_reader": _responses_slow(),
        "heartbeats": _responses_heartbeats(),
    }


# The scripts, by dialect ----------------------------------------------------

ROUTES = {"anthropic": "messages", "responses": "responses", "chat": "chat/completions"}
"""The route (the path's ending) each dialect's clients ask for."""
CHAT_FEATURES = ("plain", "tool_calls", "error_mid_stream", "upstream_death", "slow_reader")
"""The Chat Completions scripts (``scripts.py``'s own) the Vercel AI SDK's ``openai.chat`` reads."""
_STEPS: dict[str, dict[str, list[Step]]] = {"anthropic": _anthropic(), "responses": _responses()}
FEATURES: dict[str, tuple[str, ...]] = {**{d: tuple(s) for d, s in _STEPS.items()}, "chat": CHAT_FEATURES}
DIALECT_SCRIPTS: dict[str, Script] = {f"{d}_{f}": Script(tuple(s)) for d, fs in _STEPS.items()
                                      for f, s in fs.items()}
DIALECT_SCRIPTS.update({f"chat_{f}": SCRIPTS[f] for f in CHAT_FEATURES})
SLOW_FEATURES = frozenset({"slow_reader"})
HEARTBEAT_FEATURES = frozenset({"heartbeats", "heartbeats_pings"})
"""A silent prefill: read through the ``heartbeat`` profile, the record must show heartbeats."""
PROFILE = {feature: "heartbeat" for feature in HEARTBEAT_FEATURES}
"""The tokenwire configuration (``servers.py``'s profile) a feature is read through; others ``plain``."""
TOKENWIRE_ENDINGS = frozenset({"cut_mid_event", "eof_no_terminal", "upstream_death"})
"""Endings only tokenwire reports (as an in-band error): directly the client
sees a broken or a silently ended stream, so they are asserted, not compared."""


def script_name(dialect: str, feature: str) -> str:
    return f"{dialect}_{feature}"


def script_keepalives(name: str) -> int:
    """How many keepalive events (Anthropic's ``ping``) a script sends."""
    steps = DIALECT_SCRIPTS[name].steps
    return sum(s.data.startswith(b"event: ping\n") for s in steps if isinstance(s, Send))


def script_bytes(name: str) -> int:
    return sum(len(s.data) for s in DIALECT_SCRIPTS[name].steps if isinstance(s, Send))


class DialectUpstream:
    """The ASGI app; ``requests[case]`` lists the request id of every request a
    case made, ``finished`` the cases whose answer is all written (the same
    attributes as ``scripts.ScriptedUpstream``, which ``servers.Servers`` reads)."""

    def __init__(self) -> None:
        self.requests: defaultdict[str, list[str]] = defaultdict(list)
        self.finished: set[str] = set()
        self.paths: defaultdict[str, list[str]] = defaultdict(list)
        """Case → the path of each request (the route the client chose)."""
        self.ended: set[str] = set()
        """Request ids whose stream tokenwire has ended (its accounting record came)."""

    def settled(self, case: str) -> bool:
        """The case's answer is all written, or tokenwire ended its stream (then the
        upstream may never finish: a slow reader waiting for it would wait in vain)."""
        return case in self.finished or any(i in self.ended for i in self.requests.get(case, ()))

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        parts = scope["path"].strip("/").split("/")
        if parts[0] == "finished":
            answer = b"yes" if self.settled(parts[1]) else b"no"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain"),
                                    (b"content-length", b"%d" % len(answer))]})
            await send({"type": "http.response.body", "body": answer})
            return
        while (await receive()).get("more_body"):
            pass
        case, name = parts[0], parts[1]
        control = (scope.get("extensions") or {}).get("tokenwire")
        headers = dict(scope["headers"])
        request_id = control.request_id if control is not None else headers.get(b"x-request-id", b"").decode()
        self.requests[case].append(request_id)
        self.paths[case].append(scope["path"])
        script = DIALECT_SCRIPTS.get(name)
        if script is None:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        await play_steps(script.steps, send, lambda: UpstreamFailure(f"{case}: the upstream dies mid-body"))
        self.finished.add(case)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
