"""The ASGI driver's types: the ASGI callables, and what an exchange reads of its middleware.

Apart from the modules that use them, so that the middleware, its exchanges
and their writers import their types from here and none imports another for
its types alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from ..core.config import WireConfig
from ..core.dialects import DialectTable
from ..core.record import StreamRecord
from ..core.resume import CallerKey
from ..shared.replay_store import ReplayStore

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
OnAbort = Callable[[str, str], object]
"""``on_abort(request_id, reason)``; may be a coroutine function."""
OnFinished = Callable[[StreamRecord], object]


class MiddlewareSettings(Protocol):
    """What an :class:`~tokenwire.middleware.asgi.exchange.Exchange` reads of its
    :class:`~tokenwire.middleware.asgi.middleware.TokenWireMiddleware`."""

    app: ASGIApp
    config: WireConfig
    on_abort: OnAbort | None
    on_finished: OnFinished | None
    request_id_header: bytes
    replay_store: ReplayStore | None
    caller_key: CallerKey
    dialects: DialectTable
    writers: dict[str, Any]
    """The exchanges writing a resumable stream, by stream id."""

    def stop_writer(self, stream_id: str) -> bool: ...
