"""The one log format of every tokenwire program: JSON or text lines through ``logging``."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
from tokenwire.middleware.process.logs import LogFormat, configure_logging, rfc3339

RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name in ("httpcore", "httpx", "hpack", "h2", "h11"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_rfc3339_is_utc_with_microseconds() -> None:
    assert rfc3339(0.0) == "1970-01-01T00:00:00.000000Z"
    assert RFC3339_UTC.match(rfc3339(1_796_075_180.373945))


def test_json_when_fields_given_then_one_object_per_line_with_them(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("info", LogFormat.JSON, out)
    log = logging.getLogger("tokenwire.test")
    log.info("stream ended", extra={"fields": {"request_id": "r-1", "ttft_s": 0.8, "error_number": None}})
    log.debug("not at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    first = json.loads(lines[0])
    assert RFC3339_UTC.match(first.pop("ts"))
    assert first == {"level": "info", "logger": "tokenwire.test", "msg": "stream ended",
                     "request_id": "r-1", "ttft_s": 0.8, "error_number": None}
    second = json.loads(lines[1])  # the traceback stays inside its one line
    assert second["level"] == "error" and "ValueError: boom" in second["exception"]
    assert len(lines) == 2


def test_text_when_fields_given_then_key_values_after_the_message(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("debug", "text", out)
    logging.getLogger("tokenwire.lifecycle").debug("first token", extra={"fields": {
        "request_id": "r-2", "ttft_s": 0.25, "stream_id": None}})
    (line,) = out.getvalue().splitlines()
    stamp, rest = line.split(" ", 1)
    assert RFC3339_UTC.match(stamp)
    assert rest == 'DEBUG tokenwire.lifecycle: first token request_id="r-2" ttft_s=0.25'


def test_configure_when_called_twice_then_one_handler(restore_root: None) -> None:
    configure_logging("warning", LogFormat.TEXT, io.StringIO())
    configure_logging("info", LogFormat.JSON, io.StringIO())
    assert len(logging.getLogger().handlers) == 1
    assert logging.getLogger().level == logging.INFO


def test_configure_when_debug_then_header_logging_libraries_stay_at_info(restore_root: None) -> None:
    """httpcore logs an upstream's response headers (Set-Cookie too) at debug."""
    out = io.StringIO()
    configure_logging("debug", LogFormat.JSON, out)
    logging.getLogger("httpcore.http11").debug("receive_response_headers.complete set-cookie: s=SECRET")
    logging.getLogger("tokenwire.lifecycle").debug("accepted")
    assert "SECRET" not in out.getvalue() and "accepted" in out.getvalue()
