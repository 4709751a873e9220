"""The OpenAI Responses API (``POST /v1/responses``), a dialect of the shared path.

Request: ``input`` (a string, or message items whose content is a string or
``input_text`` / ``output_text`` parts) and ``instructions`` (a system
message first) become one conversation for the chat template;
``max_output_tokens``, ``temperature`` and ``top_p`` are the sampling. Every
other field is refused unless at its default, as in ``openai_requests.py``,
and refusals are OpenAI error bodies.

A stream is named events, each with ``type`` and a ``sequence_number``
counting from 0, and no ``[DONE]``::

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added                        (at once)
    response.output_text.delta ...                     (one per engine step with text)
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete           (the response, with usage)

``response.incomplete`` (``incomplete_details.reason: max_output_tokens``)
when the length limit stopped it. An aborted or failed generation ends with
``response.failed``, the response with its ``error`` (the SDK types: an error
of the model generating the response), status ``failed``, or ``cancelled``
for an abort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenwire.engine.backend import RequestOutput, RequestRejected
from tokenwire.engine.dialect import (
    NUMBER_MARK,
    TEXT_MARK,
    AnswerContext,
    Conversation,
    Prompt,
    named_sse,
    pieces,
    quote,
)
from tokenwire.engine.openai_dialect import finish_error, openai_refusal
from tokenwire.engine.openai_requests import INFORMATIONAL
from tokenwire.engine.request_fields import (
    Accepts,
    ChatMessage,
    ConversationRequest,
    MessageShape,
    ProtocolError,
    check_fields,
    is_none,
    is_none_or_empty,
    is_none_or_false,
    is_none_or_true,
    is_none_or_zero,
    is_one_of,
    optional,
    optional_int,
    parse_basic_sampling,
    parse_messages,
    parse_stream_options,
    require,
    with_system,
)

_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                     "stream", "stream_options"})
_UNIMPLEMENTED: dict[str, Accepts] = {
    "tools": is_none_or_empty,
    "tool_choice": is_one_of("none", "auto"),
    "parallel_tool_calls": is_none_or_true,
    "max_tool_calls": is_none,
    "text": lambda value: value is None or value in ({}, {"format": {"type": "text"}}),
    "reasoning": is_none_or_empty,
    "include": is_none_or_empty,
    "top_logprobs": is_none_or_zero,
    "truncation": is_one_of("disabled"),
    "previous_response_id": is_none,
    "conversation": is_none,
    "prompt": is_none,
    "background": is_none_or_false,
    "store": is_none_or_false,
    "service_tier": is_one_of("auto", "default"),
}
_INPUT = MessageShape(
    roles={"user": "user", "system": "system", "developer": "system", "assistant": "assistant"},
    part_types=frozenset({"input_text", "output_text"}),
    # An earlier answer passed back as it came: its id, status and part annotations.
    optional_keys={"type": lambda value: value == "message", "id": lambda value: True,
                   "status": lambda value: True},
    part_keys=frozenset({"annotations", "logprobs"}),
)


@dataclass(frozen=True, slots=True)
class ResponsesRequest(ConversationRequest):
    """A validated ``/v1/responses`` request; its ``messages`` are ``instructions`` (as a
    system message) first, then ``input``."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, Any] | None


def parse_responses_request(body: object) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body."""
    fields = check_fields(body, _FIELDS, _UNIMPLEMENTED, INFORMATIONAL)
    given = require(fields, "input")
    if isinstance(given, str):
        messages: tuple[ChatMessage, ...] = (ChatMessage("user", given),)
    else:
        if isinstance(given, list):
            for index, item in enumerate(given):
                kind = item.get("type", "message") if isinstance(item, dict) else "message"
                if kind != "message":
                    raise ProtocolError(f"input[{index}].type: {kind!r} items are not supported by "
                                        "this engine (only messages)", param=f"input[{index}].type")
        messages = parse_messages(given, "input", _INPUT)
    instructions = optional(fields, "instructions", str)
    messages = with_system(messages, instructions)
    max_output_tokens = optional_int(fields, "max_output_tokens", minimum=1)
    parse_stream_options(fields, frozenset({"include_obfuscation"}))  # no padding is added anyway
    return ResponsesRequest(
        model=optional(fields, "model", str),
        messages=messages,
        instructions=instructions,
        max_output_tokens=max_output_tokens,
        sampling=parse_basic_sampling(fields, max_tokens=max_output_tokens, max_temperature=2.0),
        stream=optional(fields, "stream", bool) or False,
        user=optional(fields, "user", str),
        metadata=optional(fields, "metadata", dict),
    )


class ResponsesDialect:
    """``POST /v1/responses``."""

    endpoint = "responses"

    def parse(self, body: object) -> ResponsesRequest:
        return parse_responses_request(body)

    def prompt(self, parsed: ResponsesRequest) -> Prompt:
        return Conversation(parsed.messages, param="input")

    def answer(self, parsed: ResponsesRequest, context: AnswerContext) -> ResponsesAnswer:
        return ResponsesAnswer(parsed, context)

    def refusal(self, error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
        status, body = openai_refusal(error)
        if error.param == "max_tokens":
            # The scheduler's length checks name the engine's field; this is this API's name.
            body["error"]["param"] = "max_output_tokens"
            body["error"]["message"] = error.message.replace("max_tokens", "max_output_tokens")
        return status, body


class ResponsesAnswer:
    """One request's Responses events, or its one ``response`` object."""

    def __init__(self, parsed: ResponsesRequest, context: AnswerContext) -> None:
        self._parsed = parsed
        self._context = context
        self._id = f"resp_{context.request_id}"
        self._item_id = f"msg_{context.request_id}"
        self._sequence = 0
        self._texts: list[str] = []
        self._delta_pieces = pieces(
            named_sse({**self._part_of_item("response.output_text.delta"), "delta": TEXT_MARK,
                       "logprobs": [], "sequence_number": NUMBER_MARK}),
            quote(TEXT_MARK), str(NUMBER_MARK))

    def opening(self) -> str | None:
        response = self._response("in_progress", [])
        return "".join((
            self._event({"type": "response.created", "response": response}),
            self._event({"type": "response.in_progress", "response": response}),
            self._event({"type": "response.output_item.added", "output_index": 0,
                         "item": self._message("in_progress", None)}),
            self._event({**self._part_of_item("response.content_part.added"), "part": _part("")}),
        ))

    def delta(self, text: str) -> str:
        self._texts.append(text)
        before, between, after = self._delta_pieces
        sequence = self._sequence
        self._sequence += 1
        return f"{before}{quote(text)}{between}{sequence}{after}"

    def closing(self, text: str, final: RequestOutput) -> list[str]:
        events = [self.delta(text)] if text else []
        full = "".join(self._texts)
        status = "incomplete" if final.finish_reason == "length" else "completed"
        message = self._message(status, full)
        events += [
            self._event({**self._part_of_item("response.output_text.done"), "text": full, "logprobs": []}),
            self._event({**self._part_of_item("response.content_part.done"), "part": _part(full)}),
            self._event({"type": "response.output_item.done", "output_index": 0, "item": message}),
            self._event({"type": f"response.{status}",
                         "response": self._response(status, [message], final)}),
        ]
        return events

    def failure(self, text: str, final: RequestOutput) -> list[str]:
        events = [self.delta(text)] if text else []
        status = "cancelled" if final.finish_reason == "abort" else "failed"
        error = finish_error(final)["error"]
        if final.finish_reason == "error":
            error = {**error, "code": "server_error"}  # the documented code for the model failing
        message = self._message("incomplete", "".join(self._texts))
        response = self._response(status, [message], final, error=error)
        return [*events, self._event({"type": "response.failed", "response": response})]

    def body(self, text: str, final: RequestOutput) -> dict[str, Any]:
        status = "incomplete" if final.finish_reason == "length" else "completed"
        return self._response(status, [self._message(status, text)], final)

    def error_body(self, final: RequestOutput) -> tuple[int, dict[str, Any]]:
        return 500, finish_error(final)

    def _event(self, payload: dict[str, Any]) -> str:
        payload["sequence_number"] = self._sequence
        self._sequence += 1
        return named_sse(payload)

    def _part_of_item(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "item_id": self._item_id, "output_index": 0, "content_index": 0}

    def _message(self, status: str, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": self._item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [_part(text)]}

    def _response(self, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None,
                  *, error: dict[str, Any] | None = None) -> dict[str, Any]:
        context, parsed = self._context, self._parsed
        usage = None if final is None else {
            "input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }
        return {
            "id": self._id, "object": "response", "created_at": context.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": parsed.instructions, "max_output_tokens": parsed.max_output_tokens,
            "metadata": parsed.metadata or {}, "model": context.model, "output": output,
            "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": context.params.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": context.params.top_p,
            "truncation": "disabled", "usage": usage, "user": parsed.user,
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
