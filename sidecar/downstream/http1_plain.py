"""Plain HTTP/1.1 requests read without h11, and h11 taken on where one is not.

Theory of operation
-------------------
Almost every request an API client sends is *plain*: HTTP/1.1, its head whole
in the first read, CRLF line ends, a ``Host``, no body or a ``Content-Length``
one, and none of the headers that change h11's state machine (``Connection``
other than ``keep-alive``, ``Transfer-Encoding``, ``Expect``, ``Upgrade``). For such a request h11's
parse is a regular expression per line, a ``Headers`` rebuilt and checked,
and three events through its state machine, interpreted: a quarter of a short
stream's set-up (docs/perf/stream-cost.md). :func:`read_head` reads it here
(compiled) and gives back exactly what h11 would (the same method, target and
lower-cased, stripped fields), or :data:`DECLINED` where it is not plain.

A connection starts without h11. On the first request :func:`read_head`
declines (an incomplete head included: a head arriving in pieces is not worth
a second parser of its own), the connection takes h11 on for good, with every
byte of that request fed to it from the start, and it is served as before.
The response side is plain too: a response head with none of the headers
h11 rewrites is written from h11's own head for its status
(``h11_layout.plain_response_head``), chunked; anything else also takes h11
on, fed the request already read (:func:`adopted`) so that h11 stands where it
would have stood had it read the request itself.

A head read here is served without the checks of the request line
(``framing.request_line_problem``) and of the framing faults h11 lets through
(``http1_faults.framing_problem``: bare LF, folded lines, repeated lengths):
neither can find anything in a head this module reads, as what they refuse
it declines.

What keeps this honest: ``tests/sidecar/test_http1_plain.py`` feeds the same
bytes to :func:`read_head` and to h11, and every head read here must be what
h11 reads, with the same body, framing and keep-alive, and pass both checks
above; and the request smuggling corpus and the HTTP/1.1 tests run through
both paths.
"""

from __future__ import annotations

import typing
from typing import Final

import h11

from .h11_layout import fields_valid, is_token, is_visible

Header = tuple[bytes, bytes]

DECLINED: Final = None
"""What :func:`read_head` returns for a request h11 must read."""

# Headers whose presence changes h11's state (keep-alive, 100-continue, a
# protocol switch, the body's framing): such a request goes to h11. All but
# ``Connection: keep-alive``, which httpx, undici and browsers send on every
# request, and which leaves an HTTP/1.1 connection as h11 keeps it: alive.
_STATEFUL: Final = frozenset({b"connection", b"transfer-encoding", b"expect", b"upgrade"})
# h11/_headers.py: CONTENT_LENGTH_MAX_DIGITS.
_LENGTH_MAX_DIGITS: Final = 20


@typing.final
class PlainHead:
    """A plain request's head, as h11 would have read it."""

    def __init__(self, raw: bytes, method: bytes, target: bytes, headers: list[Header],
                 body_bytes: int) -> None:
        self.raw = raw
        """The head as it was read, its blank line included (``adopted`` is given it again)."""
        self.method = method
        self.target = target
        self.headers = headers
        """``(lower-cased name, value)`` in order, as iterating h11's ``Headers`` gives them."""
        self.body_bytes = body_bytes
        """The ``Content-Length`` (0 without one)."""

    @property
    def head_bytes(self) -> int:
        """Where the body starts in what was read."""
        return len(self.raw)


def read_head(received: bytes | bytearray) -> PlainHead | None:
    """The plain request whose head ``received`` starts with, or :data:`DECLINED`.

    Declined: a head not yet whole, a line end other than CRLF, a request line
    or field h11 would refuse or read otherwise (obs-fold, HTTP/1.0, ...), and
    any request whose headers change h11's state; h11 reads those."""
    end = received.find(b"\r\n\r\n")
    if end < 0:
        return DECLINED
    # h11 ends a head at the first LF CR? LF and splits it at each LF. Split at
    # CRLF here, any other CR or LF is left inside a method, target, version,
    # name or value, none of which may hold one: declined below. So a head read
    # here ends where h11's does, in the same lines.
    raw = bytes(received[:end + 4])
    lines = raw.split(b"\r\n")[:-2]  # the blank line's two empty pieces off
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1":
        return DECLINED
    method, target = parts[0], parts[1]
    if not is_token(method) or method == b"CONNECT" or not is_visible(target):
        return DECLINED
    fields: list[Header] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            return DECLINED
        fields.append((name, value.strip(b" \t")))
    # h11's field rules, the list at once; a line that starts with a space or tab
    # (obs-fold) has a name that is not a token.
    if not fields_valid(fields):
        return DECLINED
    headers: list[Header] = []
    hosts = 0
    body_bytes = -1
    for name, value in fields:
        name = name.lower()
        if name in _STATEFUL and (name != b"connection" or value.lower() != b"keep-alive"):
            return DECLINED
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            # h11 merges repeated or comma-listed lengths: those are its to read.
            if body_bytes >= 0 or not value.isdigit() or len(value) > _LENGTH_MAX_DIGITS:
                return DECLINED
            body_bytes = int(value)
        headers.append((name, value))
    if hosts != 1:
        return DECLINED
    return PlainHead(raw, method, target, headers, max(body_bytes, 0))


def server_connection(max_head_bytes: int) -> h11.Connection:
    """A new h11 server connection, its incomplete head bounded by ``max_head_bytes``."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)


def adopted(max_head_bytes: int, request: bytes, pending: bytes | bytearray) -> h11.Connection:
    """An h11 connection that has read ``request`` (a plain request, whole) and
    holds ``pending`` (what came after it) unread: where h11 would stand had it
    read the connection itself."""
    conn = server_connection(max_head_bytes)
    conn.receive_data(request)
    while True:
        event = conn.next_event()
        if isinstance(event, h11.EndOfMessage):
            break
        if not isinstance(event, (h11.Request, h11.Data)):
            raise RuntimeError(f"h11 read a plain request otherwise: {event!r}")
    if pending:
        conn.receive_data(bytes(pending))
    return conn
