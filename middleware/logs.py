"""One structured logger for every tokenwire program: Python ``logging``, one line per record.

Every line has a wall-clock timestamp (``ts``, RFC 3339, UTC, microseconds),
``level``, ``logger`` and ``msg``; a call adds its own fields with
``extra={"fields": {...}}`` (request id, stream id, status, end reason...),
which :func:`fields_of` and the formatters put beside them. ``json`` writes
one JSON object per line (for a log shipper); ``text`` writes the same fields
as ``key=value`` after the message (for a person at a terminal). Nothing here
knows what a request holds: callers pass only what may be logged, never an
Authorization header, a cookie, a prompt or a completion.

The sidecar and the engine call :func:`configure_logging` once, at start, from
their ``log_level`` and ``log_format`` keys; libraries (uvicorn) log through
the same handler.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TextIO

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class LogFormat(StrEnum):
    """How log lines are written: ``json`` (one object a line) or ``text``."""

    JSON = "json"
    TEXT = "text"


def rfc3339(created_s: float) -> str:
    """``2026-11-30T22:41:05.123456Z`` for a ``time.time()`` reading."""
    whole_s = int(created_s)
    micros = int((created_s - whole_s) * 1e6)
    return f"{_second(whole_s)}.{micros:06d}Z"


@functools.lru_cache(maxsize=4)
def _second(whole_s: int) -> str:
    # Every line of one second shares this part: formatting a date costs more than the line.
    return datetime.fromtimestamp(whole_s, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The standard fields of a line, then the caller's ``extra={"fields": ...}``."""
    out: dict[str, Any] = {"ts": rfc3339(record.created), "level": record.levelname.lower(),
                           "logger": record.name, "msg": record.getMessage()}
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        out.update(extra)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out = fields_of(record)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``: the same fields, for reading."""

    def format(self, record: logging.LogRecord) -> str:
        out = fields_of(record)
        head = f"{out.pop('ts')} {out.pop('level').upper()} {out.pop('logger')}: {out.pop('msg')}"
        pairs = " ".join(f"{key}={json.dumps(value, ensure_ascii=False, default=str)}"
                         for key, value in out.items() if value is not None)
        line = f"{head} {pairs}" if pairs else head
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def formatter(log_format: LogFormat | str) -> logging.Formatter:
    return JsonFormatter() if LogFormat(log_format) is LogFormat.JSON else TextFormatter()


def configure_logging(level: str, log_format: LogFormat | str, stream: TextIO | None = None) -> None:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr),
    formatted as ``log_format``; replaces any handler the root logger had."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # These libraries log raw headers at debug (httpcore an upstream's response
    # headers, Set-Cookie included; hpack every header it decodes): never below info.
    for name in _HEADER_LOGGERS:
        logging.getLogger(name).setLevel(max(root.level, logging.INFO))


_HEADER_LOGGERS = ("httpcore", "httpx", "hpack", "h2", "h11")
