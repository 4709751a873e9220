"""The lifecycle of one response, as the client sees it: a transition table.

Theory of operation
-------------------
Five states, and four triggers that move between them; anything not in
:data:`TRANSITIONS` raises :class:`~tokenwire.middleware.core.errors.LocalProtocolError`::

    WAITING ──COMMIT──▶ COMMITTED ──SEND──▶ STREAMING ──SEND──▶ STREAMING
       │                   │                    │
       └──ABORT──▶ ABORTED ◀──ABORT── (any) ──FINISH──▶ DONE ──ABORT──▶ ABORTED

* WAITING: no byte has gone to the client. The upstream status and headers
  are held until the first upstream event or ``commit_deadline_s``. Only here
  may an upstream failure be retried ("may we retry?" is "are we WAITING?");
  when it cannot be, the client gets a real HTTP status with a JSON error body.
* COMMITTED: headers are out (SSE headers, or an error/passthrough status).
  Heartbeats keep the connection alive through a silent prefill.
* STREAMING: events flow. Failures now travel in-band as an error event,
  after which the body is cut without its chunked terminator.
* DONE: the upstream finished (its terminal marker, or a clean EOF for a
  passthrough body); the tail is being flushed. ABORTED: ended for any other
  reason; the stream's ``end_reason`` says which.

The other parts of the core (``attempt.py``, ``client_socket.py``,
``recording.py``, ``accounting.py``) keep their own, smaller states beside
this one; ``stream.py`` composes them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from .errors import LocalProtocolError


class StreamState(StrEnum):
    """Lifecycle states; see the module docstring."""

    WAITING = "waiting"
    COMMITTED = "committed"
    STREAMING = "streaming"
    DONE = "done"
    ABORTED = "aborted"


class Trigger(StrEnum):
    """What moves the lifecycle on. A ``StrEnum`` (as :class:`StreamState`)
    because :data:`TRANSITIONS` is looked up by member: a plain ``Enum``
    member hashes through ``Enum.__hash__``, interpreted, a ``str`` one in C."""

    COMMIT = "commit"
    SEND = "send"
    FINISH = "finish"
    ABORT = "abort"


W: Final = StreamState.WAITING
C: Final = StreamState.COMMITTED
S: Final = StreamState.STREAMING
D: Final = StreamState.DONE
A: Final = StreamState.ABORTED
TRANSITIONS: Final[dict[StreamState, dict[Trigger, StreamState]]] = {
    W: {Trigger.COMMIT: C, Trigger.ABORT: A},
    C: {Trigger.SEND: S, Trigger.FINISH: D, Trigger.ABORT: A},
    S: {Trigger.SEND: S, Trigger.FINISH: D, Trigger.ABORT: A},
    D: {Trigger.ABORT: A},
    A: {},
}
ENDED: Final = frozenset({D, A})
"""The states in which the upstream's part is over and only the tail is flushed."""


def next_state(state: StreamState, trigger: Trigger) -> StreamState:
    """Where ``trigger`` takes ``state``; LocalProtocolError if nowhere."""
    try:
        return TRANSITIONS[state][trigger]
    except KeyError:
        raise LocalProtocolError(f"can't {trigger.value} in state {state.value}") from None
