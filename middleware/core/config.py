"""Wire configuration: one frozen dataclass, passed in, units in the names.

Both drivers (the ASGI middleware and the sidecar) take a :class:`WireConfig`.
The sidecar builds it from flags, ``TOKENWIRE_*`` environment variables and a
TOML file (see ``tokenwire.sidecar.settings``); the middleware takes it as a
constructor argument. Validation happens here, once, so a bad value names its
key whichever way it came in.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .client_settings import parse_bounds
from .dialects.routes import AUTO_MARKER, DEFAULT_ROUTES, parse_route


class SlowClientPolicy(StrEnum):
    """What to do with upstream events while the client cannot take them."""

    COALESCE = "coalesce"
    """Merge consecutive text deltas; abort the client past ``max_pending_bytes``."""
    DROP = "drop"
    """Keep only the newest pending event of each event type (refreshable state)."""
    BLOCK = "block"
    """Stop reading the upstream (TCP backpressure reaches the engine)."""


class NonStreamAnswer(StrEnum):
    """What a streaming request answered with a 2xx body that is not an event stream gets."""

    AUTO = "auto"
    """``reject`` on the routes of a known dialect (an OpenAI or Anthropic client
    would read an empty answer and raise nothing), ``pass`` on generic ones."""
    PASS = "pass"
    """Passed through as it came (recorded ``not_event_stream``)."""
    REJECT = "reject"
    """Answered with 502 and an error naming the content type and the upstream."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.reason = message


@dataclass(frozen=True, slots=True)
class WireConfig:
    """Everything the wire core decides with.

    The defaults suit the ASGI middleware and any generic SSE app: no retries
    (a middleware cannot re-run its app's request) and no terminal marker (an
    in-process app ends its stream by ending its response). A proxy in front
    of an OpenAI-compatible engine changes both; the sidecar's own defaults
    live in ``tokenwire.sidecar.settings.SIDECAR_WIRE_DEFAULTS``. The rules
    each key drives: docs/architecture.md#wire-rules."""

    heartbeat_s: float = 15.0
    """Downstream silence after which ``: keepalive`` is written (0 = never)."""
    commit_deadline_s: float = 2.0
    """Headers are held until the first upstream event or this long."""
    write_deadline_s: float = 30.0
    """Pending data that makes no progress this long means the client is gone."""
    upstream_headers_timeout_s: float = 300.0
    """An upstream that has not sent its status line by then has failed."""
    upstream_tail_grace_s: float = 5.0
    """After a complete answer the upstream usually ends its body at once (and its
    connection is reused); one that keeps the body open is cut after this long."""
    close_flush_timeout_s: float = 30.0
    """A body cut after an in-band error still gets its last bytes out; a client
    that stopped reading is reset after this long."""
    upstream_idle_timeout_s: float = 0.0
    """After its headers, an upstream that sends no byte for this long has hung: the
    stream ends with ``upstream_timeout`` and the upstream is aborted (0 = never, the
    middleware's default: an app's stream may rightly be quiet for long; the
    sidecar's is 300 s, Envoy's stream idle timeout). Not counted while the core
    paused it."""
    max_stream_duration_s: float = 0.0
    """A stream still running this long after its request is ended with
    ``upstream_timeout`` and its upstream aborted (0 = no limit)."""
    max_pending_bytes: int = 1 << 20
    """Cap on bytes held for one slow client."""
    slow_client_policy: SlowClientPolicy = SlowClientPolicy.COALESCE
    """What waits for a slow reader: ``coalesce`` merges text and tool-call deltas,
    ``drop`` also replaces queued events of the ``droppable_event_types``,
    ``block`` merges nothing and stops reading the upstream once
    ``block_window_bytes`` wait, so the engine itself is made to wait."""
    block_window_bytes: int = 32 * 1024
    """Under ``block``: the bytes a slow reader may have waiting before the upstream
    is no longer read (TCP then holds the engine's send, the ASGI app's ``send``
    waits; half of ``max_pending_bytes`` where that is smaller: what one read adds
    must fit under the cap); the time it was held is the
    record's ``producer_wait_s``."""
    droppable_event_types: tuple[str, ...] = ()
    """SSE ``event:`` types whose queued event a newer one of the same type may
    replace under ``drop`` (refreshable state such as progress; never answer text)."""
    volatile_chunk_fields: tuple[str, ...] = ("obfuscation",)
    """Top-level OpenAI chunk fields that carry no content (padding, per-chunk
    timestamps or sequence numbers): they do not block a merge, and a merged
    chunk keeps the newest value."""
    non_event_stream_answer: NonStreamAnswer = NonStreamAnswer.AUTO
    """A streaming request answered 2xx with a body that is not ``text/event-stream``:
    ``reject`` (502 naming the content type), ``pass`` (as it came), or ``auto``
    (reject on the Chat Completions, Completions, Responses and Messages routes)."""
    coalesce_ms: float = 0.0
    """Optional fixed batching window for writes (0 = latency first)."""
    retry_attempts: int = 0
    """Upstream retries per stream, only before the first downstream byte (the sidecar: 2)."""
    retry_backoff_s: float = 0.1
    """First retry delay; doubles each attempt."""
    retry_backoff_max_s: float = 2.0
    """Upper bound of the doubling retry delay."""
    retry_after_max_s: float = 10.0
    """A retried 502/503/504's ``Retry-After`` (seconds) is waited before the next
    attempt, when longer than the backoff; one asking for more than this is not
    retried: the answer goes to the client, ``Retry-After`` and all (0 = the header
    is ignored)."""
    retry_budget_ratio: float = 0.2
    """Retries allowed as a fraction of recent requests (an Envoy-style budget)."""
    retry_budget_min_per_s: float = 3.0
    """Retries always allowed per second, whatever the ratio says."""
    terminal_marker: str | None = AUTO_MARKER
    """The ``data:`` that ends a complete stream on the routes whose dialect ends with a
    marker (Chat Completions, Completions, generic). ``auto``: each dialect's own
    (``[DONE]`` for Chat Completions and Completions; none for a generic stream); empty
    (``''``; None in Python): none, the upstream's clean end of body is complete; any
    other value: that marker. Responses and Anthropic streams end with their own events."""
    dialect_routes: tuple[str, ...] = DEFAULT_ROUTES
    """``PATTERN=DIALECT`` routes, first match wins: which dialect a request path speaks
    (chat.completions, completions, responses, anthropic.messages, generic); a path no
    route matches is generic (its events pass exactly). Patterns are shell-style
    (``*`` matches ``/`` too) against the path without its query."""
    socket_send_buffer_bytes: int = 16 * 1024
    """Drivers cap SO_SNDBUF so backpressure is seen before the kernel swallows it
    (Linux doubles the value): what sits in kernel buffers is text a slow reader
    has not read and the core can no longer merge or drop. 16 KiB still carries
    a 100 tokens/s answer over a 200 ms round trip (the figures:
    docs/perf/slow-readers.md)."""
    write_high_water_bytes: int = 8 * 1024
    """Transport write buffer at which the driver reports ``SocketPaused``."""
    max_line_bytes: int = 1 << 20
    """SSE parser: the longest line accepted from the upstream."""
    max_event_bytes: int = 4 << 20
    """SSE parser: the largest event accepted from the upstream."""
    resume: bool = False
    """Number every event (``id: <stream>.<seq>``) and keep it in a replay store, so a
    client can reconnect with ``Last-Event-ID`` or re-send its ``Idempotency-Key``."""
    resume_ttl_s: float = 300.0
    """How long a stream stays resumable after its last event."""
    resume_max_bytes: int = 8 << 20
    """Replay store cap per stream; a longer answer is resumable only up to here
    (an 8,000-token answer of OpenAI chunks is about 2.2 MB)."""
    resume_total_bytes: int = 256 << 20
    """Replay store cap in total (memory store; the oldest streams go first)."""
    resume_grace_s: float = 0.0
    """A disconnect keeps the upstream running this long for a reconnect (0 = abort at once)."""
    resume_retry_ms: int = 1000
    """The ``retry:`` sent in the first frame: how soon an EventSource reconnects."""
    resume_owner_header: str = "authorization"
    """A resume or idempotent repeat is served only to a request with the same value of
    this header as the original (kept as a keyed hash, never as it came)."""
    resume_owner_secret: str = dataclasses.field(default="", repr=False)
    """Key of that hash; empty = random per process. Replicas that share a Redis
    store must share it."""
    client_settings: tuple[str, ...] = ("heartbeat_s=1..60", "write_deadline_s=5..120",
                                        "keep_generating_s=0..600")
    """What a request may choose by a ``Tokenwire-…`` header, and within what:
    ``NAME=LOW..HIGH`` for ``heartbeat_s``, ``write_deadline_s`` and
    ``keep_generating_s`` (the resume grace, ``Tokenwire-Keep-Generating``),
    ``slow_client_policy=A|B`` for the policies; a name not listed may not be asked
    for (empty = none). docs/architecture.md#client-settings."""

    def __post_init__(self) -> None:
        _check_non_negative(self, "heartbeat_s", "commit_deadline_s", "coalesce_ms",
                            "retry_backoff_s", "retry_backoff_max_s", "retry_after_max_s",
                            "retry_budget_ratio", "retry_budget_min_per_s", "resume_grace_s",
                            "upstream_idle_timeout_s", "max_stream_duration_s")
        _check_positive(self, "write_deadline_s", "upstream_headers_timeout_s", "upstream_tail_grace_s",
                        "close_flush_timeout_s",
                        "max_pending_bytes", "block_window_bytes", "socket_send_buffer_bytes",
                        "write_high_water_bytes", "max_line_bytes", "max_event_bytes",
                        "resume_ttl_s", "resume_max_bytes", "resume_total_bytes", "resume_retry_ms")
        if not isinstance(self.resume, bool):
            raise ConfigError("resume", f"must be true or false, got {self.resume!r}")
        if not isinstance(self.retry_attempts, int) or self.retry_attempts < 0:
            raise ConfigError("retry_attempts", f"must be a whole number >= 0, got {self.retry_attempts!r}")
        if not isinstance(self.non_event_stream_answer, NonStreamAnswer):
            try:
                answer = NonStreamAnswer(self.non_event_stream_answer)
            except ValueError:
                choices = ", ".join(a.value for a in NonStreamAnswer)
                raise ConfigError("non_event_stream_answer",
                                  f"must be one of {choices}, got {self.non_event_stream_answer!r}") from None
            object.__setattr__(self, "non_event_stream_answer", answer)
        if not isinstance(self.slow_client_policy, SlowClientPolicy):
            try:
                policy = SlowClientPolicy(self.slow_client_policy)
            except ValueError:
                choices = ", ".join(p.value for p in SlowClientPolicy)
                raise ConfigError(
                    "slow_client_policy", f"must be one of {choices}, got {self.slow_client_policy!r}"
                ) from None
            object.__setattr__(self, "slow_client_policy", policy)
        for key in ("droppable_event_types", "volatile_chunk_fields"):
            names = getattr(self, key)
            if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(key, f"must be a list of non-empty names, got {names!r}")
            object.__setattr__(self, key, tuple(names))
        if self.terminal_marker == "":
            object.__setattr__(self, "terminal_marker", None)
        routes = self.dialect_routes
        if isinstance(routes, str) or not all(isinstance(r, str) for r in routes):
            raise ConfigError("dialect_routes", f"must be a list of PATTERN=DIALECT, got {routes!r}")
        for route in routes:
            try:
                parse_route(route)
            except ValueError as error:
                raise ConfigError("dialect_routes", str(error)) from None
        object.__setattr__(self, "dialect_routes", tuple(routes))
        if not self.resume_owner_header or not self.resume_owner_header.isascii():
            raise ConfigError("resume_owner_header", "must be a non-empty ASCII header name")
        if self.max_line_bytes > self.max_event_bytes:
            raise ConfigError("max_line_bytes", "must not exceed max_event_bytes")
        settings = self.client_settings
        if isinstance(settings, str) or not all(isinstance(s, str) for s in settings):
            raise ConfigError("client_settings", f"must be a list of NAME=LOW..HIGH, got {settings!r}")
        try:
            parse_bounds(tuple(settings))
        except ValueError as error:
            raise ConfigError("client_settings", str(error)) from None
        object.__setattr__(self, "client_settings", tuple(settings))

    def replace(self, **changes: object) -> WireConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_non_negative(config: WireConfig, *keys: str) -> None:
    for key in keys:
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(key, f"must be a number >= 0, got {value!r}")  # NaN fails >= too


def _check_positive(config: WireConfig, *keys: str) -> None:
    for key in keys:
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(key, f"must be a number > 0, got {value!r}")


# ---------------------------------------------------------------- config files
# Shared by the sidecar's and the engine's loaders (flag > env > file > default).


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass, by field name (for ``--help``
    and the commented TOML files); empty if the source is not available."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def parse_bool(key: str, text: str) -> bool:
    """A boolean flag or variable as people write them (1/true/yes/on, 0/false/no/off
    or empty); anything else is a ConfigError naming ``key``."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(key, f"must be true or false, got {text!r}")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's table; an unreadable or malformed file is a ConfigError naming ``config``."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError("config", f"{path}: {error}") from None


class LayeredKey(Protocol):
    """A configuration key as the loaders see it: its name and its variable."""

    @property
    def name(self) -> str: ...

    @property
    def env(self) -> str: ...


KeyT = TypeVar("KeyT", bound=LayeredKey)


def merge_layers(
    keys: Mapping[str, KeyT],
    *,
    from_text: Callable[[KeyT, str], object],
    from_toml: Callable[[KeyT, object], object],
    flags: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_path: str | None = None,
) -> dict[str, object]:
    """The values set in any layer, flag > environment > file (defaults stay
    the dataclass's). Unknown file keys and flags are errors naming the key
    (and ``file_path``, the file the values came from); unknown variables are
    ignored (a newer deployment may set keys this version lacks)."""
    values: dict[str, object] = {}
    in_file = f"in {file_path}" if file_path else "in the config file"
    for name, value in (file_values or {}).items():
        if name not in keys:
            suggestion = _did_you_mean(name, keys)
            raise ConfigError(name, f"unknown configuration key {in_file}{suggestion}")
        values[name] = _read(from_toml, keys[name], value, in_file)
    for key in keys.values():
        text = (environ or {}).get(key.env)
        if text is not None:
            values[key.name] = _read(from_text, key, text, f"from {key.env}={text!r}")
    for name, text in (flags or {}).items():
        if name not in keys:
            raise ConfigError(name, "unknown configuration key" + _did_you_mean(name, keys))
        values[name] = _read(from_text, keys[name], text, f"from --{name.replace('_', '-')}")
    return values


def _read(convert: Callable[[KeyT, Any], object], key: KeyT, value: Any, source: str) -> object:
    """``convert(key, value)``, its error saying which layer the bad value came from."""
    try:
        return convert(key, value)
    except ConfigError as error:
        raise ConfigError(error.key, f"{error.reason} ({source})") from None


def _did_you_mean(name: str, keys: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(keys), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
