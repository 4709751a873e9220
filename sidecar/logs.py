"""One JSON line per finished stream: the wire core's accounting record."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from tokenwire.middleware import StreamRecord


class StreamLog:
    """Writes each :class:`StreamRecord` as one JSON line to a text stream.

    ``stream=None`` discards records (``log_file = ""``).
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._owned = False

    @classmethod
    def open(cls, log_file: str) -> StreamLog:
        """``-`` is stderr (stdout carries the ready line), empty is nowhere, else append to a file."""
        if log_file == "":
            return cls(None)
        if log_file == "-":
            return cls(sys.stderr)
        log = cls(open(log_file, "a", encoding="utf-8", buffering=1))  # noqa: SIM115 - owned, closed in close()
        log._owned = True
        return log

    def write(self, record: StreamRecord, **extra: object) -> None:
        """Log ``record`` (which carries the request id) plus any ``extra`` fields."""
        if self._stream is None:
            return
        line = record.to_json()
        line.update(extra)
        try:
            self._stream.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            # A closed or full log must never take a stream down with it.
            pass

    def close(self) -> None:
        if self._owned and self._stream is not None:
            self._stream.close()
        self._stream = None
