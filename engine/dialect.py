"""An API dialect of the engine: how its requests read and its answers are written.

The engine speaks OpenAI Chat Completions and Completions (``openai_dialect.py``),
the OpenAI Responses API (``responses_api.py``) and the Anthropic Messages API
(``messages_api.py``). All of them go down one path in ``api.py``: read the
body, :meth:`Dialect.parse` it, check the model, tokenize
:meth:`Dialect.prompt`, submit to the one scheduler, then stream the answer
(``streaming.py``: each step's hand-off pushes its output into the response)
or wait for it whole; a client that leaves aborts the sequence either way, and
a refusal before the first byte is :meth:`Dialect.refusal`'s status and body.
A dialect decides nothing about scheduling, aborts or accounting: it only says
what the bytes are, through one :class:`Answer` per request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Protocol, TypeVar

from tokenwire.engine.backend import RequestOutput, RequestRejected
from tokenwire.engine.request_fields import ChatMessage, ProtocolError, SamplingFields
from tokenwire.engine.sampling import SamplingParams

quote: Callable[[str], str] = encode_basestring
"""``json.dumps(text, ensure_ascii=False)`` without building an encoder per call: the
C function that call ends in (the same bytes; ``test_api`` compares)."""

TEXT_MARK = "\u0001tokenwire-text\u0001"
"""Stands for an event's text in a :func:`pieces` template."""
NUMBER_MARK = 8_675_309_000_001
"""Stands for an event's number (a ``sequence_number``) in a :func:`pieces` template."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """A prompt of messages, for the model's chat template."""

    messages: tuple[ChatMessage, ...]
    param: str = "messages"
    """The request field the messages came in (what a refusal names)."""
    continue_final: bool = False
    """Continue the last (assistant) message instead of opening a new turn (a prefill)."""


Prompt = str | tuple[int, ...] | Conversation
"""Text to tokenize, token ids as given, or messages for the chat template."""


class ParsedRequest(Protocol):
    """What the shared path reads of every dialect's validated request."""

    @property
    def model(self) -> str | None: ...

    @property
    def sampling(self) -> SamplingFields: ...

    @property
    def stream(self) -> bool: ...

    @property
    def user(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class AnswerContext:
    """The facts of one submitted request that its answer carries."""

    request_id: str
    model: str
    created: int
    """Unix seconds."""
    prompt_tokens: int
    params: SamplingParams
    """The sampling as resolved (the model's default temperature filled in)."""


class Answer(Protocol):
    """One request's answer in its dialect: SSE events, or one JSON body.

    Streamed: :meth:`opening` once (before any output), :meth:`delta` for each
    step's text, then :meth:`closing` (finished) or :meth:`failure` (aborted or
    failed), both given the text that came with the final output. Whole:
    :meth:`body` or :meth:`error_body`."""

    def opening(self) -> str | None: ...

    def delta(self, text: str) -> str: ...

    def closing(self, text: str, final: RequestOutput) -> list[str]: ...

    def failure(self, text: str, final: RequestOutput) -> list[str]: ...

    def body(self, text: str, final: RequestOutput) -> dict[str, Any]: ...

    def error_body(self, final: RequestOutput) -> tuple[int, dict[str, Any]]: ...


Parsed = TypeVar("Parsed", bound=ParsedRequest)


class Dialect(Protocol[Parsed]):
    """One API's requests and answers (stateless: one object per route)."""

    @property
    def endpoint(self) -> str:
        """The accounting line's ``endpoint``."""
        ...

    def parse(self, body: object) -> Parsed:
        """Validate a JSON body; raises :class:`ProtocolError` naming the field."""
        ...

    def prompt(self, parsed: Parsed) -> Prompt: ...

    def answer(self, parsed: Parsed, context: AnswerContext) -> Answer: ...

    def refusal(self, error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
        """The HTTP status and body of a request refused before its stream began."""
        ...


def failed(final: RequestOutput) -> bool:
    """Whether a final output ended the request without an answer (aborted, failed)."""
    return final.finish_reason in ("abort", "error")


def failure_message(final: RequestOutput) -> str:
    if final.finish_reason == "abort":
        return "the request was aborted"
    return final.error or "generation failed"


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def sse(payload: dict[str, Any] | str) -> str:
    """An unnamed SSE event (OpenAI's chunks, ``[DONE]``)."""
    return f"data: {payload if isinstance(payload, str) else dumps(payload)}\n\n"


def named_sse(payload: dict[str, Any]) -> str:
    """An SSE event named by its payload's ``type`` (the Responses and Messages APIs)."""
    return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n"


def pieces(rendered: str, *marks: str) -> list[str]:
    """``rendered`` cut at each of ``marks`` in turn: the literal text around them.

    An event rendered once with :data:`TEXT_MARK` (quoted) and :data:`NUMBER_MARK`
    where its values go becomes a template, so each token's event is one
    :func:`quote` of its text and a join, not a ``json.dumps`` of a whole dict
    (the event loop writes tens of thousands a second at 64 streams)."""
    out: list[str] = []
    rest = rendered
    for mark in marks:
        head, found, rest = rest.partition(mark)
        if not found:
            raise ValueError(f"{mark!r} is not in the template")
        out.append(head)
    out.append(rest)
    return out
