"""OpenAI Chat Completions and Completions, as answers of the shared path (``dialect.py``).

A stream is ``data:`` chunks (Chat's first one carries the role), the last
with the finish reason, optionally a usage chunk, then ``data: [DONE]``. A
failure after the first byte is an in-band ``data: {"error": ...}`` and the
stream ends without ``[DONE]``. Refusals before it are OpenAI error bodies,
written here, in :func:`openai_refusal` (the Responses API's too).
"""

from __future__ import annotations

from typing import Any

from tokenwire.engine.backend import RequestOutput, RequestRejected
from tokenwire.engine.dialect import (
    TEXT_MARK,
    AnswerContext,
    Conversation,
    Prompt,
    failure_message,
    pieces,
    quote,
    sse,
)
from tokenwire.engine.openai_requests import (
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    parse_chat_request,
    parse_completion_request,
)
from tokenwire.middleware.core.errors import ErrorCode, error_object

_DONE = "data: [DONE]\n\n"


class ChatDialect:
    """``POST /v1/chat/completions``."""

    endpoint = "chat"

    def parse(self, body: object) -> ChatRequest:
        return parse_chat_request(body)

    def prompt(self, parsed: ChatRequest) -> Prompt:
        return Conversation(parsed.messages)

    def answer(self, parsed: ChatRequest, context: AnswerContext) -> OpenAIAnswer:
        return OpenAIAnswer(context, chat=True, include_usage=parsed.include_usage)

    def refusal(self, error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
        return openai_refusal(error)


class CompletionsDialect:
    """``POST /v1/completions``."""

    endpoint = "completions"

    def parse(self, body: object) -> CompletionRequest:
        return parse_completion_request(body)

    def prompt(self, parsed: CompletionRequest) -> Prompt:
        return parsed.prompt

    def answer(self, parsed: CompletionRequest, context: AnswerContext) -> OpenAIAnswer:
        return OpenAIAnswer(context, chat=False, include_usage=parsed.include_usage)

    def refusal(self, error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
        return openai_refusal(error)


class OpenAIAnswer:
    """One request's OpenAI chunks, or its one OpenAI response."""

    def __init__(self, context: AnswerContext, *, chat: bool, include_usage: bool) -> None:
        self._context = context
        self._chat = chat
        self._include_usage = include_usage
        self._id = f"{'chatcmpl' if chat else 'cmpl'}-{context.request_id}"
        self._object = "chat.completion.chunk" if chat else "text_completion"
        # The body of every text-only chunk, split around its text.
        self._text_prefix, self._text_suffix = pieces(self._chunk(TEXT_MARK, None), quote(TEXT_MARK))

    def opening(self) -> str | None:
        return self._chunk({"role": "assistant", "content": ""}, None) if self._chat else None

    def delta(self, text: str) -> str:
        return self._text_prefix + quote(text) + self._text_suffix

    def closing(self, text: str, final: RequestOutput) -> list[str]:
        events = [self._chunk(text, final.finish_reason, final.stop_reason)]
        if self._include_usage:
            events.append(sse({**self._head(), "choices": [],
                               "usage": usage(final.prompt_tokens, final.completion_tokens)}))
        events.append(_DONE)
        return events

    def failure(self, text: str, final: RequestOutput) -> list[str]:
        error = sse(finish_error(final))
        return [self._chunk(text, None), error] if text else [error]

    def body(self, text: str, final: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any]
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=final.finish_reason, stop_reason=final.stop_reason)
        return {**self._head(), "object": "chat.completion" if self._chat else "text_completion",
                "choices": [choice], "usage": usage(final.prompt_tokens, final.completion_tokens)}

    def error_body(self, final: RequestOutput) -> tuple[int, dict[str, Any]]:
        return 500, finish_error(final)

    def _head(self) -> dict[str, Any]:
        return {"id": self._id, "object": self._object, "created": self._context.created,
                "model": self._context.model}

    def _chunk(self, content: str | dict[str, str], finish_reason: str | None,
               stop_reason: int | str | None = None) -> str:
        if self._chat:
            if isinstance(content, dict):
                delta: dict[str, str] = content
            else:
                delta = {"content": content} if content else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return sse(chunk)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_error(final: RequestOutput) -> dict[str, Any]:
    """The OpenAI error object of an aborted or failed generation."""
    code = ErrorCode.CANCELLED if final.finish_reason == "abort" else ErrorCode.INTERNAL
    return error_object(failure_message(final), "server_error", code, param=None)


def openai_refusal(error: ProtocolError | RequestRejected) -> tuple[int, dict[str, Any]]:
    """The one place a refused OpenAI request becomes an error body."""
    status = error.http_status
    if status == 503:
        kind, ours = "server_error", ErrorCode.UPSTREAM_UNAVAILABLE
    else:
        kind, ours = "invalid_request_error", ErrorCode.BAD_REQUEST
    body = error_object(error.message, kind, ours, param=error.param)
    if status == 404:
        # OpenAI's own code for an unknown model; tokenwire's stays bad_request.
        body["error"]["code"] = "model_not_found"  # type: ignore[index]
    return status, body
