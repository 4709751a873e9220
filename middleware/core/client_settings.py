"""Per-request wire settings: what a client may ask for, inside the operator's bounds.

Theory of operation
-------------------
The wire rules are the operator's (``WireConfig``). A few of them are a
matter of the caller's taste, and different callers of one server want
different ones: a reasoning model's caller wants long silences with few
heartbeats, a chat page short heartbeats; a phone that may lose its network
wants its answer kept generating for a later resume, a page that closes for
good wants it stopped. A request asks with one header family, ``Tokenwire-…``:

=============================  ===============================  ========================
header                         value                            sets
=============================  ===============================  ========================
``Tokenwire-Heartbeat-S``      seconds                          ``heartbeat_s``
``Tokenwire-Write-Deadline-S`` seconds                          ``write_deadline_s``
``Tokenwire-Slow-Client-Policy`` ``coalesce``/``drop``/``block``  ``slow_client_policy``
``Tokenwire-Keep-Generating``  ``true``, ``false`` or seconds   ``resume_grace_s``
=============================  ===============================  ========================

(``Tokenwire-Frames`` and ``Tokenwire-Summary`` ask for tokenwire's own events,
``frames.py``; their values are checked here too.)

``Tokenwire-Keep-Generating: true`` keeps the answer generating after its
client leaves, for the longest the operator allows, so that a later resume
(``GET /v1/streams/{id}``) reads it whole; ``false`` stops it when the client
leaves; a Responses request's ``"background": true`` is ``true`` (the drivers
read it). Each setting is accepted only inside ``WireConfig.client_settings``,
the operator's list of ``NAME=LOW..HIGH`` (numbers) and
``slow_client_policy=A|B`` (choices); a setting not listed may not be asked
for. A refused value, an unknown ``Tokenwire-`` header or a value that does
not parse is a :class:`~tokenwire.middleware.core.errors.ClientError` (400)
before anything goes upstream, naming the header and the bound; the headers
read here are not sent upstream. What was applied goes in the stream's log
line (``client_settings``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .errors import ClientError, ErrorCode
from .frames import FRAMES_HEADER, check_frames
from .headers import SUMMARY_HEADER, Header

if TYPE_CHECKING:
    from .config import WireConfig

PREFIX: Final = b"tokenwire-"
"""The header family (lower-case, as the drivers hand headers over)."""

KEEP_GENERATING: Final = "keep_generating_s"
"""The bound's name for ``Tokenwire-Keep-Generating`` (it sets ``resume_grace_s``)."""

_KEEP_HEADER: Final = b"tokenwire-keep-generating"
# header -> the setting's name in client_settings; the WireConfig key it sets.
_HEADERS: Final[dict[bytes, tuple[str, str]]] = {
    b"tokenwire-heartbeat-s": ("heartbeat_s", "heartbeat_s"),
    b"tokenwire-write-deadline-s": ("write_deadline_s", "write_deadline_s"),
    b"tokenwire-slow-client-policy": ("slow_client_policy", "slow_client_policy"),
    _KEEP_HEADER: (KEEP_GENERATING, "resume_grace_s"),
}
_NUMERIC: Final = frozenset({"heartbeat_s", "write_deadline_s", KEEP_GENERATING})
_POLICIES: Final = ("coalesce", "drop", "block")
_OTHER_HEADERS: Final = frozenset({SUMMARY_HEADER})
"""Headers of the family that are not settings (the summary event's): passed on."""
HEADERS: Final[tuple[bytes, ...]] = tuple(_HEADERS)
"""The settings' header names (what a CORS preflight must allow)."""


@dataclass(frozen=True, slots=True)
class Bound:
    """What one setting may be: a range of seconds, or a set of choices."""

    name: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        return "|".join(self.choices) if self.choices else f"{self.low:g}..{self.high:g}"


@functools.lru_cache(maxsize=16)
def parse_bounds(specs: tuple[str, ...]) -> dict[str, Bound]:
    """``client_settings`` as bounds by name; a ValueError saying which entry is wrong.
    Cached: a process has a config or two, and each request that asks reads them
    (and ``WireConfig.replace`` validates them again). The dict is not to be changed."""
    bounds: dict[str, Bound] = {}
    for spec in specs:
        name, sep, allowed = spec.partition("=")
        name = name.strip()
        if not sep or (name not in _NUMERIC and name != "slow_client_policy"):
            raise ValueError(f"{spec!r}: expected NAME=LOW..HIGH or slow_client_policy=A|B, NAME one of "
                             f"{', '.join(sorted([*_NUMERIC, 'slow_client_policy']))}")
        if name == "slow_client_policy":
            choices = tuple(choice.strip() for choice in allowed.split("|"))
            if not all(choice in _POLICIES for choice in choices):
                raise ValueError(f"{spec!r}: policies are {', '.join(_POLICIES)}")
            bounds[name] = Bound(name, choices=choices)
            continue
        low_text, dots, high_text = allowed.partition("..")
        try:
            low, high = float(low_text), float(high_text)
        except ValueError:
            raise ValueError(f"{spec!r}: expected {name}=LOW..HIGH in seconds") from None
        if not dots or not (math.isfinite(low) and math.isfinite(high)) or not 0 <= low <= high:
            raise ValueError(f"{spec!r}: expected 0 <= LOW <= HIGH")
        bounds[name] = Bound(name, low, high)
    return bounds


def _background(body: bytes) -> bool:
    """Whether a Responses request body says ``"background": true``."""
    try:
        request = json.loads(body)
    except ValueError:
        return False  # the engine's to refuse
    return isinstance(request, dict) and request.get("background") is True


def for_request(config: WireConfig, headers: Sequence[Header], body: bytes | None,
                dialect: str) -> tuple[WireConfig, str, Sequence[Header], ClientError | None]:
    """What a driver asks of every request: its config, what its settings changed
    (empty: none), its headers for the upstream, and the refusal to answer with
    (None: none). ``body``: the request body where the driver has it (a
    Responses ``"background": true`` is read from it); None where it does not
    (the middleware: the app reads its body). Costs a scan of the header names
    for a request that asks nothing."""
    background = dialect == "responses" and body is not None and b'"background"' in body
    if not background and not asks(headers):
        return config, "", headers, None
    try:
        chosen, applied, kept = apply(config, headers, background=background and _background(body or b""))
    except ClientError as error:
        return config, "", headers, error
    return chosen, applied, kept, None


def asks(headers: Sequence[Header]) -> bool:
    """Whether a request carries any setting of the family (the cheap test the
    drivers make on every request before :func:`apply`)."""
    return any(_is_setting(name) for name, _ in headers)


def _is_setting(name: bytes) -> bool:
    return name.startswith(PREFIX) and name not in _OTHER_HEADERS


def apply(config: WireConfig, headers: Sequence[Header], *,
          background: bool = False) -> tuple[WireConfig, str, list[Header]]:
    """The request's config, what it applied (``heartbeat_s=5,...``; empty: nothing)
    and the headers without the settings (for the upstream).

    ``background``: the request is a Responses ``"background": true`` one
    (keep generating, as ``Tokenwire-Keep-Generating: true``, where resume is
    on; it is the engine's own business otherwise). Raises ClientError (400)."""
    bounds = parse_bounds(config.client_settings)
    changes: dict[str, object] = {}
    applied: list[str] = []
    kept: list[Header] = []
    asked: list[tuple[bytes, str]] = []
    for name, value in headers:
        if not _is_setting(name) or name == FRAMES_HEADER:
            refusal = check_frames(value) if name == FRAMES_HEADER else None
            if refusal is not None:
                raise refusal
            kept.append((name, value))  # passed on, like the summary's header
            continue
        if name not in _HEADERS:
            known = ", ".join(sorted(header.decode() for header in (*_HEADERS, *_OTHER_HEADERS,
                                                                    FRAMES_HEADER)))
            raise ClientError(f"unknown header {name.decode('latin-1')[:64]!r}: the Tokenwire- headers "
                              f"are {known}", ErrorCode.BAD_REQUEST)
        asked.append((name, value.decode("latin-1").strip()))
    keep_bound = bounds.get(KEEP_GENERATING)
    if (background and config.resume and keep_bound is not None and keep_bound.high > 0
            and not any(name == _KEEP_HEADER for name, _ in asked)):
        # Implied, never refused: where the operator allows no keep-generating,
        # the request is served as any other (the engine sees its field).
        asked.append((_KEEP_HEADER, "true"))
    for header, text in asked:
        setting, key = _HEADERS[header]
        bound = bounds.get(setting)
        label = header.decode()
        if setting == KEEP_GENERATING and not config.resume:
            if text.lower() == "false":
                continue  # nothing is kept anyway: asking for that is no mistake
            raise ClientError(f"{label}: this server keeps no answers for a resume (resume is off)",
                              ErrorCode.BAD_REQUEST)
        chosen = _value(label, setting, text, bound)
        changes[key] = chosen
        applied.append(f"{setting}={chosen}")
    try:
        return config.replace(**changes), ",".join(applied), kept
    except ValueError as error:  # a combination the config refuses (a ConfigError)
        raise ClientError(f"the Tokenwire- settings asked for are refused: {error}",
                          ErrorCode.BAD_REQUEST) from None


def _value(label: str, setting: str, text: str, bound: Bound | None) -> object:
    if setting == KEEP_GENERATING and text.lower() in ("true", "false"):
        if text.lower() == "false":
            return 0.0
        if bound is None or bound.high <= 0:
            raise ClientError(f"{label}: this server does not keep answers generating for a caller that "
                              "left (client_settings allows no keep_generating_s)", ErrorCode.BAD_REQUEST)
        return bound.high
    if bound is None:
        raise ClientError(f"{label}: not a setting this server lets a request choose "
                          "(client_settings)", ErrorCode.BAD_REQUEST)
    if bound.choices:
        if text not in bound.choices:
            raise ClientError(f"{label}: {text[:40]!r} is not allowed here (one of {bound.describe()})",
                              ErrorCode.BAD_REQUEST)
        return text
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not bound.low <= seconds <= bound.high:  # a NaN fails this too
        raise ClientError(f"{label}: {text[:40]!r} is outside what this server allows "
                          f"({bound.describe()} seconds)", ErrorCode.BAD_REQUEST)
    return seconds
