from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CancelStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class CancelStreamReply(_message.Message):
    __slots__ = ("stream_id", "status")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    status: str
    def __init__(self, stream_id: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("include_usage",)
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    include_usage: bool
    def __init__(self, include_usage: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "extra_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    extra_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class ChatCompletionRequest(_message.Message):
    __slots__ = ("model", "messages", "max_tokens", "temperature", "top_p", "stop", "seed", "stream_options", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    stream_options: StreamOptions
    extra_json: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., extra_json: _Optional[str] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream_options", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    stream_options: StreamOptions
    extra_json: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., extra_json: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "type", "function_name", "function_arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    function_name: str
    function_arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., function_name: _Optional[str] = ..., function_arguments: _Optional[str] = ...) -> None: ...

class ChatChoiceDelta(_message.Message):
    __slots__ = ("index", "role", "content", "tool_calls", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ChatCompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage", "event_id", "chunk_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoiceDelta]
    usage: Usage
    event_id: str
    chunk_json: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChatChoiceDelta, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., event_id: _Optional[str] = ..., chunk_json: _Optional[str] = ...) -> None: ...

class CompletionChoiceDelta(_message.Message):
    __slots__ = ("index", "text", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage", "event_id", "chunk_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoiceDelta]
    usage: Usage
    event_id: str
    chunk_json: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[CompletionChoiceDelta, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., event_id: _Optional[str] = ..., chunk_json: _Optional[str] = ...) -> None: ...
