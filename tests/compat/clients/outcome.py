"""What a client ends up with (an :class:`Outcome`), what of it the suite
compares (:func:`view`), and the comparison of *through tokenwire* with
*directly*, documented differences included (:func:`compare`; README.md).

Every client reports the same shape, whatever its language: the chunk
objects it handed the application, or the SSE ``data`` it dispatched (turned
into chunks here), its final accumulated message when it builds one itself,
and how it ended (an error: kind, HTTP status, body). Event *counts* are not
compared: merging events for a slow reader is the point of tokenwire.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..replay import sse_data
from .scripts import DEATH_AFTER_WORDS, ERROR_FIRST, ERROR_MID, WORDS

EVENT_CLIENTS = frozenset({"httpx-sse", "httpx-sse-h2", "curl", "eventsource", "browser-eventsource",
                           "browser-fetch"})
"""Clients that hand the application SSE events, not parsed chunks."""
RETRYING_CLIENTS = frozenset({"openai-sync", "openai-sync-h2", "openai-async", "openai-async-h2",
                              "openai-stream-helper", "langchain", "langchain-h2", "openai-node"})
"""Clients that retry a 5xx themselves (and honour ``x-should-retry``)."""
CUT_BODY_ERRORS = frozenset({"RemoteProtocolError", "curl exit 18", "TypeError"})
"""How httpx-sse, curl and a fetch reader report a body cut without its terminator."""
NO_BODY_ON_ERROR = frozenset({"eventsource", "browser-eventsource"})
READS_CUT_BODY_SHORT = frozenset({"browser-eventsource", "browser-fetch"})
"""Chromium may drop what the page had not read yet when a body ends without
its terminator (the fetch stream errors, and an errored stream's queue is
discarded): the tail of the text, the error event, or all of it."""
"""An ``EventSource`` fails a non-200 answer without reading its body."""


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


@dataclass
class Outcome:
    status: int | None = None
    chunks: list[Any] = field(default_factory=list)
    """Chunk objects (SDKs) or the JSON of each dispatched ``data`` (event clients)."""
    done: bool = False
    """A ``[DONE]`` event was dispatched (event clients)."""
    others: list[str] = field(default_factory=list)
    """Dispatched ``data`` that is neither JSON nor ``[DONE]`` (an empty event, say)."""
    ids: list[str] = field(default_factory=list)
    """Event ids the client saw (event clients that expose them)."""
    events: list[str] = field(default_factory=list)
    """Named event types other than ``message``."""
    error: dict[str, Any] | None = None
    """How it failed: ``kind``, ``status``, ``body``, ``message``."""
    final: Any = None
    """The client's own accumulation (the SDK stream helper, LangChain)."""
    body: str | None = None
    """A non-200 answer's body, when the client can read it."""

    def with_body(self, raw: bytes) -> Outcome:
        """Fill from a whole response body read as bytes (curl, fetch)."""
        if self.status == 200:
            return sse_outcome(self, sse_data(raw), [], [])
        self.body = raw.decode(errors="replace")
        return self

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Outcome:
        out = cls(**{k: v for k, v in obj.items() if k not in ("datas", "raw")})
        if "raw" in obj:
            return out.with_body(obj["raw"].encode())
        if "datas" in obj:
            return sse_outcome(out, obj["datas"], [], [])
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sse_outcome(out: Outcome, datas: list[str], ids: list[str], events: list[str]) -> Outcome:
    """Fill ``out`` from the ``data`` of each dispatched event."""
    out.ids += ids
    out.events += [e for e in events if e and e != "message"]
    for data in datas:
        if data == "[DONE]":
            out.done = True
            continue
        try:
            out.chunks.append(json.loads(data))
        except ValueError:
            out.others.append(data)
    return out


def accumulate(chunks: list[Any]) -> dict[str, Any]:
    """What an application builds from the chunks: per choice its role, text,
    reasoning, tool calls (fragments joined), finish reason and logprobs;
    the usage; the in-band errors."""
    choices: dict[str, dict[str, Any]] = {}
    usage = None
    errors: list[Any] = []
    for chunk in chunks:
        if not isinstance(chunk, dict):
            errors.append(("not an object", chunk))
            continue
        if chunk.get("error") is not None and not chunk.get("choices"):
            errors.append(chunk["error"])
            continue
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            acc = choices.setdefault(str(choice.get("index", 0)), {
                "role": None, "content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None,
                "logprobs": []})
            delta = choice.get("delta") or {}
            acc["role"] = delta.get("role") or acc["role"]
            acc["content"] += delta.get("content") or ""
            acc["reasoning"] += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                into = acc["tool_calls"].setdefault(str(call.get("index")), {
                    "id": None, "type": None, "name": None, "arguments": ""})
                function = call.get("function") or {}
                into["id"] = call.get("id") or into["id"]
                into["type"] = call.get("type") or into["type"]
                into["name"] = function.get("name") or into["name"]
                into["arguments"] += function.get("arguments") or ""
            acc["finish_reason"] = choice.get("finish_reason") or acc["finish_reason"]
            logprobs = choice.get("logprobs") or {}
            acc["logprobs"] += logprobs.get("content") or []
    return {"choices": choices, "usage": usage, "errors": errors}


def view(out: Outcome) -> dict[str, Any]:
    """The part of an outcome that must be the same through tokenwire."""
    return {"status": out.status, "answer": accumulate(out.chunks), "done": out.done, "others": out.others,
            "events": out.events, "error": out.error, "final": out.final, "body": out.body}


def _contains(outer: Any, inner: Any) -> bool:
    """Every key of ``inner`` is in ``outer`` with the same value."""
    return isinstance(outer, dict) and isinstance(inner, dict) and all(
        k in outer and outer[k] == v for k, v in inner.items())


def _error_object(out: Outcome) -> Any:
    """The error object the client hands the application, wherever it carries it."""
    answer = accumulate(out.chunks)
    if answer["errors"]:
        return answer["errors"][-1]
    if out.error is not None and isinstance(out.error.get("body"), dict):
        body = out.error["body"]
        return body.get("error", body)
    if out.body:
        try:
            return json.loads(out.body).get("error")
        except ValueError:
            return None
    return None


def _keeps(out: Outcome, expected: dict[str, Any]) -> bool:
    """The client hands the application ``expected`` (all its fields), or, when
    it only gives a message (litellm), a message naming the upstream's."""
    obj = _error_object(out)
    if obj is not None:
        return _contains(obj, expected)
    return out.error is not None and expected["message"] in str(out.error.get("message"))


def compare(feature: str, client: str, direct: Outcome, through: Outcome) -> None:
    """Fail with the difference unless README.md documents it as intended."""
    want, got = view(direct), view(through)
    if feature == "resume" and client in EVENT_CLIENTS and client not in ("curl", "browser-fetch"):
        # Documented: through tokenwire every data event carries an id.
        assert through.ids and all(through.ids), f"no event ids through tokenwire: {through.ids}"
    if feature == "error_mid_stream":
        # Documented: the upstream's error object, with tokenwire's fields beside it.
        assert _keeps(direct, ERROR_MID), f"direct: {direct}"
        if client in READS_CUT_BODY_SHORT and not _keeps(through, ERROR_MID):
            _assert_cutshort_json(_text(direct), through)
            return
        assert _keeps(through, ERROR_MID), (
            f"the client did not get the upstream's error object as it came: it got "
            f"{_error_object(through)!r}, text {_text(through)!r}, ending {through.error}")
        _strip_error_objects(want, got)
        if direct.error is None and through.error is not None and through.error["kind"] in CUT_BODY_ERRORS:
            # Documented: after an in-band error tokenwire ends the body without its
            # terminator, which a client reading the body raises as a cut.
            got["error"] = None
    if feature == "error_first_event":
        # Documented: the engine's status and its error object, as an HTTP answer.
        assert _keeps(direct, ERROR_FIRST), f"direct: {direct}"
        status = through.status if through.status is not None else (through.error or {}).get("status")
        if client not in NO_BODY_ON_ERROR:
            assert status == 400, f"an error as the first event must be answered 400, got {status}"
            assert _keeps(through, ERROR_FIRST), \
                f"the engine's error object was not kept: {_error_object(through)} ({through})"
        else:
            assert through.error is not None and not through.chunks, through
        assert not accumulate(through.chunks)["choices"], through
        return
    if feature == "upstream_death":
        # Documented: a cut upstream reaches the client as an in-band error
        # (tokenwire's ``upstream_failed``) where directly it was a cut body, which a
        # browser may read short (Chromium drops the last bytes of a broken body).
        text = "".join(WORDS[:DEATH_AFTER_WORDS])
        if client in READS_CUT_BODY_SHORT and _text(through) != text:
            _assert_cutshort_json(text, through)
            return
        assert _text(through) == text, f"through tokenwire the text before the cut was {_text(through)!r}"
        assert text.startswith(_text(direct)), f"directly: {_text(direct)!r}"
        assert direct.error is not None or not direct.done, f"direct read of a cut body: {direct}"
        assert through.error is not None or accumulate(through.chunks)["errors"], \
            f"the client was not told the answer is cut: {through}"
        return
    assert got == want, diff_of(want, got)


def _assert_cutshort_json(text: str, through: Outcome) -> None:
    """Documented (README: a browser reading a cut body): the page may have lost
    the unread tail, but what it got is a prefix of the answer and it was told
    the answer failed: never a clean end, never a ``[DONE]``."""
    assert text.startswith(_text(through)), f"not a prefix of the answer: {_text(through)!r}"
    assert through.error is not None and not through.done, \
        f"a browser that lost the end of a cut answer must see it fail: {through}"


def _text(out: Outcome) -> str:
    if out.final is not None and not out.chunks:
        return str(out.final.get("content", ""))
    choice = accumulate(out.chunks)["choices"].get("0")
    return "" if choice is None else str(choice["content"])


def _strip_error_objects(*views: dict[str, Any]) -> None:
    for v in views:
        v["answer"]["errors"] = len(v["answer"]["errors"])
        if v["error"] is not None:
            v["error"] = {"kind": v["error"]["kind"], "status": v["error"]["status"]}


def diff_of(want: dict[str, Any], got: dict[str, Any]) -> str:
    """Each differing key of two client views, direct and through tokenwire."""
    lines = ["through tokenwire differs from direct:"]
    for key in want:
        if want[key] != got[key]:
            lines.append(f"  {key}: direct={short_json(want[key])}")
            lines.append(f"  {' ' * len(key)}  through={short_json(got[key])}")
    return "\n".join(lines)


def short_json(value: Any) -> str:
    """``value`` as JSON, its middle left out past 1,500 characters."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) < 1500 else text[:700] + " ... " + text[-700:]
