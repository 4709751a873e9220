"""One log line per finished stream: the wire core's accounting record, through ``logging``.

The line is a record of the ``tokenwire.streams`` logger at INFO, with the
record's fields (request id, stream id, upstream, status, end reason, error
code and number, bytes, tokens, TTFT, duration...) beside the standard ones
(``ts``, ``level``, ``logger``, ``msg``; see ``tokenwire.middleware.process.logs``).
With ``log_file = "-"`` it goes where every other log line goes (stderr, in
the process's ``log_format``); with a file name, to that file, always as JSON
lines; with ``""``, nowhere.
"""

from __future__ import annotations

import itertools
import logging

from tokenwire.middleware import StreamRecord
from tokenwire.middleware.process.logs import JsonFormatter

STREAMS_LOGGER = "tokenwire.streams"
_file_loggers = itertools.count()


class StreamLog:
    """Writes each :class:`StreamRecord` as one log line. ``logger=None`` discards records."""

    def __init__(self, logger: logging.Logger | None) -> None:
        self._logger = logger
        self._handler: logging.Handler | None = None

    @classmethod
    def open(cls, log_file: str) -> StreamLog:
        """``-`` is the process's log (stderr; stdout carries the ready line), empty is
        nowhere, else append JSON lines to a file."""
        if log_file == "":
            return cls(None)
        if log_file == "-":
            return cls(logging.getLogger(STREAMS_LOGGER))
        # A logger of its own, so this file gets the records and nothing else.
        logger = logging.getLogger(f"{STREAMS_LOGGER}.file{next(_file_loggers)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = logging.FileHandler(log_file, encoding="utf-8")
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
        log = cls(logger)
        log._handler = handler
        return log

    @property
    def enabled(self) -> bool:
        """Whether :meth:`write` writes anything (else a caller can skip building its fields)."""
        if type(self).write is not StreamLog.write:
            return True  # a subclass that keeps the records its own way
        logger = self._logger
        return logger is not None and logger.isEnabledFor(logging.INFO)

    def write(self, record: StreamRecord, **extra: object) -> None:
        """Log ``record`` (which carries the request id) plus any ``extra`` fields."""
        logger = self._logger
        if logger is None or not logger.isEnabledFor(logging.INFO):
            return
        fields = record.to_json()
        fields.update(extra)
        # A closed or full log must never take a stream down with it: logging's
        # handlers report their own errors (handleError) instead of raising.
        logger.info("stream ended", extra={"fields": fields})

    def close(self) -> None:
        if self._handler is not None and self._logger is not None:
            self._logger.removeHandler(self._handler)
            self._handler.close()
        self._handler = None
        self._logger = None
