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

The ASGI middleware runs in a program it does not own: uvicorn, hypercorn and
granian configure their own loggers, never the root one, so a record of
``tokenwire.middleware`` would reach no handler. :func:`install_default_handler`
gives such a logger a :class:`DefaultHandler` (this format, on stderr) only
when nothing would handle its records, and that handler stands aside as soon
as the program configures logging itself (no line twice). Where the program's
own handlers write the line with a formatter that knows nothing of ``fields``
(``logging.basicConfig``'s ``%(message)s``), :class:`FieldsInMessage` puts
them in the message too: ``stream ended request_id="..." status=200 ...``.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
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


def wall_clock(loop_time_s: float, now_loop_s: float) -> str:
    """A reading of the event loop's clock (the core's ``now``) as RFC 3339 UTC."""
    return rfc3339(time.time() - (now_loop_s - loop_time_s))


@functools.lru_cache(maxsize=4)
def _second(whole_s: int) -> str:
    # Every line of one second shares this part: formatting a date costs more than the line.
    return datetime.fromtimestamp(whole_s, UTC).strftime("%Y-%m-%dT%H:%M:%S")


class FieldsMessage:
    """A log message with its fields: ``str()`` is ``text key=value ...``, for a
    formatter that shows only the message; tokenwire's formatters write ``text``
    as ``msg`` and the fields beside it (:func:`fields_of`)."""

    __slots__ = ("fields", "text")

    def __init__(self, text: str, fields: dict[str, Any]) -> None:
        self.text = text
        self.fields = fields

    def __str__(self) -> str:
        pairs = key_values(self.fields)
        return f"{self.text} {pairs}" if pairs else self.text


def key_values(fields: dict[str, Any]) -> str:
    """``key=value ...`` (values as JSON; None left out): the text format's fields."""
    return " ".join(f"{key}={json.dumps(value, ensure_ascii=False, default=str)}"
                    for key, value in fields.items() if value is not None)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The standard fields of a line, then the caller's ``extra={"fields": ...}``."""
    message = record.msg
    text = message.text if isinstance(message, FieldsMessage) else record.getMessage()
    out: dict[str, Any] = {"ts": rfc3339(record.created), "level": record.levelname.lower(),
                           "logger": record.name, "msg": text}
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
        pairs = key_values(out)
        line = f"{head} {pairs}" if pairs else head
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def formatter(log_format: LogFormat | str) -> logging.Formatter:
    """``json``: :class:`JsonFormatter`; ``text``: :class:`TextFormatter`."""
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


class FieldsInMessage(logging.Filter):
    """A logger's filter: a record with ``extra={"fields": ...}`` and a plain
    message gets a :class:`FieldsMessage`, so any formatter shows the fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and isinstance(record.msg, str) and not record.args:
            record.msg = FieldsMessage(record.msg, fields)
        return True


def handled_elsewhere(logger: logging.Logger, besides: logging.Handler | None = None) -> bool:
    """Whether a record of ``logger`` reaches a handler other than ``besides``
    (the program configured logging for it: on the logger, an ancestor, the root)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(handler is not besides for handler in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


class DefaultHandler(logging.Handler):
    """The handler :func:`install_default_handler` gives a logger: one line per
    record on ``stream`` (stderr as it is at each line, when None), and none
    while another handler in the logger's chain writes the record."""

    def __init__(self, logger: logging.Logger, log_format: LogFormat | str,
                 stream: TextIO | None = None) -> None:
        super().__init__()
        self.logger = logger
        self.stream = stream
        self.setFormatter(formatter(log_format))

    def emit(self, record: logging.LogRecord) -> None:
        if handled_elsewhere(self.logger, self):
            return  # the program configured logging after this handler was installed
        try:
            line = self.format(record)
            stream = self.stream if self.stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def install_default_handler(logger: logging.Logger, log_format: LogFormat | str,
                            stream: TextIO | None = None) -> DefaultHandler | None:
    """Give ``logger`` a :class:`DefaultHandler` (and the level INFO, if it has
    none of its own) when nothing would handle its records; returns it, or
    None where logging is configured (or the handler was installed before:
    then its format becomes ``log_format``)."""
    for handler in logger.handlers:
        if isinstance(handler, DefaultHandler):
            handler.setFormatter(formatter(log_format))
            return None
    if handled_elsewhere(logger):
        return None
    handler = DefaultHandler(logger, log_format, stream)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler
