"""OpenAI request validation: every field is implemented, refused, or unknown.

Each request field is in exactly one table:

- ``_SHARED_FIELDS`` / ``_COMPLETION_FIELDS`` / ``_CHAT_FIELDS``: implemented;
- ``_INFORMATIONAL``: carries no generation semantics (``user``, ``metadata``...)
  and is accepted as is;
- ``_UNIMPLEMENTED``: a real OpenAI or vLLM field this engine does not do; it
  is accepted only at its default value, otherwise a 400 names it.

Any other field is unknown and gets a 400 naming it. Nothing is silently
ignored: a client that asks for ``logit_bias`` or ``tools`` learns at once that
it did not get them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_MAX_SEED = 2**63 - 1


class ProtocolError(Exception):
    """The request is malformed or asks for something unsupported (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, http_status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.http_status = http_status


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling part of a request, before the prompt length is known."""

    max_tokens: int | None
    """``None``: up to the context length (chat's default)."""
    temperature: float | None
    """``None``: not given; the model's default applies (see ``LoadedModel.default_temperature``)."""
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool


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
class ChatMessage:
    """One message, its content flattened to text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    stream: bool
    include_usage: bool
    user: str | None


# -- what "default" means for fields we do not implement ---------------------------


def _is_none(value: object) -> bool:
    return value is None


def _is_none_or_false(value: object) -> bool:
    return value is None or value is False


def _is_none_or_true(value: object) -> bool:
    return value is None or value is True


def _is_none_or_zero(value: object) -> bool:
    return value is None or (not isinstance(value, bool) and value == 0)


def _is_none_or_one(value: object) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def _is_none_or_empty(value: object) -> bool:
    return value is None or value == {} or value == []


def _is_one_of(*allowed: object) -> Callable[[object], bool]:
    return lambda value: value is None or value in allowed


_UNIMPLEMENTED: dict[str, Callable[[object], bool]] = {
    # OpenAI, both endpoints
    "frequency_penalty": _is_none_or_zero,
    "presence_penalty": _is_none_or_zero,
    "logit_bias": _is_none_or_empty,
    # vLLM extensions that benchmark and eval clients send
    "min_p": _is_none_or_zero,
    "repetition_penalty": _is_none_or_one,
    "length_penalty": _is_none_or_one,
    "use_beam_search": _is_none_or_false,
    "include_stop_str_in_output": _is_none_or_false,
    "prompt_logprobs": _is_none,
    "truncate_prompt_tokens": _is_none,
    "spaces_between_special_tokens": _is_none_or_true,
}
_UNIMPLEMENTED_COMPLETION: dict[str, Callable[[object], bool]] = {
    "best_of": _is_none_or_one,
    "echo": _is_none_or_false,
    "suffix": _is_none,
    "logprobs": _is_none,
}
_UNIMPLEMENTED_CHAT: dict[str, Callable[[object], bool]] = {
    "tools": _is_none_or_empty,
    "tool_choice": _is_one_of("none", "auto"),
    "parallel_tool_calls": _is_none_or_true,
    "functions": _is_none_or_empty,
    "function_call": _is_one_of("none", "auto"),
    "response_format": lambda value: value is None or value == {"type": "text"},
    "logprobs": _is_none_or_false,
    "top_logprobs": _is_none_or_zero,
    "audio": _is_none,
    "modalities": lambda value: value is None or value == ["text"],
    "prediction": _is_none,
    "reasoning_effort": _is_none,
    "verbosity": _is_none,
    "web_search_options": _is_none,
    "service_tier": _is_one_of("auto", "default"),
    "store": _is_none_or_false,
}
_INFORMATIONAL = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})
_SHARED_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
})
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt"}
_CHAT_FIELDS = _SHARED_FIELDS | {"messages", "max_completion_tokens"}
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    fields = _check_fields(body, _COMPLETION_FIELDS, {**_UNIMPLEMENTED, **_UNIMPLEMENTED_COMPLETION})
    if "prompt" not in fields:
        raise ProtocolError("prompt is required", param="prompt")
    stream, include_usage = _parse_stream(fields)
    return CompletionRequest(
        model=_optional(fields, "model", str),
        prompt=_parse_prompt(fields["prompt"]),
        sampling=_parse_sampling(fields, default_max_tokens=16),
        stream=stream,
        include_usage=include_usage,
        user=_optional(fields, "user", str),
    )


def parse_chat_request(body: object) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body."""
    fields = _check_fields(body, _CHAT_FIELDS, {**_UNIMPLEMENTED, **_UNIMPLEMENTED_CHAT})
    if "messages" not in fields:
        raise ProtocolError("messages is required", param="messages")
    stream, include_usage = _parse_stream(fields)
    max_completion = _optional_int(fields, "max_completion_tokens", minimum=1)
    sampling = _parse_sampling(fields, default_max_tokens=None)
    if max_completion is not None:
        # OpenAI's newer name wins when both are sent, as in vLLM.
        sampling = _replace_max_tokens(sampling, max_completion)
    return ChatRequest(
        model=_optional(fields, "model", str),
        messages=_parse_messages(fields["messages"]),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=_optional(fields, "user", str),
    )


# -- helpers --------------------------------------------------------------------------


def _check_fields(
    body: object,
    implemented: frozenset[str],
    unimplemented: Mapping[str, Callable[[object], bool]],
) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for key, value in body.items():
        if key in implemented or key in _INFORMATIONAL:
            continue
        accepts_default = unimplemented.get(key)
        if accepts_default is None:
            raise ProtocolError(f"unknown field {key!r}", param=key)
        if not accepts_default(value):
            raise ProtocolError(
                f"{key} is not supported by this engine (got {value!r}); "
                "leave it out or send its default",
                param=key,
            )
    return body


def _parse_stream(fields: dict[str, Any]) -> tuple[bool, bool]:
    stream = _optional(fields, "stream", bool) or False
    options = fields.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ProtocolError("stream_options is only allowed when stream is true",
                            param="stream_options")
    if not isinstance(options, dict):
        raise ProtocolError("stream_options must be an object", param="stream_options")
    include_usage = False
    for key, value in options.items():
        name = f"stream_options.{key}"
        if key == "include_usage":
            include_usage = _expect(value, bool, name)
        elif key == "include_obfuscation":
            # We never add obfuscation padding; either value is honoured as is.
            _expect(value, bool, name)
        elif key == "continuous_usage_stats":
            if value not in (None, False):
                raise ProtocolError(f"{name} is not supported by this engine", param=name)
        else:
            raise ProtocolError(f"unknown field {name!r}", param=name)
    return stream, include_usage


def _parse_sampling(fields: dict[str, Any], *, default_max_tokens: int | None) -> SamplingFields:
    n = fields.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ProtocolError(f"n: only n=1 is supported (got {n!r})", param="n")
    max_tokens = _optional_int(fields, "max_tokens", minimum=1)
    temperature = _optional_number(fields, "temperature", 0.0, 2.0)
    top_p = _optional_number(fields, "top_p", 0.0, 1.0)
    if top_p is not None and top_p == 0.0:
        raise ProtocolError("top_p must be greater than 0", param="top_p")
    top_k = _optional_int(fields, "top_k", minimum=-1)
    seed = _optional_int(fields, "seed", minimum=-_MAX_SEED)
    if seed is not None and seed > _MAX_SEED:
        raise ProtocolError(f"seed must be at most {_MAX_SEED}", param="seed")
    min_tokens = _optional_int(fields, "min_tokens", minimum=0) or 0
    resolved_max = max_tokens if max_tokens is not None else default_max_tokens
    if resolved_max is not None and min_tokens > resolved_max:
        raise ProtocolError("min_tokens must not exceed max_tokens", param="min_tokens")
    return SamplingFields(
        max_tokens=resolved_max,
        temperature=temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else int(top_k),
        seed=seed,
        stop=_parse_stop(fields.get("stop")),
        stop_token_ids=_parse_token_ids(fields.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=_optional(fields, "ignore_eos", bool) or False,
        min_tokens=min_tokens,
        skip_special_tokens=_true_unless_false(fields, "skip_special_tokens"),
    )


def _replace_max_tokens(sampling: SamplingFields, max_tokens: int) -> SamplingFields:
    if sampling.min_tokens > max_tokens:
        raise ProtocolError("min_tokens must not exceed max_completion_tokens",
                            param="min_tokens")
    values = {name: getattr(sampling, name) for name in SamplingFields.__slots__}
    values["max_tokens"] = max_tokens
    return SamplingFields(**values)


def _parse_prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return tuple(int(v) for v in value)
    if isinstance(value, list) and len(value) == 1:
        return _parse_prompt(value[0])
    if isinstance(value, list) and len(value) > 1:
        raise ProtocolError("only one prompt per request is supported", param="prompt")
    raise ProtocolError("prompt must be a string or a list of token ids", param="prompt")


def _parse_messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    messages: list[ChatMessage] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ProtocolError(f"{where} must be an object", param=where)
        for key, item in message.items():
            if key in ("role", "content"):
                continue
            if key in ("name", "tool_calls", "refusal", "audio", "function_call") and not item:
                continue
            raise ProtocolError(f"{where}.{key} is not supported by this engine",
                                param=f"{where}.{key}")
        role = _CHAT_ROLES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ProtocolError(
                f"{where}.role must be one of {sorted(_CHAT_ROLES)} (got {message.get('role')!r})",
                param=f"{where}.role",
            )
        messages.append(ChatMessage(role=role, content=_flatten_content(message, where)))
    return tuple(messages)


def _flatten_content(message: dict[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part_index, part in enumerate(content):
            part_where = f"{where}.content[{part_index}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProtocolError(f"{part_where}: content type {kind!r} is not supported",
                                    param=part_where)
            texts.append(_expect(part.get("text"), str, f"{part_where}.text"))
        return "".join(texts)
    raise ProtocolError(f"{where}.content must be a string or a list of parts",
                        param=f"{where}.content")


def _parse_stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ProtocolError("stop must be a string or a list of strings", param="stop")
    if any(not s for s in stops):
        raise ProtocolError("stop strings must not be empty", param="stop")
    return tuple(stops)


def _parse_token_ids(value: object, name: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise ProtocolError(f"{name} must be a list of non-negative integers", param=name)
    return frozenset(int(v) for v in value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(value: object, kind: type, name: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ProtocolError(f"{name} must be a {kind.__name__}", param=name)
    return value


def _optional(fields: dict[str, Any], name: str, kind: type) -> Any:
    value = fields.get(name)
    return None if value is None else _expect(value, kind, name)


def _true_unless_false(fields: dict[str, Any], name: str) -> bool:
    value = _optional(fields, name, bool)
    return True if value is None else bool(value)


def _optional_int(fields: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ProtocolError(f"{name} must be an integer", param=name)
    if value < minimum:
        raise ProtocolError(f"{name} must be at least {minimum} (got {value})", param=name)
    return int(value)


def _optional_number(
    fields: dict[str, Any], name: str, minimum: float, maximum: float
) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} must be a number", param=name)
    if not minimum <= value <= maximum:
        raise ProtocolError(f"{name} must be between {minimum} and {maximum} (got {value})",
                            param=name)
    return float(value)
