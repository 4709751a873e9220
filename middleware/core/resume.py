"""Resume requests: stream ids, ``Last-Event-ID`` and ``Idempotency-Key``.

Theory of operation
-------------------
With ``WireConfig.resume`` every event of a stream carries ``id: <stream>.<seq>``
(numbered by the wire core, see ``stream.py``) and is kept in a replay store.
A request can then ask for a stream that already exists in three ways, and
this module tells a driver which one it is, before any upstream is called:

* ``GET /v1/streams/{stream}`` (what an ``EventSource`` opens, and what it
  re-opens by itself with ``Last-Event-ID`` after a drop): :class:`ResumeFrom`;
* a re-sent ``POST`` carrying ``Last-Event-ID``: :class:`ResumeFrom`;
* a ``POST`` carrying ``Idempotency-Key``: :class:`Idempotent` — the first such
  request generates, any later one with the same key and body replays.

And one way to stop it: ``DELETE /v1/streams/{stream}``, or the Responses
API's ``POST .../responses/{id}/cancel`` for a stream the engine named ``id``
(:class:`CancelStream`); the drivers stop the stream's writer, so its upstream
is aborted at once, even inside the resume grace, and its readers end with
the in-band ``cancelled`` error.

Streams belong to their caller. A stream is opened with its *owner*, a keyed
hash (:class:`CallerKey`) of the request's ``Authorization`` header (or of
``resume_owner_header``); the store keeps only that hash. A reconnect is served
only to a request whose owner is the same (:func:`same_caller`) and otherwise
gets the very 404 an unknown stream gets; an idempotency key counts only
within its owner's keys (:func:`scoped_key`), so another caller's key neither
replays nor answers 422. Requests without the header share one owner: for
them, as before, the stream id alone is the key to an answer. The drivers
apply this through :func:`~tokenwire.middleware.shared.driver.enter_resume`.

Malformed input is a :class:`~tokenwire.middleware.core.errors.ClientError` with a
stable code, raised here and put on the wire by the core (``Rejected``).
Nothing here does I/O; the stores are in ``middleware/shared/replay_store.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from .config import WireConfig
from .errors import ClientError, ErrorCode, LocalError
from .headers import header_value

STREAMS_PATH = "/v1/streams/"
"""Path prefix of the reconnect endpoint: ``GET /v1/streams/{stream}``."""

_ID_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_MAX_KEY_CHARS = 255

Header = tuple[bytes, bytes]


def new_stream_id() -> str:
    """A fresh, unguessable stream id (the id is the only key to an answer)."""
    return secrets.token_urlsafe(16)


def _valid_stream_id(text: str) -> bool:
    return 0 < len(text) <= 64 and set(text) <= _ID_ALPHABET


def parse_event_id(value: str) -> tuple[str, int]:
    """``<stream>.<seq>`` as (stream, seq); a ClientError if it is not one of ours."""
    stream_id, dot, seq_text = value.strip().rpartition(".")
    if not dot or not _valid_stream_id(stream_id) or not seq_text.isdigit() or len(seq_text) > 12:
        raise ClientError(f"Last-Event-ID {value[:80]!r} is not an event id of this server "
                          "(expected <stream>.<seq>)", ErrorCode.INVALID_LAST_EVENT_ID)
    return stream_id, int(seq_text)


def body_digest(body: bytes) -> str:
    """What an idempotency key is bound to: the request body's SHA-256."""
    return hashlib.sha256(body).hexdigest()


def stream_not_found(stream_id: str) -> ClientError:
    """The one error for a stream that never existed, expired, or was evicted."""
    return ClientError(f"stream {stream_id[:64]!r} is unknown or expired",
                       ErrorCode.STREAM_NOT_FOUND, http_status=404)


def key_reused() -> ClientError:
    return ClientError("Idempotency-Key was already used with a different request body",
                       ErrorCode.IDEMPOTENCY_KEY_REUSED, http_status=422)


@dataclass(frozen=True, slots=True)
class CallerKey:
    """Tells callers apart for stream ownership: an HMAC-SHA-256 of one header.

    The secret is ``resume_owner_secret``, or random per process when that is
    empty (enough for one process; replicas sharing a Redis store must be
    given the same secret, or a reconnect on another replica finds no stream).
    """

    header: bytes
    """Lower-case request header that identifies the caller (``authorization``)."""
    secret: bytes = field(repr=False)

    @classmethod
    def from_config(cls, config: WireConfig) -> CallerKey:
        secret = config.resume_owner_secret.encode() or secrets.token_bytes(32)
        return cls(config.resume_owner_header.lower().encode("latin-1"), secret)

    def owner(self, headers: Iterable[Header]) -> str:
        """The owner hash of a request (one value for every request without the header)."""
        value = header_value(headers, self.header)
        message = b"-" if value is None else b"+" + value.strip()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def same_caller(stored_owner: str | None, owner: str) -> bool:
    """True if a stream opened by ``stored_owner`` may be served to ``owner``
    (None: no such stream). Constant time, so timing tells nothing either."""
    return stored_owner is not None and hmac.compare_digest(stored_owner.encode(), owner.encode())


def scoped_key(owner: str, key: str) -> str:
    """An idempotency key as the store holds it: within its owner's keys only."""
    return hashlib.sha256(f"{owner}\n{key}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ResumeFrom:
    """Send stream ``stream_id`` from event ``after_seq + 1`` on (0 = from the start)."""

    stream_id: str
    after_seq: int


@dataclass(frozen=True, slots=True)
class Idempotent:
    """A POST with an idempotency key: generate once, replay on repeats."""

    key: str
    digest: str


@dataclass(frozen=True, slots=True)
class ResumeAlias:
    """``GET .../responses/{alias}?stream=true[&starting_after=N]``: the Responses
    API's resume form (OpenAI's and vLLM's), for the stream the engine named
    ``alias``; ``after_seq`` is the stored event after which it resumes (the
    event whose ``sequence_number`` is N is stored as N + 1)."""

    alias: str
    after_seq: int


@dataclass(frozen=True, slots=True)
class CancelStream:
    """Stop stream ``stream_id`` (``DELETE /v1/streams/{stream}``), or the stream
    the engine named ``alias`` (``POST .../responses/{alias}/cancel``; the
    stream id is then found in the store)."""

    stream_id: str = ""
    alias: str = ""


def _responses_cancel(path: str) -> CancelStream | None:
    """The Responses cancel form (OpenAI's and vLLM's), or None."""
    _, sep, tail = path.rpartition("/responses/")
    alias, slash, verb = tail.partition("/")
    if not sep or not alias or not slash or verb != "cancel":
        return None
    return CancelStream(alias=alias)


def _responses_resume(path: str, query: str) -> ResumeAlias | None:
    """The Responses resume form, or None for any other request (a plain
    retrieve without ``stream=true`` is the engine's)."""
    _, sep, alias = path.rpartition("/responses/")
    if not sep or not alias or "/" in alias:
        return None
    fields = parse_qs(query, keep_blank_values=True)
    if fields.get("stream", [""])[-1].lower() != "true":
        return None
    after = fields.get("starting_after", [""])[-1]
    if after and not (after.isascii() and after.isdigit() and len(after) <= 12):
        raise ClientError(f"starting_after must be a sequence number, got {after[:40]!r}",
                          ErrorCode.BAD_REQUEST)
    return ResumeAlias(alias, int(after) + 1 if after else 0)


def classify(method: str, path: str, headers: Iterable[Header], body: bytes,
             query: str = "") -> ResumeFrom | ResumeAlias | Idempotent | CancelStream | None:
    """Which kind of resume request this is; None for an ordinary request.

    ``path`` is the request target without its query, ``query`` the query.
    Raises ClientError for a malformed ``Last-Event-ID``/``Idempotency-Key``,
    stream path or ``starting_after``.
    """
    headers = list(headers)
    last_event = header_value(headers, b"last-event-id")
    if path.startswith(STREAMS_PATH):
        if method not in ("GET", "HEAD", "DELETE"):
            raise ClientError(f"{STREAMS_PATH}{{stream}} takes GET (resume) or DELETE (cancel)",
                              ErrorCode.BAD_REQUEST, http_status=405)
        stream_id = path[len(STREAMS_PATH):]
        if not _valid_stream_id(stream_id):
            raise stream_not_found(stream_id)
        if method == "DELETE":
            return CancelStream(stream_id)
        if last_event is None or not last_event.strip():
            return ResumeFrom(stream_id, 0)
        named, seq = parse_event_id(last_event.decode("latin-1"))
        if named != stream_id:
            raise ClientError("Last-Event-ID names another stream than the path",
                              ErrorCode.INVALID_LAST_EVENT_ID)
        return ResumeFrom(stream_id, seq)
    if method not in ("POST", "GET"):
        return None
    if last_event is not None and last_event.strip():
        # A reconnect: a POST client's, or a browser EventSource's own on a GET
        # stream. Never generated again: resumed, or refused (an unknown id).
        return ResumeFrom(*parse_event_id(last_event.decode("latin-1")))
    if method == "GET":
        return _responses_resume(path, query)
    cancel = _responses_cancel(path)
    if cancel is not None:
        return cancel
    key = header_value(headers, b"idempotency-key")
    if key is None:
        return None
    text = key.decode("latin-1").strip()
    if not 0 < len(text) <= _MAX_KEY_CHARS or not text.isprintable():
        raise ClientError(f"Idempotency-Key must be 1..{_MAX_KEY_CHARS} printable characters",
                          ErrorCode.BAD_REQUEST)
    return Idempotent(text, body_digest(body))


def stream_elsewhere(stream_id: str) -> ClientError:
    """A cancel of a live stream this process is not writing: its writer, on
    another replica sharing the store, is the only one that can stop it."""
    return ClientError(f"stream {stream_id[:64]!r} is being written by another process sharing the "
                       "replay store; it cannot be stopped from here", ErrorCode.STREAM_ELSEWHERE,
                       http_status=409)


def replay_unavailable(stream_id: str) -> LocalError:
    """The reader got all the store kept, and the stream went on past it."""
    return LocalError(f"the rest of stream {stream_id[:64]!r} was not kept (resume_max_bytes or "
                      "resume_total_bytes); it cannot be replayed", ErrorCode.RESUME_UNAVAILABLE,
                      http_status=410)


def replay_gap(stream_id: str, seq: int) -> LocalError:
    """The store has events of the stream after ``seq - 1`` but not event ``seq``:
    a resume that went on would skip what was lost (a Redis outage, a restart
    that lost its last writes), so it stops there, saying so."""
    return LocalError(f"event {seq} of stream {stream_id[:64]!r} and maybe more were lost by the replay "
                      "store (an outage); the stream cannot be replayed past them", ErrorCode.REPLAY_GAP,
                      http_status=410)


def writer_gone(stream_id: str) -> LocalError:
    """The process writing the stream died before its end was stored (its lease
    in the store lapsed): what it stored was served, the rest will never come.
    410 before any event, as the other replay errors: resuming again cannot help,
    the request sent again can (an idempotent repeat then generates afresh)."""
    return LocalError(f"the process writing stream {stream_id[:64]!r} is gone; what it stored was sent, "
                      "the rest was never made", ErrorCode.WRITER_GONE, http_status=410)


def store_unavailable() -> LocalError:
    """The replay store is down: a reconnect or an idempotent repeat cannot be
    served (and must not be generated again), so the client retries later."""
    return LocalError("the replay store is unavailable; retry shortly", ErrorCode.RESUME_UNAVAILABLE,
                      http_status=503, retry_after_s=1)
