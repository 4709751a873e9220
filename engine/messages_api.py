"""The Anthropic Messages API (``POST /v1/messages``), a dialect of the shared path.

Request: ``messages`` (user and assistant turns, content a string or ``text``
blocks) after an optional ``system`` (a string or ``text`` blocks) become one
conversation for the chat template; a last assistant turn is continued (a
prefill), as Anthropic does. ``max_tokens`` is required; ``stop_sequences``,
and ``temperature`` (0 to 1), ``top_p`` and ``top_k``, which older clients send
(the SDK no longer does: the model's default sampling applies), are the sampling.
Anything else is refused unless at its default. Errors are Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``: 400
``invalid_request_error``, 404 ``not_found_error`` (an unknown model), 529
``overloaded_error`` (the scheduler's queue is full), 500 ``api_error``.

A stream is named events, as Anthropic documents them::

    message_start (usage: input_tokens, output_tokens 0), content_block_start   (at once)
    content_block_delta (text_delta) ...                                         (one per step)
    content_block_stop, message_delta (stop_reason, usage.output_tokens), message_stop

A generation that is aborted or fails after the first byte ends with
``event: error`` / ``{"type": "error", "error": {"type": "api_error", ...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwire.engine.backend import RequestOutput, RequestRejected
from tokenwire.engine.dialect import (
    TEXT_MARK,
    AnswerContext,
    Conversation,
    Prompt,
    failure_message,
    named_sse,
    pieces,
    quote,
)
from tokenwire.engine.request_fields import (
    Accepts,
    ConversationRequest,
    MessageShape,
    ProtocolError,
    check_fields,
    expect,
    flatten_content,
    is_none,
    is_none_or_empty,
    is_one_of,
    optional,
    optional_int,
    parse_basic_sampling,
    parse_messages,
    require,
    with_system,
)

_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                     "stop_sequences", "stream"})
_UNIMPLEMENTED: dict[str, Accepts] = {
    "tools": is_none_or_empty,
    "tool_choice": lambda value: value is None or value in ({"type": "auto"}, {"type": "none"}),
    "thinking": lambda value: value is None or value == {"type": "disabled"},
    "service_tier": is_one_of("auto", "standard_only"),
    "container": is_none,
    "mcp_servers": is_none_or_empty,
    "context_management": is_none,
    "output_config": is_none_or_empty,
    "speed": is_one_of("standard"),
    "diagnostics": is_none,
}
_INFORMATIONAL = frozenset({"metadata", "cache_control", "inference_geo", "user_profile_id",
                            "workspace_id"})
"""No bearing on the answer here: who asks, where, and a prompt-caching hint."""
_BLOCK_KEYS = frozenset({"cache_control", "citations"})
"""Keys of a text block with no bearing on the answer (a caching hint, no citations)."""
_MESSAGES = MessageShape(roles={"user": "user", "assistant": "assistant"},
                         part_types=frozenset({"text"}), optional_keys={}, part_keys=_BLOCK_KEYS)
_STOP_REASONS = {"length": "max_tokens"}


@dataclass(frozen=True, slots=True)
class MessagesRequest(ConversationRequest):
    """A validated ``/v1/messages`` request; its ``messages`` are ``system`` (as a system
    message) first, then ``messages``."""

    continue_final: bool
    """The last message is the assistant's: the answer continues it."""


def parse_messages_request(body: object) -> MessagesRequest:
    """Validate a ``/v1/messages`` body."""
    fields = check_fields(body, _FIELDS, _UNIMPLEMENTED, _INFORMATIONAL)
    max_tokens = optional_int(fields, "max_tokens", minimum=1)
    if max_tokens is None:
        raise ProtocolError("max_tokens: Field required (the most tokens to generate)",
                            param="max_tokens")
    messages = parse_messages(require(fields, "messages"), "messages", _MESSAGES)
    system = fields.get("system")
    messages = with_system(messages, None if system is None
                           else flatten_content(system, "system", _MESSAGES))
    metadata = optional(fields, "metadata", dict) or {}
    user = metadata.get("user_id")
    top_k = optional_int(fields, "top_k", minimum=0)
    stop = fields.get("stop_sequences")
    if stop is not None:
        expect(stop, list, "stop_sequences")
    return MessagesRequest(
        model=optional(fields, "model", str),
        messages=messages,
        continue_final=messages[-1].role == "assistant",
        sampling=parse_basic_sampling(fields, max_tokens=max_tokens, max_temperature=1.0,
                                      top_k=top_k or 0, stop_field="stop_sequences"),
        stream=optional(fields, "stream", bool) or False,
        user=None if user is None else expect(user, str, "metadata.user_id"),
    )


class MessagesDialect:
    """``POST /v1/messages``."""

    endpoint = "messages"

    def parse(self, body: object) -> MessagesRequest:
        return parse_messages_request(body)

    def prompt(self, parsed: MessagesRequest) -> Prompt:
        return Conversation(parsed.messages, continue_final=parsed.continue_final)

    def answer(self, parsed: MessagesRequest, context: AnswerContext) -> MessagesAnswer:
        return MessagesAnswer(context)

    def refusal(self, error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
        status = error.http_status
        if status == 404:
            return 404, anthropic_error("not_found_error", error.message)
        if isinstance(error, RequestRejected) and error.overloaded:
            return 529, anthropic_error("overloaded_error", error.message)
        if status >= 500:
            return 500, anthropic_error("api_error", error.message)
        return 400, anthropic_error("invalid_request_error", error.message)


class MessagesAnswer:
    """One request's Messages events, or its one ``message``."""

    def __init__(self, context: AnswerContext) -> None:
        self._context = context
        self._id = f"msg_{context.request_id}"
        self._delta_pieces = pieces(
            named_sse({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": TEXT_MARK}}),
            quote(TEXT_MARK))

    def opening(self) -> str | None:
        usage = {"input_tokens": self._context.prompt_tokens, "output_tokens": 0}
        return (named_sse({"type": "message_start", "message": self._message([], None, usage)})
                + named_sse({"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}))

    def delta(self, text: str) -> str:
        before, after = self._delta_pieces
        return f"{before}{quote(text)}{after}"

    def closing(self, text: str, final: RequestOutput) -> list[str]:
        stop_reason, stop_sequence = self._stop(final)
        events = [self.delta(text)] if text else []
        return [*events,
                named_sse({"type": "content_block_stop", "index": 0}),
                named_sse({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": {"output_tokens": final.completion_tokens}}),
                named_sse({"type": "message_stop"})]

    def failure(self, text: str, final: RequestOutput) -> list[str]:
        events = [self.delta(text)] if text else []
        return [*events, named_sse(anthropic_error("api_error", failure_message(final)))]

    def body(self, text: str, final: RequestOutput) -> dict[str, Any]:
        usage = {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens}
        return self._message([{"type": "text", "text": text}], final, usage)

    def error_body(self, final: RequestOutput) -> tuple[int, dict[str, Any]]:
        return 500, anthropic_error("api_error", failure_message(final))

    def _message(self, content: list[dict[str, Any]], final: RequestOutput | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        stop_reason, stop_sequence = (None, None) if final is None else self._stop(final)
        return {"id": self._id, "type": "message", "role": "assistant", "model": self._context.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}

    def _stop(self, final: RequestOutput) -> tuple[str, str | None]:
        """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished output."""
        if isinstance(final.stop_reason, str) and final.stop_reason in self._context.params.stop:
            return "stop_sequence", final.stop_reason
        return _STOP_REASONS.get(final.finish_reason or "", "end_turn"), None


def anthropic_error(kind: str, message: str) -> dict[str, Any]:
    """An Anthropic error body (and the data of an ``error`` event)."""
    return {"type": "error", "error": {"type": kind, "message": message}}
