"""OpenAI request validation: every field is implemented, refused, or unknown.

Each request field is in exactly one table:

- ``_SHARED_FIELDS`` / ``_COMPLETION_FIELDS`` / ``_CHAT_FIELDS``: implemented;
- ``INFORMATIONAL``: carries no generation semantics (``user``, ``metadata``...)
  and is accepted as is;
- ``_UNIMPLEMENTED``: a real OpenAI or vLLM field this engine does not do; it
  is accepted only at its default value, otherwise a 400 names it.

Any other field is unknown and gets a 400 naming it. Nothing is silently
ignored: a client that asks for ``logit_bias`` or ``tools`` learns at once that
it did not get them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenwire.engine.request_fields import (
    MAX_SEED,
    Accepts,
    ChatMessage,
    ConversationRequest,
    MessageShape,
    ProtocolError,
    SamplingFields,
    check_fields,
    is_falsy,
    is_int,
    is_none,
    is_none_or_empty,
    is_none_or_false,
    is_none_or_one,
    is_none_or_true,
    is_none_or_zero,
    is_one_of,
    optional,
    optional_int,
    optional_number,
    optional_top_p,
    parse_messages,
    parse_stop,
    parse_stream_options,
    parse_token_ids,
    require,
    true_unless_false,
)

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "ProtocolError", "SamplingFields",
           "parse_chat_request", "parse_completion_request"]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    model: str | None
    prompt: str | tuple[int, ...]
    sampling: SamplingFields
    stream: bool
    include_usage: bool
    user: str | None


@dataclass(frozen=True, slots=True)
class ChatRequest(ConversationRequest):
    """A validated ``/v1/chat/completions`` request."""

    include_usage: bool


_UNIMPLEMENTED: dict[str, Accepts] = {
    # OpenAI, both endpoints
    "frequency_penalty": is_none_or_zero,
    "presence_penalty": is_none_or_zero,
    "logit_bias": is_none_or_empty,
    # vLLM extensions that benchmark and eval clients send
    "min_p": is_none_or_zero,
    "repetition_penalty": is_none_or_one,
    "length_penalty": is_none_or_one,
    "use_beam_search": is_none_or_false,
    "include_stop_str_in_output": is_none_or_false,
    "prompt_logprobs": is_none,
    "truncate_prompt_tokens": is_none,
    "spaces_between_special_tokens": is_none_or_true,
}
_UNIMPLEMENTED_COMPLETION: dict[str, Accepts] = {
    "best_of": is_none_or_one,
    "echo": is_none_or_false,
    "suffix": is_none,
    "logprobs": is_none,
}
_UNIMPLEMENTED_CHAT: dict[str, Accepts] = {
    "tools": is_none_or_empty,
    "tool_choice": is_one_of("none", "auto"),
    "parallel_tool_calls": is_none_or_true,
    "functions": is_none_or_empty,
    "function_call": is_one_of("none", "auto"),
    "response_format": lambda value: value is None or value == {"type": "text"},
    "logprobs": is_none_or_false,
    "top_logprobs": is_none_or_zero,
    "audio": is_none,
    "modalities": lambda value: value is None or value == ["text"],
    "prediction": is_none,
    "reasoning_effort": is_none,
    "verbosity": is_none,
    "web_search_options": is_none,
    "service_tier": is_one_of("auto", "default"),
    "store": is_none_or_false,
}
INFORMATIONAL = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})
"""Fields with no generation semantics, accepted as they are (the Responses API's too)."""
_SHARED_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
})
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt"}
_CHAT_FIELDS = _SHARED_FIELDS | {"messages", "max_completion_tokens"}
_CHAT_MESSAGES = MessageShape(
    roles={"system": "system", "developer": "system", "user": "user", "assistant": "assistant"},
    part_types=frozenset({"text"}),
    optional_keys=dict.fromkeys(("name", "tool_calls", "refusal", "audio", "function_call"), is_falsy),
)


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    fields = check_fields(body, _COMPLETION_FIELDS, {**_UNIMPLEMENTED, **_UNIMPLEMENTED_COMPLETION},
                          INFORMATIONAL)
    stream, include_usage = _parse_stream(fields)
    return CompletionRequest(
        model=optional(fields, "model", str),
        prompt=_parse_prompt(require(fields, "prompt")),
        sampling=_parse_sampling(fields, default_max_tokens=16),
        stream=stream,
        include_usage=include_usage,
        user=optional(fields, "user", str),
    )


def parse_chat_request(body: object) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body."""
    fields = check_fields(body, _CHAT_FIELDS, {**_UNIMPLEMENTED, **_UNIMPLEMENTED_CHAT},
                          INFORMATIONAL)
    messages = parse_messages(require(fields, "messages"), "messages", _CHAT_MESSAGES)
    stream, include_usage = _parse_stream(fields)
    max_completion = optional_int(fields, "max_completion_tokens", minimum=1)
    sampling = _parse_sampling(fields, default_max_tokens=None)
    if max_completion is not None:
        # OpenAI's newer name wins when both are sent, as in vLLM.
        if sampling.min_tokens > max_completion:
            raise ProtocolError("min_tokens must not exceed max_completion_tokens",
                                param="min_tokens")
        sampling = replace(sampling, max_tokens=max_completion)
    return ChatRequest(
        model=optional(fields, "model", str),
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=optional(fields, "user", str),
    )


# -- helpers --------------------------------------------------------------------------


def _parse_stream(fields: dict[str, Any]) -> tuple[bool, bool]:
    stream = optional(fields, "stream", bool) or False
    # include_obfuscation: we never add obfuscation padding; either value is honoured as is.
    options = parse_stream_options(
        fields, frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"}))
    if options.get("continuous_usage_stats"):
        name = "stream_options.continuous_usage_stats"
        raise ProtocolError(f"{name} is not supported by this engine", param=name)
    return stream, options.get("include_usage", False)


def _parse_sampling(fields: dict[str, Any], *, default_max_tokens: int | None) -> SamplingFields:
    n = fields.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ProtocolError(f"n: only n=1 is supported (got {n!r})", param="n")
    max_tokens = optional_int(fields, "max_tokens", minimum=1)
    temperature = optional_number(fields, "temperature", 0.0, 2.0)
    top_p = optional_top_p(fields)
    top_k = optional_int(fields, "top_k", minimum=-1)
    seed = optional_int(fields, "seed", minimum=-MAX_SEED)
    if seed is not None and seed > MAX_SEED:
        raise ProtocolError(f"seed must be at most {MAX_SEED}", param="seed")
    min_tokens = optional_int(fields, "min_tokens", minimum=0) or 0
    resolved_max = max_tokens if max_tokens is not None else default_max_tokens
    if resolved_max is not None and min_tokens > resolved_max:
        raise ProtocolError("min_tokens must not exceed max_tokens", param="min_tokens")
    return SamplingFields(
        max_tokens=resolved_max,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k in (None, -1) else int(top_k),
        seed=seed,
        stop=parse_stop(fields.get("stop")),
        stop_token_ids=parse_token_ids(fields.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=optional(fields, "ignore_eos", bool) or False,
        min_tokens=min_tokens,
        skip_special_tokens=true_unless_false(fields, "skip_special_tokens"),
    )


def _parse_prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        return tuple(int(v) for v in value)
    if isinstance(value, list) and len(value) == 1:
        return _parse_prompt(value[0])
    if isinstance(value, list) and len(value) > 1:
        raise ProtocolError("only one prompt per request is supported", param="prompt")
    raise ProtocolError("prompt must be a string or a list of token ids", param="prompt")
