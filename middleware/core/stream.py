"""The per-response wire state machine: every rule about what goes on the wire.

Theory of operation
-------------------
One :class:`WireStream` exists per response. A driver (the ASGI middleware or
the sidecar) feeds it inputs from ``tokenwire.middleware.core.events`` with
``handle(input, now)``, executes the actions it returns in order, then writes
``data_to_send(now)`` when non-empty and reports ``WriteCompleted`` once the
socket took those bytes. It calls ``handle(Tick(), now)`` at
``next_deadline()``. The core never reads a clock: ``now`` is passed in, so its
tests never sleep.

The stream composes small parts, each with its own states and docstring:

* ``lifecycle.py``: the response as the client sees it (WAITING, COMMITTED,
  STREAMING, DONE, ABORTED), a transition table guarded by ``_transition``;
* ``attempt.py``: the current upstream attempt (connecting, answered, a late
  error, the backoff before a retry);
* ``client_socket.py``: can the client's socket take bytes now (writable,
  writing, paused, gone), and the times the client-side timers run from;
* ``recording.py``: resume — numbering, recording for the replay store, and
  the hold that keeps a departed client's stream for a reconnect;
* ``accounting.py``: the counters and the record each response ends with;
* ``pending.py``: what waits for the socket, and how it merges (the OpenAI
  chunk format itself is ``chunks.py``'s).

The decisions that tie them together live in ``decisions.py`` (the shared
steps: commit, fail, end, retry, the slow-reader cut, the hold for a
reconnect), ``upstream_inputs.py`` (what the upstream side's inputs do) and
this module (the public API, the client side's inputs, the input table):
what each input does in each lifecycle state, when to commit, retry, fail, end, cut off a slow
reader, or hold for a reconnect (a client that left within the grace, or a
drain's ``HandOff``: the client closed so that it reconnects to another
replica, the upstream read into the shared store meanwhile). Once DONE or ABORTED has nothing left to
write, the core emits ``CloseClient`` and ``Finished`` with the accounting
record, exactly once per response.

Flow control: bytes go out only when the socket is writable; meanwhile events
wait in a :class:`PendingBuffer`, which merges text deltas (``coalesce``),
replaces stale state (``drop``) or pauses the upstream (``block``). A stall
longer than ``write_deadline_s`` or a buffer over ``max_pending_bytes`` means
the client is treated as gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .accounting import GAP_BUCKETS_S
from .decisions import HEARTBEAT
from .errors import (
    ErrorCode,
    LocalError,
    LocalProtocolError,
    WireError,
    shutting_down,
)
from .events import (
    Action,
    ClientGone,
    CloseClient,
    HandOff,
    Input,
    ReaderAttached,
    Rejected,
    ReplaySource,
    ResumeUpstream,
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
from .lifecycle import ENDED as _ENDED
from .lifecycle import TRANSITIONS, StreamState, Trigger
from .meter import TokenMeter
from .record import EndReason
from .upstream_inputs import UpstreamInputs

__all__ = ["GAP_BUCKETS_S", "HEARTBEAT", "TRANSITIONS", "StreamState", "WireStream"]

# Final: compiled, a final module name is a C static, not a lookup in the module's dict.
W: Final = StreamState.WAITING
_NO_DEADLINE: Final = float("inf")


class WireStream(UpstreamInputs):
    """The wire core for one response. See the module docstring; the
    constructor's arguments are :class:`StreamDecisions`'s."""


    # ------------------------------------------------------------ public API

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def finished(self) -> bool:
        """True once ``Finished`` was emitted: nothing more will happen."""
        return self._finished

    def departure_aborts_upstream(self) -> bool:
        """What ``handle(ClientGone())`` would do to the upstream now, without
        doing it: True when it would end the response with ``AbortUpstream``
        (False when the stream is held for a reconnect, already over, or has
        no upstream open). Reads the state only.

        For a driver that closes the upstream's socket the moment a client
        leaves and hands the core that ``ClientGone`` later, stamped with the
        time the client left and ahead of any other input: the state is then
        the one this answer read, so the core's actions start with the abort
        the driver already began. When many clients leave at once, every
        upstream is so closed before any of their bookkeeping runs."""
        return not self._finished and self._attempt.open and self._departure_ends()

    @property
    def pending_bytes(self) -> int:
        return self._pending.pending_bytes

    @property
    def backpressured(self) -> bool:
        """True while the client is not keeping up (events are queueing)."""
        client = self._client
        return client.paused or (client.write_in_flight and bool(self._pending))

    @property
    def upstream(self) -> str:
        """What the stream's record names as its source (see the constructor)."""
        return self._upstream

    @property
    def end_reason(self) -> EndReason | None:
        return self._end_reason

    @property
    def error_code(self) -> ErrorCode | None:
        """The code the stream ended with (None while it runs or if it completed)."""
        return self._error_code

    @property
    def error(self) -> WireError | None:
        """The error the stream ended with, as tokenwire put it on the wire (its
        code, message and HTTP status), or the engine's own error event; None
        while it runs, if it completed, or if it ended without one (a departed
        or slow client: ``error_code`` still says why). For a driver that maps
        an ending to its own protocol (the gRPC gateway's status)."""
        return self._error

    def handle(self, event: Input, now: float) -> list[Action]:
        """Feed one input; return the actions to execute, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not a wire core input: {event!r}")
        if self._finished:
            client = self._client
            if isinstance(event, WriteCompleted) and client.write_in_flight:
                client.write_in_flight = False
            return []
        self._deadline_bound = None
        handler(self, event, now)
        self._fire_timers(now)
        if self._hold.hand_off is not None:
            self._try_hand_off(now)
        resume = self._resume
        if resume.recording:
            resume.flush()
        self._maybe_finish(now)
        actions, self._actions = self._actions, []
        return actions

    def data_to_send(self, now: float) -> bytes:
        """Bytes to write now, or ``b""``. After writing non-empty bytes, the
        driver must ``handle(WriteCompleted())`` once the socket took them."""
        client = self._client
        if (self._finished or client.paused or client.write_in_flight or not self._pending
                or self._state is W or client.gone):
            return b""
        window_s = self._coalesce_s
        if (window_s and self._state not in _ENDED and client.pending_since is not None
                and now < client.pending_since + window_s):
            return b""
        data, events = self._pending.take()
        self._deadline_bound = None
        client.started_write(now)
        acct = self._acct
        acct.bytes_out += len(data)
        if events:
            acct.content_written(events, now)
        return data

    def forward_read(self, data: bytes, now: float) -> bytes | None:
        """The keeps-up path, in one call, for a driver whose socket writes
        complete at once (the sidecar: ``transport.write`` takes the bytes or
        calls ``pause_writing`` before it returns).

        ``data`` is one upstream read. When the client keeps up (nothing
        pending, no write outstanding, not paused), no timer is due and the
        read is nothing but plain ``data:`` events (the check of the fast
        branch of ``UpstreamData``), returns the bytes to write now, already
        counted as written: exactly what ``handle(UpstreamData(data))``,
        ``data_to_send`` and ``handle(WriteCompleted())`` would have done,
        which would have returned no actions. Otherwise returns None and
        changes nothing: the driver then takes the usual way with
        ``UpstreamData``. The test of the read and its bookkeeping are those of
        ``_on_upstream_data``'s fast branch (:meth:`_plain_count`,
        :meth:`_took_plain`): one rule, two ways in.
        """
        client = self._client
        attempt = self._attempt
        if (client.gone or attempt.paused or attempt.retry_at is not None or attempt.passthrough
                or self._finished or not self._one_call_path or len(data) > self._max_pending_bytes):
            return None
        # next_deadline() only moves later on this path (it sets the times the
        # heartbeat and idle timers run from to ``now``), so the value computed
        # after the last input is a lower bound until the next one: one float
        # comparison per read instead of walking every timer. A bound already
        # passed takes the usual way, whose input recomputes it.
        due_at = self._deadline_bound
        if due_at is None:
            deadline = self.next_deadline()
            due_at = self._deadline_bound = _NO_DEADLINE if deadline is None else deadline
        if now >= due_at:
            return None
        count = self._plain_count(data)
        if not count:
            return None
        self._took_plain(data, count, now)
        acct = self._acct
        size = len(data)
        if size > acct.pending_high_water_bytes:
            acct.pending_high_water_bytes = size
        client.wrote_at_once(now)
        acct.bytes_out += size
        acct.content_written(count, now)
        return data

    @property
    def meter(self) -> TokenMeter:
        """Time to first token and inter-token gaps (``meter.py``); drivers read it live."""
        return self._acct.meter

    # ------------------------------------------------------------ client and driver inputs

    def _on_paused(self, event: SocketPaused, now: float) -> None:
        self._client.pause()

    def _on_resumed(self, event: SocketResumed, now: float) -> None:
        self._client.resume(now)

    def _on_write_completed(self, event: WriteCompleted, now: float) -> None:
        self._client.completed_write(now)
        attempt = self._attempt
        if attempt.paused and not self._pending and self._state not in _ENDED:
            attempt.paused = False
            attempt.seen_at = now  # its silence while paused was ours
            self._acct.upstream_resumed(now)
            self._actions.append(ResumeUpstream())

    def _on_client_gone(self, event: ClientGone, now: float) -> None:
        if self._hold.until is not None:
            return  # already held for a reconnect (e.g. the reset of a slow client we cut)
        self._client.left()
        self._pending.clear()
        if self._hold_for_resume(now, EndReason.CLIENT_GONE, ErrorCode.CANCELLED):
            return
        if self._departure_ends():
            self._end(EndReason.CLIENT_GONE, ErrorCode.CANCELLED, abrupt=True,
                      trigger=Trigger.ABORT, delivery_cut=True)

    def _departure_ends(self) -> bool:
        """A departure now ends the response: not held for a reconnect, and
        not over already (a complete answer the client did not get all of is
        still lost)."""
        if self._hold.until is not None or self._may_hold():
            return False
        return self._state is StreamState.DONE or self._state not in _ENDED

    def _on_stop(self, event: StopRequested, now: float) -> None:
        if self._state in _ENDED:
            return
        if event.reason is EndReason.SHUTDOWN:
            error: LocalError = shutting_down()
        else:
            error = LocalError("the stream was cancelled by its caller or an operator", ErrorCode.CANCELLED,
                               http_status=503)
        self._fail(error, event.reason, now)

    def _on_rejected(self, event: Rejected, now: float) -> None:
        # The driver stopped its source itself: no abort goes anywhere.
        self._attempt.open = False
        if self._state not in _ENDED:
            self._fail(event.error, EndReason.REFUSED, now)

    def _on_replay_source(self, event: ReplaySource, now: float) -> None:
        if not self.config.resume:
            raise LocalProtocolError("ReplaySource needs config.resume")
        if self._state is not W or self._attempt.status is not None:
            raise LocalProtocolError("ReplaySource must come before the upstream's headers")
        self._resume.become_reader(event.stream_id, event.after_seq)
        # A replay arrives in batches, not because the reader is slow: merging
        # would renumber what the client asked for event by event. The store
        # can simply be read more slowly instead (block policy).
        self._pending.merge = False
        self._pending.drop = False

    def _on_hand_off(self, event: HandOff, now: float) -> None:
        hold = self._hold
        if self._state in _ENDED or hold.until is not None or hold.hand_off is not None:
            return  # over, held for a reconnect already (its client left), or asked already
        if self._resumable_here():
            hold.hand_off = event.until
            # Done at once where the client holds an id (handle() calls _try_hand_off).

    def _resumable_here(self) -> bool:
        """The client could come back for the rest of this stream from the store:
        the stream records every event (not past its cap), or replays one."""
        resume = self._resume
        return (resume.recording or resume.reader) and not self._attempt.passthrough

    def _try_hand_off(self, now: float) -> None:
        """HANDING OFF → HELD, once the client was written a numbered event
        (nothing waits for its socket: what was numbered went out) and so can
        come back with ``Last-Event-ID``; before that (headers not out, the
        first token not come, a socket that is behind) it waits, and the drain's
        end applies if that comes first. ``CloseClient(abrupt)``: the bytes
        written reach the client, then the body ends without its terminator or
        terminal event, which is what makes a client reconnect."""
        hold = self._hold
        until = hold.hand_off
        assert until is not None
        if self._state in _ENDED or hold.until is not None or not self._resumable_here():
            hold.hand_off = None  # the stream ended, its client left, or it passed its cap
            return
        client = self._client
        resume = self._resume
        if self._state is W or resume.seq < 1 or self._pending or client.write_in_flight:
            return
        hold.hand_off = None
        if resume.reader:
            # A replay generates nothing: its client reads the store elsewhere.
            self._end(EndReason.SHUTDOWN, ErrorCode.SHUTDOWN, abrupt=True, trigger=Trigger.ABORT)
            return
        client.left()
        self._actions.append(hold.hold(resume.resume_id, now, max(until - now, 0.0),
                                       EndReason.SHUTDOWN, ErrorCode.SHUTDOWN))
        self._actions.append(CloseClient(abrupt=True))

    def _on_reader_attached(self, event: ReaderAttached, now: float) -> None:
        self._hold.attach()

    def _on_tick(self, event: Tick, now: float) -> None:
        pass  # timers fire after every input; see _fire_timers


# Input type -> the method that handles it. The class's functions, not a
# stream's bound methods: a table of bound methods kept on the stream was a
# reference cycle (stream -> table -> method -> stream), so every finished
# stream's objects waited for the cyclic collector instead of being freed at once.
_HANDLERS: Final[dict[type, Callable[[WireStream, Any, float], None]]] = {
    UpstreamHeaders: WireStream._on_upstream_headers,
    UpstreamData: WireStream._on_upstream_data,
    UpstreamEvent: WireStream._on_upstream_event,
    UpstreamEnded: WireStream._on_upstream_ended,
    UpstreamFailed: WireStream._on_upstream_failed,
    SocketPaused: WireStream._on_paused,
    SocketResumed: WireStream._on_resumed,
    WriteCompleted: WireStream._on_write_completed,
    ClientGone: WireStream._on_client_gone,
    StopRequested: WireStream._on_stop,
    Rejected: WireStream._on_rejected,
    ReplaySource: WireStream._on_replay_source,
    ReaderAttached: WireStream._on_reader_attached,
    HandOff: WireStream._on_hand_off,
    Tick: WireStream._on_tick,
}
