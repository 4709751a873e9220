"""What every API dialect's request validation shares: the field checks, the
message lists, and the two results (:class:`SamplingFields`, :class:`ChatMessage`).

Each dialect (``openai_requests.py``, ``responses_api.py``, ``messages_api.py``)
puts each of its fields in one table: implemented, informational (accepted as
is), or unimplemented (accepted only at its default, else a 400 naming it);
any other field is unknown and gets a 400 naming it. A refusal is a
:class:`ProtocolError` whose ``param`` is the field's path (``messages[0].role``);
each dialect writes it in its own error shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**63 - 1

Accepts = Callable[[object], bool]
"""Whether a value of an unimplemented field is its default (and so accepted)."""


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
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message, its content flattened to text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ConversationRequest:
    """What every dialect's validated conversation request holds (each adds its own fields)."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    stream: bool
    user: str | None


@dataclass(frozen=True, slots=True)
class MessageShape:
    """How one dialect spells a list of messages (see :func:`parse_messages`)."""

    roles: Mapping[str, str]
    """The roles it accepts, each to the chat template's role."""
    part_types: frozenset[str]
    """The ``type`` of the text parts a list content may hold."""
    optional_keys: Mapping[str, Accepts]
    """Other keys a message may carry, with the values accepted."""
    part_keys: frozenset[str] | None = None
    """Keys a text part may carry beside ``type`` and ``text`` (hints such as
    ``cache_control``); ``None``: any (Chat Completions' parts, as before)."""


# -- what "default" means for fields we do not implement ---------------------------


def is_none(value: object) -> bool:
    return value is None


def is_none_or_false(value: object) -> bool:
    return value is None or value is False


def is_none_or_true(value: object) -> bool:
    return value is None or value is True


def is_none_or_zero(value: object) -> bool:
    return value is None or (not isinstance(value, bool) and value == 0)


def is_none_or_one(value: object) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def is_none_or_empty(value: object) -> bool:
    return value is None or value == {} or value == []


def is_falsy(value: object) -> bool:
    return not value


def is_one_of(*allowed: object) -> Accepts:
    return lambda value: value is None or value in allowed


# -- the checks -------------------------------------------------------------------------


def check_fields(
    body: object,
    implemented: frozenset[str],
    unimplemented: Mapping[str, Accepts],
    informational: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """``body`` as a dict, every key implemented, informational or at its default."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for key, value in body.items():
        if key in implemented or key in informational:
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


def require(fields: dict[str, Any], name: str) -> Any:
    """The value of a required field."""
    if fields.get(name) is None:
        raise ProtocolError(f"{name} is required", param=name)
    return fields[name]


def parse_messages(value: object, name: str, shape: MessageShape) -> tuple[ChatMessage, ...]:
    """A non-empty list of ``{"role", "content"}`` messages, each content a string or
    a list of text parts, in ``shape``'s spelling; errors name ``name[i].key``."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"{name} must be a non-empty list", param=name)
    messages: list[ChatMessage] = []
    for index, message in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(message, dict):
            raise ProtocolError(f"{where} must be an object", param=where)
        for key, item in message.items():
            accepts = shape.optional_keys.get(key)
            if key in ("role", "content") or (accepts is not None and accepts(item)):
                continue
            raise ProtocolError(f"{where}.{key} is not supported by this engine (got {item!r})",
                                param=f"{where}.{key}")
        role = shape.roles.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ProtocolError(
                f"{where}.role must be one of {sorted(shape.roles)} (got {message.get('role')!r})",
                param=f"{where}.role",
            )
        messages.append(ChatMessage(role=role, content=flatten_content(message.get("content"),
                                                                       f"{where}.content", shape)))
    return tuple(messages)


def flatten_content(content: object, where: str, shape: MessageShape) -> str:
    """A string, or a list of text parts joined into one (``None``: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part_index, part in enumerate(content):
            part_where = f"{where}[{part_index}]"
            if not isinstance(part, dict) or part.get("type") not in shape.part_types:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProtocolError(f"{part_where}: content type {kind!r} is not supported",
                                    param=part_where)
            for key in part:
                if shape.part_keys is not None and key not in ("type", "text", *shape.part_keys):
                    raise ProtocolError(f"{part_where}.{key} is not supported by this engine",
                                        param=f"{part_where}.{key}")
            texts.append(expect(part.get("text"), str, f"{part_where}.text"))
        return "".join(texts)
    raise ProtocolError(f"{where} must be a string or a list of parts", param=where)


def parse_stop(value: object, name: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ProtocolError(f"{name} must be a string or a list of strings", param=name)
    if any(not s for s in stops):
        raise ProtocolError(f"{name}: stop strings must not be empty", param=name)
    return tuple(stops)


def parse_token_ids(value: object, name: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(is_int(v) and v >= 0 for v in value):
        raise ProtocolError(f"{name} must be a list of non-negative integers", param=name)
    return frozenset(int(v) for v in value)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expect(value: object, kind: type, name: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ProtocolError(f"{name} must be a {kind.__name__}", param=name)
    return value


def optional(fields: dict[str, Any], name: str, kind: type) -> Any:
    value = fields.get(name)
    return None if value is None else expect(value, kind, name)


def true_unless_false(fields: dict[str, Any], name: str) -> bool:
    value = optional(fields, name, bool)
    return True if value is None else bool(value)


def optional_int(fields: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise ProtocolError(f"{name} must be an integer", param=name)
    if value < minimum:
        raise ProtocolError(f"{name} must be at least {minimum} (got {value})", param=name)
    return int(value)


def optional_number(
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


def optional_top_p(fields: dict[str, Any]) -> float:
    """``top_p`` in (0, 1]; 1 when not given."""
    top_p = optional_number(fields, "top_p", 0.0, 1.0)
    if top_p is not None and top_p == 0.0:
        raise ProtocolError("top_p must be greater than 0", param="top_p")
    return 1.0 if top_p is None else top_p


def with_system(messages: tuple[ChatMessage, ...], system: str | None) -> tuple[ChatMessage, ...]:
    """``messages`` after ``system`` as a system message (as they are when ``None``)."""
    return messages if system is None else (ChatMessage("system", system), *messages)


def parse_basic_sampling(
    fields: dict[str, Any],
    *,
    max_tokens: int | None,
    max_temperature: float,
    top_k: int = 0,
    stop_field: str | None = None,
) -> SamplingFields:
    """``temperature`` (0 to ``max_temperature``), ``top_p`` and, where named, the stop
    strings of ``stop_field``, checked in that order; the rest as given."""
    temperature = optional_number(fields, "temperature", 0.0, max_temperature)
    top_p = optional_top_p(fields)
    stop = () if stop_field is None else parse_stop(fields.get(stop_field), stop_field)
    return SamplingFields(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, stop=stop)


def parse_stream_options(fields: dict[str, Any], allowed: frozenset[str]) -> dict[str, bool]:
    """``stream`` and its ``stream_options``, each option a boolean named in ``allowed``."""
    options = fields.get("stream_options")
    if options is None:
        return {}
    if not optional(fields, "stream", bool):
        raise ProtocolError("stream_options is only allowed when stream is true",
                            param="stream_options")
    if not isinstance(options, dict):
        raise ProtocolError("stream_options must be an object", param="stream_options")
    for key in options:
        if key not in allowed:
            raise ProtocolError(f"unknown field 'stream_options.{key}'", param=f"stream_options.{key}")
    return {key: expect(value, bool, f"stream_options.{key}") for key, value in options.items()
            if value is not None}
