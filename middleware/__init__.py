"""tokenwire.middleware: the sans-IO wire core and the ASGI middleware.

The core (no sockets, no asyncio, time passed in) decides everything that goes
on the wire for a streamed LLM answer; drivers move bytes and events between
sockets and it. See ``stream.py`` for the theory of operation.
"""

from .asgi import TokenWireMiddleware
from .config import ConfigError, SlowClientPolicy, WireConfig
from .errors import (
    ClientError,
    ErrorCode,
    LocalError,
    LocalProtocolError,
    SSEProtocolError,
    UpstreamError,
    WireError,
)
from .events import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    EndReason,
    FailureKind,
    Finished,
    Input,
    PauseUpstream,
    ReaderAttached,
    Rejected,
    ReplayAppend,
    ReplaySource,
    ResumeUpstream,
    RetryUpstream,
    SocketPaused,
    SocketResumed,
    StopRequested,
    StreamRecord,
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
    WriteCompleted,
)
from .meter import GAP_BUCKETS_S
from .native import compiled_modules
from .retry import RetryBudget
from .sse import SSEEvent, SSEParser, encode
from .stream import StreamState, WireStream

__all__ = [
    "GAP_BUCKETS_S",
    "AbortUpstream",
    "Action",
    "AwaitReader",
    "ClientError",
    "ClientGone",
    "CloseClient",
    "CommitHeaders",
    "ConfigError",
    "EndReason",
    "ErrorCode",
    "FailureKind",
    "Finished",
    "Input",
    "LocalError",
    "LocalProtocolError",
    "PauseUpstream",
    "ReaderAttached",
    "Rejected",
    "ReplayAppend",
    "ReplaySource",
    "ResumeUpstream",
    "RetryBudget",
    "RetryUpstream",
    "SSEEvent",
    "SSEParser",
    "SSEProtocolError",
    "SlowClientPolicy",
    "SocketPaused",
    "SocketResumed",
    "StopRequested",
    "StreamRecord",
    "StreamState",
    "Tick",
    "TokenWireMiddleware",
    "UpstreamData",
    "UpstreamEnded",
    "UpstreamError",
    "UpstreamEvent",
    "UpstreamFailed",
    "UpstreamHeaders",
    "WireConfig",
    "WireError",
    "WireStream",
    "WriteCompleted",
    "compiled_modules",
    "encode",
]
