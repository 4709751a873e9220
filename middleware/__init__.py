"""tokenwire.middleware: the sans-IO wire core and the ASGI middleware.

The core (no sockets, no asyncio, time passed in) decides everything that goes
on the wire for a streamed LLM answer; drivers move bytes and events between
sockets and it. See ``stream.py`` for the theory of operation.
"""

from typing import TYPE_CHECKING, Any

from .asgi.middleware import TokenWireMiddleware, listening_socket
from .core.config import ConfigError, SlowClientPolicy, WireConfig
from .core.errors import (
    ClientError,
    ErrorCode,
    LocalError,
    LocalProtocolError,
    SSEProtocolError,
    UpstreamError,
    WireError,
)
from .core.events import (
    AbortUpstream,
    Action,
    AwaitReader,
    ClientGone,
    CloseClient,
    CommitHeaders,
    FailureKind,
    Finished,
    HandOff,
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
    Tick,
    UpstreamData,
    UpstreamEnded,
    UpstreamEvent,
    UpstreamFailed,
    UpstreamHeaders,
    WriteCompleted,
)
from .core.meter import GAP_BUCKETS_S
from .core.record import EndReason, StreamRecord
from .core.retry import RetryBudget
from .core.sse import SSEEvent, SSEParser, encode
from .core.stream import StreamState, WireStream
from .process.native import compiled_modules

if TYPE_CHECKING:
    from .shared.replay_redis import RedisReplayStore


def __getattr__(name: str) -> Any:
    """``RedisReplayStore`` on first use: it needs the ``redis`` extra, which
    nothing else here does."""
    if name == "RedisReplayStore":
        from .shared.replay_redis import RedisReplayStore

        return RedisReplayStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "HandOff",
    "Input",
    "LocalError",
    "LocalProtocolError",
    "PauseUpstream",
    "ReaderAttached",
    "RedisReplayStore",
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
    "listening_socket",
]
