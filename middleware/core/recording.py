"""Resume inside the wire core: numbering, recording, and holding for a reconnect.

Theory of operation
-------------------
With ``config.resume`` every event the response carries is numbered,
``id: <resume id>.<seq>``, and also handed to the driver, without its id, in
``ReplayAppend`` actions for the replay store; the end goes with the last one.
The first numbered event also carries ``retry: <resume_retry_ms>`` and the
headers name the stream. ``id:`` and ``retry:`` ride only on events that carry
data, and a heartbeat is one comment line with no blank line after it: the
decoders of openai-python and httpx-sse dispatch every blank line after an
``id:`` as an event, and an event with empty data crashes their JSON decoding.

:class:`ResumeRecorder` does the numbering and the recording. Its phases::

    OFF (resume off)
    RECORDING ──end of the response──▶ ENDED (the end was recorded)
    RECORDING ──past resume_max_bytes──▶ OVERFLOWED (the store keeps what it has)
    READER: fed ``ReplaySource``; its source is the store, so it numbers on
            from where the client left and records nothing

:class:`ResumeHold` is the grace a departed client gets (``resume_grace_s``)::

    FREE ──the client left mid-stream──▶ HELD(until) ──ReaderAttached──▶ ATTACHED
      │                                     └──until passes, or the response ends──▶ FREE
      └──HandOff(until)──▶ HANDING OFF ──the client holds an id──▶ HELD(until), the client closed

While HELD the upstream keeps running into the store; a reader that attaches
gets the answer completed into the store (end reason ``detached``); if the
grace ends first the stream ends as it would have when the client left. A
hand-off (a drain with a store other replicas share: ``HandOff``) is a hold
the driver asks for: its ``until`` is the drain's end, not the grace's, and
the stream ends then as the drain would have ended it (``shutdown``, in-band,
stored for the readers). It waits (HANDING OFF) until the client has been
written a numbered event, so that it has an id to come back with.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from .config import WireConfig
from .errors import ErrorCode, LocalError
from .events import AwaitReader, ReplayAppend
from .record import EndReason
from .sse import SSEEvent, encode


class RecorderPhase(StrEnum):
    """The recorder's phases; see the module docstring."""

    OFF = "off"
    RECORDING = "recording"
    ENDED = "ended"
    OVERFLOWED = "overflowed"
    READER = "reader"


def _detached(action: ReplayAppend) -> None:
    raise RuntimeError(f"a finished stream's recorder emitted {action!r}")


class ResumeRecorder:
    """Numbers a resumable response's events and records them for the store."""

    __slots__ = ("_emit", "_max_bytes", "_retry_ms", "alias", "committed", "end", "first_seq", "frames",
                 "overflow", "reader", "recorded_bytes", "recording", "resume_id", "retry_due",
                 "seq", "start_seq")

    def __init__(self, config: WireConfig, resume_id: str,
                 emit: Callable[[ReplayAppend], None]) -> None:
        """``emit``: where the ``ReplayAppend`` actions go (the core's action list)."""
        self._emit = emit
        self._max_bytes = config.resume_max_bytes
        self._retry_ms = config.resume_retry_ms
        self.resume_id = resume_id
        self.seq = 0  # the last numbered event
        # The number of the first event this response carries (None: not numbered).
        self.start_seq: int | None = 1 if config.resume else None
        self.retry_due = False  # the next numbered event carries ``retry:``
        self.recording = config.resume
        self.reader = False
        self.recorded_bytes = 0
        self.frames: list[bytes] = []
        self.first_seq = 1  # the number of frames[0]
        self.end: EndReason | None = None
        self.overflow = False
        self.committed = False  # the event stream's headers went out
        self.alias: str | None = None  # another name of the stream, for the next flush

    @property
    def phase(self) -> RecorderPhase:
        if self.reader:
            return RecorderPhase.READER
        if self.overflow:
            return RecorderPhase.OVERFLOWED
        if self.end is not None:
            return RecorderPhase.ENDED
        return RecorderPhase.RECORDING if self.recording else RecorderPhase.OFF

    def become_reader(self, resume_id: str, after_seq: int) -> None:
        """OFF/RECORDING → READER: this response replays ``resume_id`` after ``after_seq``."""
        self.resume_id = resume_id
        self.seq = after_seq
        self.start_seq = after_seq + 1
        self.reader = True
        self.recording = False

    def sse_committed(self) -> None:
        """The event stream's headers are out: the next numbered event says ``retry:``."""
        self.committed = True
        self.retry_due = True

    def number(self, event: SSEEvent) -> SSEEvent:
        """The event as the client gets it: numbered, and recorded bare."""
        self.seq += 1
        if self.recording:
            bare = event if event.id is None else SSEEvent(
                data=event.data, event=event.event, retry=event.retry)
            self.record(encode(bare))
        retry = event.retry
        if self.retry_due:
            self.retry_due = False
            retry = self._retry_ms
        return SSEEvent(data=event.data, event=event.event, retry=retry,
                        id=f"{self.resume_id}.{self.seq}")

    def number_plain(self, data: bytes) -> bytes:
        """Fast-path bytes (whole single-line ``data:`` events) with ids added.
        (The fast path runs only once STREAMING: the first event, which carries
        ``retry:``, has always taken :meth:`number`.)"""
        prefix = b"\nid: " + self.resume_id.encode() + b"."
        out: list[bytes] = []
        for frame in data.split(b"\n\n")[:-1]:
            self.seq += 1
            if self.recording:
                self.record(frame + b"\n\n")
            out.append(frame + prefix + str(self.seq).encode() + b"\n\n")
        return b"".join(out)

    def record(self, frame: bytes) -> None:
        """Keep one frame for the store; past the per-stream cap, the store keeps
        what it has and readers that get that far are told the rest is gone
        (flushed at once, and recording stops)."""
        if self.recorded_bytes + len(frame) > self._max_bytes:
            self.overflow = True
            self.flush()
            self.recording = False
            return
        self.recorded_bytes += len(frame)
        self.frames.append(frame)

    def record_end(self, reason: EndReason) -> None:
        """RECORDING → ENDED: the last flush, with the end. Before the event
        stream was committed nobody saw anything: nothing to resume, and the
        idempotency key is released so a retry generates."""
        committed = self.committed
        if committed and reason in (EndReason.CLIENT_GONE, EndReason.SLOW_CLIENT):
            # What a later reader learns instead of the rest of the answer.
            error = LocalError("the answer was stopped when its client left", ErrorCode.CANCELLED)
            self.seq += 1
            self.record(encode(SSEEvent(data=error.sse_data())))
        self.end = reason
        if not committed:
            self.frames.clear()
        self.flush(discard=not committed)
        self.recording = False

    def detach(self) -> None:
        """Let go of ``emit`` (the stream is finished): it is the stream's own
        method, a reference cycle only the cyclic collector would free."""
        self._emit = _detached

    def flush(self, *, discard: bool = False) -> None:
        """Emit what was recorded since the last flush (and the end, once known)."""
        frames = self.frames
        if not frames and self.end is None and not self.overflow and self.alias is None:
            return
        self._emit(ReplayAppend(self.resume_id, self.first_seq, tuple(frames), end=self.end,
                                overflow=self.overflow, discard=discard, alias=self.alias))
        self.alias = None
        self.first_seq += len(frames)
        self.frames = []


class ResumeHold:
    """The grace a departed client's stream gets. See the module docstring."""

    __slots__ = ("code", "hand_off", "reader_attached", "reason", "until")

    def __init__(self) -> None:
        self.until: float | None = None
        # HANDING OFF: the drain's end, until the client holds an id (None: no hand-off asked).
        self.hand_off: float | None = None
        self.reason = EndReason.CLIENT_GONE  # what the stream ends with if nobody comes back
        self.code = ErrorCode.CANCELLED
        self.reader_attached = False

    def hold(self, resume_id: str, now: float, grace_s: float, reason: EndReason,
             code: ErrorCode) -> AwaitReader:
        """FREE → HELD: the action that tells the driver to wait for a reader."""
        self.until = now + grace_s
        self.reason = reason
        self.code = code
        return AwaitReader(resume_id, self.until)

    def attach(self) -> None:
        """HELD → ATTACHED (a reader that comes after the grace finds nothing held)."""
        if self.until is not None:
            self.until = None
            self.reader_attached = True

    def release(self) -> None:
        """Whatever ended a held stream, its grace is over."""
        self.until = None
