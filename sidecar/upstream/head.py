"""HTTP/1.1 heads to and from an upstream pod: the request head written, the response head read.

Theory of operation
-------------------
The sidecar's upstream requests are all alike: a method and target a client's
request already had (checked by h11 on the way in), headers the sidecar
assembled from checked ones (:mod:`~tokenwire.sidecar.exchange.forwarding`), a body
read whole, framed by a ``Content-Length``. :func:`request_head` writes such
a request in one bytes object, after the checks h11 would make of it (the
method a token, the target visible characters, every header field by h11's
rules through :func:`~tokenwire.sidecar.downstream.h11_layout.fields_valid`, one
``Host``, a ``Content-Length`` that is the body's length).

:func:`parse_response_head` reads a response head by h11's rules as a client
reads one (``h11/_readers.py``, ``_abnf.py``, ``_headers.py``): lines end in
LF or CRLF; the status line is ``HTTP/d.d SP 3DIGIT [SP reason]``; a header
line is a token, a colon, optional whitespace, a field value with no NUL, CR,
LF, VT or FF, optional whitespace; an obsolete line fold joins its line to the
one before with a space; ``Content-Length`` is digits (at most 20), repeated
or comma-listed only with one value, and ``Transfer-Encoding`` is once, and
``chunked``; a 101 is refused (the sidecar never asks for an upgrade). Names
come back lower-cased, the two framing headers' values as h11 normalises
them. Anything else raises ``RemoteProtocolFault`` where the same head
read by h11 would raise its ``RemoteProtocolError`` (a property test holds the verdicts and the parsed
heads to h11's own). What the head says about the body
(:attr:`ResponseHead.framing`, RFC 9112 section 6.3) and the connection
(:attr:`ResponseHead.keep_alive`) is worked out here once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from ..downstream.h11_layout import fields_valid, is_token, is_visible
from .errors import LocalProtocolFault, RemoteProtocolFault

Header = tuple[bytes, bytes]

Framing = str | int | None
"""How a response body is delimited: ``"none"``, ``"chunked"``, a
``Content-Length``, or None (until the upstream closes the connection)."""

NO_BODY: Final = "none"
CHUNKED: Final = "chunked"

# h11/_abnf.py's status line: HTTP-version SP status-code [SP reason-phrase],
# reason-phrase = *( HTAB / SP / VCHAR / obs-text ), which h11 spells "not NUL
# and not whitespace, or space or tab": anything but NUL, LF, CR, VT and FF.
_STATUS_LINE: Final = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: [^\x00\n\r\x0b\x0c]*)?")
# Where a head ends: a line feed, an optional CR, a line feed (h11's rule).
_BLANK_LINE: Final = re.compile(rb"\n\r?\n")
_CONTENT_LENGTH: Final = re.compile(rb"[0-9]+")
_CONTENT_LENGTH_MAX_DIGITS: Final = 20  # h11's bound
_OWS: Final = b" \t"


class ResponseHead:
    """A response head read from the upstream (a 1xx one, or the final one)."""

    __slots__ = ("framing", "headers", "http_version", "keep_alive", "status")

    def __init__(self, status: int, http_version: bytes, headers: tuple[Header, ...],
                 framing: Framing, keep_alive: bool) -> None:
        self.status = status
        self.http_version = http_version
        self.headers = headers
        """Every field in order, the name lower-cased."""
        self.framing = framing
        self.keep_alive = keep_alive
        """The connection may carry another request once this body is read."""


def request_head(method: bytes, target: bytes, host: bytes, headers: Sequence[Header],
                 body: bytes) -> bytes:
    """The request's head followed by its body, in one bytes object.

    ``Host`` goes first (``host`` unless ``headers`` hold one), then
    ``headers`` in order, then a ``Content-Length`` unless they hold one.
    Raises ``LocalProtocolFault`` for what h11 would refuse to send.
    """
    if not is_token(method):
        raise LocalProtocolFault(f"illegal method {method!r}")
    if not is_visible(target):
        raise LocalProtocolFault(f"illegal request target {target!r}")
    if not fields_valid(headers):
        raise LocalProtocolFault("illegal header name or value")
    hosts = 0
    length: bytes | None = None
    for name, value in headers:
        # Only names of these lengths can be one of the three (a lower() a header otherwise).
        size = len(name)
        if size not in (4, 14, 17):
            continue
        lowered = name.lower()
        if lowered == b"host":
            hosts += 1
        elif lowered == b"content-length":
            if length is not None and value != length:
                raise LocalProtocolFault("conflicting Content-Length headers")
            length = value
        elif lowered == b"transfer-encoding":
            # The body is sent whole: only a Content-Length frames it.
            raise LocalProtocolFault("a request body is sent with its Content-Length")
    if hosts > 1:
        raise LocalProtocolFault("Found multiple Host: headers")
    if length is not None and length != b"%d" % len(body):
        raise LocalProtocolFault(f"Content-Length {length!r} is not the body's {len(body)} bytes")
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    if not hosts:
        parts += (b"Host: ", host, b"\r\n")
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if length is None:
        parts.append(b"Content-Length: %d\r\n" % len(body))
    parts.append(b"\r\n")
    if body:
        parts.append(body)
    return b"".join(parts)


def head_end(data: bytes, start: int = 0) -> int:
    """Where the head in ``data`` ends (just past its blank line), or -1. A
    blank line first is itself an end, as h11 takes it (and then finds no
    status line). ``start``: where to look from (more of a head came: where
    the last look ended, less 2)."""
    if data[:1] == b"\n":
        return 1
    if data[:2] == b"\r\n":
        return 2
    match = _BLANK_LINE.search(data, start)
    return -1 if match is None else match.end()


def parse_response_head(head: bytes, method: bytes) -> ResponseHead:
    """The response head ``head`` (through its blank line; see :func:`head_end`)
    to a ``method`` request. Raises ``RemoteProtocolFault``."""
    lines = head.split(b"\n")
    del lines[-2:]  # the blank line: "...\n\n" or "...\n\r\n" (the CR stripped below)
    if not lines:
        raise RemoteProtocolFault("no response line received")
    status_line = lines[0]
    if status_line[-1:] == b"\r":
        status_line = status_line[:-1]
    match = _STATUS_LINE.fullmatch(status_line)
    if match is None:
        raise RemoteProtocolFault(f"illegal status line: {status_line!r}")
    http_version = match.group(1)
    status = int(match.group(2))
    raw = [line[:-1] if line[-1:] == b"\r" else line for line in lines[1:]]
    if any(line[:1] in (b" ", b"\t") for line in raw):
        raw = _unfold(raw)
    headers: list[Header] = []
    for line in raw:
        name, colon, value = line.partition(b":")
        if not colon:
            raise RemoteProtocolFault(f"illegal header line: {line!r}")
        headers.append((name, value.strip(_OWS)))
    if not fields_valid(headers):
        # Which line: the error names it, as h11's does.
        for line, (name, value) in zip(raw, headers, strict=True):
            if not fields_valid([(name, value)]):
                raise RemoteProtocolFault(f"illegal header line: {line!r}")
    return _framed(status, http_version, headers, method)


def _unfold(lines: list[bytes]) -> list[bytes]:
    """An obsolete line fold: the continuation joins the line before it with
    one space (its own leading whitespace dropped), as h11 reads it."""
    out: list[bytes] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            if not out:
                raise RemoteProtocolFault("continuation line at start of headers")
            out[-1] += b" " + line.lstrip(_OWS)
        else:
            out.append(line)
    return out


def _framed(status: int, http_version: bytes, fields: list[Header], method: bytes) -> ResponseHead:
    """The head with names lower-cased, the framing headers checked and
    normalised as h11 does, and what they say about the body and connection."""
    headers: list[Header] = []
    length: bytes | None = None
    chunked = False
    close = http_version < b"1.1"
    for name, value in fields:
        name = name.lower()
        if name == b"content-length":
            values = {part.strip(_OWS) for part in value.split(b",")}
            if len(values) != 1:
                raise RemoteProtocolFault("conflicting Content-Length headers")
            value = values.pop()
            if (_CONTENT_LENGTH.fullmatch(value) is None
                    or len(value) > _CONTENT_LENGTH_MAX_DIGITS):
                raise RemoteProtocolFault("bad Content-Length")
            if length is None:
                length = value
            elif length != value:
                raise RemoteProtocolFault("conflicting Content-Length headers")
            else:
                continue  # h11 keeps the first of equal ones
        elif name == b"transfer-encoding":
            if chunked:
                raise RemoteProtocolFault("multiple Transfer-Encoding headers")
            value = value.lower()
            if value != b"chunked":
                raise RemoteProtocolFault("Only Transfer-Encoding: chunked is supported")
            chunked = True
        elif name == b"connection" and not close:
            close = any(token.strip(_OWS).lower() == b"close" for token in value.split(b","))
        headers.append((name, value))
    if status < 100:
        raise RemoteProtocolFault(f"illegal status code {status}")
    if status == 101:
        # The sidecar never asks for an upgrade (Upgrade is hop-by-hop): h11 refuses one too.
        raise RemoteProtocolFault("a 101 answer to a request that asked for no upgrade")
    framing: Framing
    if method == b"HEAD" or status < 200 or status in (204, 304):
        framing = NO_BODY
    elif chunked:
        framing = CHUNKED
    elif length is not None:
        framing = int(length)
    else:
        framing = None  # until the upstream closes: never kept alive
    keep_alive = not close and framing is not None
    return ResponseHead(status, http_version, tuple(headers), framing, keep_alive)
