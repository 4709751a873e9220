"""Messages ⇄ OpenAI JSON: the request going up, each chunk coming down.

The request's typed fields become the OpenAI request's fields; ``extra_json``
(a JSON object) is merged over them as is, so any field the proto does not
type still reaches the engine; ``"stream": true`` is always set. Each chunk
the wire core sends becomes one response message: its fields typed, its JSON
kept whole in ``chunk_json``. Chunks the core merged under backpressure
arrive here as one chunk, so they become one message with the exact text.

Protobuf strings are UTF-8; JSON strings are UTF-16 with ``\\udXXX`` escapes,
and an engine behind a gateway that slices UTF-16 (JavaScript's strings) may
end one chunk's text with the high half of a surrogate pair and start the
next with the low half. Over SSE the escapes pass through and the client's
JSON parser joins them; here :class:`TextCarry` holds the high half back and
joins it (a lone surrogate that nothing completes becomes U+FFFD), and every
other string from JSON goes through :func:`~.framing.valid_text`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError, Message
from tokenwire.middleware.core.chunks import chunk_object
from tokenwire.middleware.core.errors import GrpcStatus

from tokenwire.v1 import streaming_pb2 as pb

from .framing import GrpcCallError, valid_text

JSONObject = dict[str, Any]
Chunk = pb.ChatCompletionChunk | pb.CompletionChunk
TextKey = tuple[int, int]
"""A streamed text field: (choice index, tool-call index), -1 for the choice's
own text (``content``, or a completion's ``text``)."""


def _extra(text: str, where: str) -> JSONObject:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise GrpcCallError(GrpcStatus.INVALID_ARGUMENT, f"{where}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise GrpcCallError(GrpcStatus.INVALID_ARGUMENT, f"{where}: not a JSON object")
    return value


def _common(request: pb.ChatCompletionRequest | pb.CompletionRequest, body: JSONObject) -> None:
    if request.model:
        body["model"] = request.model
    if request.HasField("max_tokens"):
        body["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        body["temperature"] = request.temperature
    if request.HasField("top_p"):
        body["top_p"] = request.top_p
    if request.stop:
        body["stop"] = list(request.stop)
    if request.HasField("seed"):
        body["seed"] = request.seed
    if request.HasField("stream_options"):
        body["stream_options"] = {"include_usage": request.stream_options.include_usage}


def chat_request_body(request: pb.ChatCompletionRequest) -> JSONObject:
    """The OpenAI ``/v1/chat/completions`` request for ``request``."""
    body: JSONObject = {}
    _common(request, body)
    messages: list[JSONObject] = []
    for i, message in enumerate(request.messages):
        item: JSONObject = {"role": message.role, "content": message.content}
        if message.HasField("name"):
            item["name"] = message.name
        item.update(_extra(message.extra_json, f"messages[{i}].extra_json"))
        messages.append(item)
    body["messages"] = messages
    body.update(_extra(request.extra_json, "extra_json"))
    body["stream"] = True
    return body


def completion_request_body(request: pb.CompletionRequest) -> JSONObject:
    """The OpenAI ``/v1/completions`` request for ``request``."""
    body: JSONObject = {}
    _common(request, body)
    body["prompt"] = request.prompt
    body.update(_extra(request.extra_json, "extra_json"))
    body["stream"] = True
    return body


def decode_request(message_type: type[Message], data: bytes) -> Message:
    """Parse one request message; a malformed one is INTERNAL, as gRPC servers answer it."""
    request = message_type()
    try:
        request.ParseFromString(data)
    except DecodeError as error:
        raise GrpcCallError(GrpcStatus.INTERNAL, f"malformed request message: {error}") from None
    return request


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _str(value: object) -> str:
    return valid_text(value) if isinstance(value, str) else ""


class TextCarry:
    """One call's streamed text fields, carried across chunks as valid UTF-8.

    :meth:`text` takes a field's text from each chunk: a high surrogate at its
    end (half a pair split across chunks) is held back, per field, and put
    before that field's next text, where the low half joins it into the
    character; if the next text does not start with one, it is U+FFFD. What is
    still held when a message with no text comes (role, finish, usage) goes
    out before it, and what is held when the stream ends goes out last, as
    U+FFFD (:meth:`flush`). Sans-IO; one per call.
    """

    __slots__ = ("_held", "_last", "_texts")

    def __init__(self) -> None:
        self._held: dict[TextKey, str] = {}
        self._last: Chunk | None = None  # the last message with text: what a flush looks like
        self._texts = False  # the message being built has text

    def text(self, key: TextKey, text: str) -> str:
        """Field ``key``'s text in this chunk, as the message carries it."""
        if text:
            self._texts = True
        held = self._held.pop(key, "")
        text = held + text
        if text and "\ud800" <= text[-1] <= "\udbff":
            self._held[key] = text[-1]
            text = text[:-1]
        return valid_text(text)

    def messages(self, to_message: Callable[[str, str | None, TextCarry | None], Chunk],
                 data: str, event_id: str | None) -> list[Chunk]:
        """The message for one event; after a :meth:`flush` if it has no text."""
        self._texts = False
        message = to_message(data, event_id, self)
        if self._texts:
            self._last = message
            return [message]
        flushed = self.flush()
        return [message] if flushed is None else [flushed, message]

    def flush(self) -> Chunk | None:
        """What is held, as U+FFFD in each field, in a message of its own (the
        last text message's id, model and created; no ``chunk_json``: no engine
        chunk is its own), or None when nothing is."""
        held, self._held = self._held, {}
        if not held or self._last is None:
            return None
        last = self._last
        out = type(last)(id=last.id, model=last.model, created=last.created)
        choices: dict[int, pb.ChatChoiceDelta | pb.CompletionChoiceDelta] = {}
        for index, call in sorted(held):
            choice = choices.get(index)
            if choice is None:
                choice = choices[index] = out.choices.add(index=index)
            if isinstance(choice, pb.CompletionChoiceDelta):
                choice.text = "\ufffd"
            elif call < 0:
                choice.content = "\ufffd"
            else:
                choice.tool_calls.add(index=call, function_arguments="\ufffd")
        return out


def _text(carry: TextCarry | None, key: TextKey, value: object) -> str:
    text = value if isinstance(value, str) else ""
    return valid_text(text) if carry is None else carry.text(key, text)


def _usage(target: pb.Usage, usage: object) -> None:
    if isinstance(usage, dict):
        target.prompt_tokens = _int(usage.get("prompt_tokens"))
        target.completion_tokens = _int(usage.get("completion_tokens"))
        target.total_tokens = _int(usage.get("total_tokens"))


def _head(chunk: pb.ChatCompletionChunk | pb.CompletionChunk, obj: JSONObject, data: str,
          event_id: str | None) -> None:
    chunk.id = _str(obj.get("id"))
    chunk.model = _str(obj.get("model"))
    chunk.created = _int(obj.get("created"))
    chunk.chunk_json = data
    if event_id:
        chunk.event_id = event_id
    if isinstance(obj.get("usage"), dict):
        _usage(chunk.usage, obj["usage"])


def chat_chunk(data: str, event_id: str | None = None,
               carry: TextCarry | None = None) -> pb.ChatCompletionChunk:
    """One ``chat.completion.chunk`` (or, from an engine that did not stream,
    the whole ``chat.completion``) as a message; its text through ``carry``
    (without one, a lone surrogate is U+FFFD at once)."""
    chunk = pb.ChatCompletionChunk()
    obj = chunk_object(data)
    if obj is None:
        chunk.chunk_json = data
        return chunk
    _head(chunk, obj, data, event_id)
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        out = chunk.choices.add()
        out.index = _int(choice.get("index"))
        out.finish_reason = _str(choice.get("finish_reason"))
        delta = choice.get("delta", choice.get("message"))
        if not isinstance(delta, dict):
            continue
        out.role = _str(delta.get("role"))
        out.content = _text(carry, (out.index, -1), delta.get("content"))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if not isinstance(call, dict):
                continue
            tool = out.tool_calls.add()
            tool.index = _int(call.get("index"))
            tool.id = _str(call.get("id"))
            tool.type = _str(call.get("type"))
            function = call.get("function")
            if isinstance(function, dict):
                tool.function_name = _str(function.get("name"))
                tool.function_arguments = _text(carry, (out.index, tool.index), function.get("arguments"))
    return chunk


def completion_chunk(data: str, event_id: str | None = None,
                     carry: TextCarry | None = None) -> pb.CompletionChunk:
    """One ``text_completion`` chunk as a message; its text through ``carry``."""
    chunk = pb.CompletionChunk()
    obj = chunk_object(data)
    if obj is None:
        chunk.chunk_json = data
        return chunk
    _head(chunk, obj, data, event_id)
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            out = chunk.choices.add()
            out.index = _int(choice.get("index"))
            out.text = _text(carry, (out.index, -1), choice.get("text"))
            out.finish_reason = _str(choice.get("finish_reason"))
    return chunk
