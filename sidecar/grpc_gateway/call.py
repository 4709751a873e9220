"""One call's response side: the wire core's output as gRPC.

:class:`ResponseTranscoder` sits where the exchange writes to its client (the
``Downstream`` calls): the response head, the SSE bytes the wire core produced,
the end. It turns each into what an HTTP/2 stream sends for gRPC and decides
nothing the core has not decided already:

* a 200 event-stream head becomes the initial metadata (the stream id, the
  request id); an error status becomes a trailers-only response whose status
  follows the HTTP status (the engine's 400 → ``INVALID_ARGUMENT``);
* each SSE data event becomes one length-prefixed message (comments, i.e.
  heartbeats, and the ``[DONE]`` marker become nothing; HTTP/2 keeps the
  connection alive); half a surrogate pair split across chunks waits in the
  call's :class:`~.transcode.TextCarry` for its other half;
* a clean end (the core saw the engine finish) becomes ``grpc-status: 0``;
  for a call that asked (``tokenwire-summary: true`` metadata) the core's
  ``event: tokenwire.summary`` is no message: its figures ride on those
  trailers (:func:`summary_trailers`: ``tokenwire-ttft-s``,
  ``tokenwire-tokens``, ...);
  any other end carries the core's typed ending (:class:`CoreEnding`: the
  :class:`~tokenwire.middleware.core.errors.WireError` it ended with, or only its
  code, as for a slow client it cut), mapped by
  :func:`~tokenwire.middleware.core.errors.grpc_status_of`: a truncated answer
  never ends with 0. The in-band error event the core wrote last is that
  ending, so it becomes the trailers, not a message. Nothing the core wrote
  is parsed back for its meaning; only an engine's error body that the core
  passed through unchanged is (see :meth:`ResponseTranscoder.on_end`).

The client's ``grpc-timeout`` is a :class:`Deadline`: when it passes, the
driver stops the stream through the core (so the upstream is aborted as for a
cancel) and the call ends ``DEADLINE_EXCEEDED``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from tokenwire.middleware.core.errors import (
    ErrorCode,
    GrpcStatus,
    UpstreamErrorEvent,
    WireError,
    grpc_status_of,
)
from tokenwire.middleware.core.headers import STREAM_ID_HEADER
from tokenwire.middleware.core.record import EndReason
from tokenwire.middleware.core.sse import SSEParser

from .framing import encode_message, parse_timeout, valid_text
from .metadata import GRPC_CONTENT_TYPE, OK, CallStatus, Header
from .routing import StreamMethod
from .transcode import TextCarry

_DONE = "[DONE]"
# A line feed as an int, the needle of a memchr (why: middleware/core/sse.py, _LF).
_LF: Final = 0x0A
SUMMARY_EVENT = "tokenwire.summary"
"""The core's named event with a stream's figures (``Tokenwire-Summary: true``)."""
SUMMARY_KEYS = ("ttft_s", "tokens", "tokens_source", "tokens_per_s", "duration_s", "events_out",
                "coalesced_events", "retries")
"""The summary's fields, each a trailer ``tokenwire-`` + the key with dashes."""


def summary_trailers(text: str) -> list[Header]:
    """The trailers for a ``tokenwire.summary`` event's data: one per figure it
    has (``tokenwire-ttft-s: 0.0123``), none for a null one (no first token)."""
    try:
        body = json.loads(text)
    except ValueError:
        return []
    if not isinstance(body, dict):
        return []
    out: list[Header] = []
    for key in SUMMARY_KEYS:
        value = body.get(key)
        if value is None or isinstance(value, (dict, list)):
            continue
        name = b"tokenwire-" + key.replace("_", "-").encode()
        out.append((name, str(value).encode("ascii", "replace")))
    return out


class CoreEnding(Protocol):
    """How the wire core says its stream ended: the ``WireStream`` properties
    the transcoder maps (a ``WireStream`` is one)."""

    @property
    def end_reason(self) -> EndReason | None: ...

    @property
    def error_code(self) -> ErrorCode | None: ...

    @property
    def error(self) -> WireError | None: ...


# What a call that ended with a code but no error object says, by the core's
# end reason: a slow client it cut (nothing could reach it), or an engine's
# failure reported in the dialect's own terminal event (``response.failed``).
_WHY = {
    EndReason.SLOW_CLIENT: "the client did not read the answer in time",
    EndReason.UPSTREAM_ERROR: "the engine reported a failure",
}


@dataclass(frozen=True, slots=True)
class Deadline:
    """The client's ``grpc-timeout``, as a loop time."""

    at: float

    @classmethod
    def from_headers(cls, headers: Sequence[Header], now: float) -> Deadline | None:
        """The deadline a request's ``grpc-timeout`` sets, or None without one."""
        for name, value in headers:
            if name == b"grpc-timeout":
                return cls(now + parse_timeout(value))
        return None

    def passed(self, now: float) -> bool:
        return now >= self.at


def _code_of(name: str | None) -> ErrorCode | None:
    if name is None:
        return None
    try:
        return ErrorCode(name)
    except ValueError:
        return None


def _forwarded_code(error: WireError) -> ErrorCode:
    """The code an error ends a call with. An error event the core forwarded
    (``upstream_failed`` to the core) that carries a tokenwire code of its own
    keeps that code: it is another tokenwire's, behind us, or this one's,
    replayed from the store (a resumed stream that was cancelled by id ends
    ``CANCELLED``, as its first reader did), as an error answer's is kept
    (:func:`passthrough_status`)."""
    if isinstance(error, UpstreamErrorEvent):
        body = error.payload.get("error")
        ours = body.get("tokenwire") if isinstance(body, dict) else None
        name = ours.get("code") if isinstance(ours, dict) else None
        code = _code_of(name if isinstance(name, str) else None)
        if code is not None:
            return code
    return error.code


def _typed_status(error: WireError, http_status: int | None) -> CallStatus:
    """The call status for the error the core ended with; ``http_status``: the
    status it went out with before the first message (None after: in-band, only
    the code counts)."""
    code = _forwarded_code(error)
    # valid_text: an engine's message may hold a lone ``\udXXX`` escape.
    return CallStatus(grpc_status_of(code, http_status), valid_text(error.message), code)


def passthrough_status(text: str, http_status: int) -> CallStatus:
    """The call status for an engine's error answer that the core passed through
    unchanged (a non-event-stream 4xx/5xx body).

    This is the one error body the gateway parses, because nothing types it:
    the core forwards it byte for byte and ends the stream complete, with no
    error and no code (it is the engine's answer, not tokenwire's). Its
    ``error.message`` is the engine's own word on what went wrong, the best
    message there is; a ``"tokenwire"`` code in it is another tokenwire's,
    behind us, and is kept."""
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    message = ""
    name: str | None = None
    number: str | None = None
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        ours = error.get("tokenwire")
        if isinstance(ours, dict):
            name = ours.get("code") if isinstance(ours.get("code"), str) else None
            number = ours.get("number") if isinstance(ours.get("number"), str) else None
    elif error is not None:
        message = str(error)
    if not message:
        message = " ".join(text.split())[:200]
    message = valid_text(message)  # a lone ``\udXXX`` escape in the engine's message
    code = _code_of(name)
    status = grpc_status_of(code, http_status)
    if name is None:
        # The engine's own error answer, forwarded as it came: it failed the request.
        code = ErrorCode.UPSTREAM_FAILED
    return CallStatus(status, message, code if code is not None else name, number)


@dataclass(frozen=True, slots=True)
class Ending:
    """How to end the HTTP/2 stream: trailers, or (nothing sent yet) a trailers-only response."""

    headers: list[Header]
    trailers_only: bool
    status: CallStatus
    data: bytes = b""
    """A last message to send before the trailers (an answer that was not a stream)."""
    extra: tuple[Header, ...] = ()
    """Trailers after the status's own (the summary a call asked for); in ``headers`` too."""


class ResponseTranscoder:
    """The response side of one streaming call. See the module docstring."""

    def __init__(self, method: StreamMethod, *, metadata_headers: Sequence[bytes] = ()) -> None:
        """``metadata_headers``: response header names passed on as initial
        metadata (besides the stream id)."""
        self._method = method
        self._keep = frozenset({STREAM_ID_HEADER, *metadata_headers})
        self._parser = SSEParser()
        self._carry = False  # the parser holds part of an event: it takes all from now on
        self._started = False
        self._error_status: int | None = None
        self._error_body = bytearray()
        self._override: CallStatus | None = None
        self._whole: bytearray | None = None  # a 200 answer that is not an event stream
        self._texts = TextCarry()
        self._summary: list[Header] = []  # the core's tokenwire.summary, as trailers
        self.messages_out = 0

    @property
    def started(self) -> bool:
        """True once the initial metadata went out."""
        return self._started

    def on_headers(self, status: int, headers: Sequence[Header]) -> list[Header] | None:
        """The initial metadata to send now, or None (an error: it ends trailers-only)."""
        if status != 200:
            self._error_status = status
            return None
        self._started = True
        for name, value in headers:
            if name == b"content-type" and not value.lower().startswith(b"text/event-stream"):
                self._whole = bytearray()
        # Identity only: a client then never compresses (a compressed message is UNIMPLEMENTED).
        return [(b"content-type", GRPC_CONTENT_TYPE), (b"grpc-accept-encoding", b"identity"),
                *((name, value) for name, value in headers if name in self._keep)]

    def on_body(self, data: bytes, core: CoreEnding) -> bytes:
        """Length-prefixed messages for SSE bytes from ``core`` (may be ``b""``)."""
        if self._error_status is not None:
            self._error_body += data[:64 * 1024 - len(self._error_body)]
            return b""
        if self._whole is not None:
            self._whole += data
            return b""
        events = self._events(data)
        error = core.error
        if error is not None and events and events[-1][0] == error.sse_data():
            # The core ended with this error: its in-band event is the last thing
            # it writes (nothing is queued after it), so it is this write's last
            # event. It becomes the trailers (on_end), not a message.
            events.pop()
        out: list[bytes] = []
        to_message, texts = self._method.to_message, self._texts
        for payload, event_id, name in events:
            if name == SUMMARY_EVENT:
                # Only a call that asked gets one (the core queues it then): its
                # figures become the trailers, never a chat message.
                self._summary = summary_trailers(payload)
                continue
            if payload == _DONE:
                continue
            out += [encode_message(message.SerializeToString())
                    for message in texts.messages(to_message, payload, event_id)]
        self.messages_out += len(out)
        return b"".join(out)

    def _events(self, data: bytes) -> list[tuple[str, str | None, str | None]]:
        """The data events (payload, id, event name) in the core's output. The core writes
        canonical SSE (LF line ends, ``data:``/``id:``/``retry:`` lines, comment
        lines for heartbeats), whole events per write, so a split on blank
        lines does; anything else (a CR) takes the full parser."""
        if data.find(b"\r") >= 0 or self._carry:  # not ``in``: see chunks.plain_event_count
            return [(e.data, e.id, e.event) for e in self._parser.feed(data)
                    if e.data is not None and e.comment is None]
        blocks = data.split(b"\n\n")
        rest = blocks[-1]
        if rest and rest.endswith(b"\n") and all(line[:1] == b":" for line in rest[:-1].split(b"\n")):
            rest = b""  # heartbeat comment lines (no blank line after them): nothing to send
        if rest:
            # An event cut between two writes: the parser takes it from here on.
            self._carry = True
            self._parser.feed(rest)
        events: list[tuple[str, str | None, str | None]] = []
        for block in blocks[:-1]:
            if block.startswith(b"data: ") and _LF not in block:
                events.append((block[6:].decode("utf-8", "replace"), None, None))
                continue
            lines: list[bytes] = []
            event_id: str | None = None
            name: str | None = None
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    lines.append(line[6:] if line.startswith(b"data: ") else line[5:])
                elif line.startswith(b"id:"):
                    event_id = line[3:].strip().decode("utf-8", "replace")
                elif line.startswith(b"event:"):
                    name = line[6:].strip().decode("utf-8", "replace")
            if lines:
                events.append((b"\n".join(lines).decode("utf-8", "replace"), event_id, name))
        return events

    def deadline_passed(self) -> None:
        """The client's deadline passed; the driver stops the stream through the core."""
        self._override = CallStatus(GrpcStatus.DEADLINE_EXCEEDED, "the call's deadline passed",
                                    ErrorCode.CANCELLED)

    def on_end(self, core: CoreEnding, *, abrupt: bool, reset: bool) -> Ending:
        """The trailers (or trailers-only response) for ``core``'s ``CloseClient``,
        from its typed ending: the error it ended with (a status of its own before
        the first message, in-band after), else the code it ended with (a slow
        client it cut: nothing on the wire says why), else a clean end."""
        error = core.error
        if self._override is not None:
            status = self._override
        elif self._error_status is not None:
            if error is not None:
                # Its own error answer (or the engine's error event that became the
                # status), or an engine's error answer that broke off: the status
                # the answer had decides.
                status = _typed_status(error, self._error_status)
            else:
                status = passthrough_status(self._error_body.decode("utf-8", "replace"),
                                             self._error_status)
        elif error is not None:
            # In-band (or never written: a slow client cut after it): its HTTP
            # status never went out, so only its code counts.
            status = _typed_status(error, None)
        elif (code := core.error_code) is not None:
            reason = core.end_reason
            why = "the answer broke off" if reason is None else _WHY.get(reason, "the answer broke off")
            status = CallStatus(grpc_status_of(code), why, code)
        elif reset:
            # The core has not ended (resume holds the stream for a reconnect, and
            # its code with it; or the driver failed): the client is cut all the same.
            code = ErrorCode.BACKPRESSURE_EXCEEDED
            status = CallStatus(grpc_status_of(code), _WHY[EndReason.SLOW_CLIENT], code)
        elif abrupt:
            status = CallStatus(GrpcStatus.UNAVAILABLE, "the answer broke off", ErrorCode.UPSTREAM_FAILED)
        else:
            status = OK
        last = b""
        if self._whole and status is OK:
            # The engine answered with one JSON object: it is the one message.
            text = self._whole.decode("utf-8", "replace")
            last = encode_message(self._method.to_message(text, None, None).SerializeToString())
            self.messages_out += 1
        elif self._started and (flushed := self._texts.flush()) is not None:
            # Half a surrogate pair that nothing completed: U+FFFD, before the trailers.
            last = encode_message(flushed.SerializeToString())
            self.messages_out += 1
        # The figures the call asked for, on an OK ending only (the core queues
        # them just before a clean end; anything that cut the call after wins).
        extra = tuple(self._summary) if status is OK else ()
        if self._started:
            return Ending([*status.trailers(), *extra], trailers_only=False, status=status, data=last,
                          extra=extra)
        return Ending([*status.trailers_only(), *extra], trailers_only=True, status=status, extra=extra)
