"""Everything the sidecar's HTTP/1.1 side knows of h11's rules and output bytes, in one place.

h11 is the client connection's parser and state machine; on the hot path the
sidecar writes some of what h11 would write itself, byte for byte, and that
depends on h11's output layout. Every such dependency lives here, held to h11
by property tests (``tests/sidecar/test_h11_layout_head.py``,
``test_h11_layout_fields.py``), and valid for the h11 versions ``pyproject.toml``
pins (:data:`H11_TESTED`: a new minor version is allowed once those tests pass
on it):

* :func:`fields_valid`: h11's header field rules over a whole list at once;
* :func:`send_response_head`: h11's response head with its headers checked once,
  and :func:`plain_response_head` the same without a connection, for a plain
  request (``http1_plain.py``), with :data:`CHUNKED_END`, its body's end;
* :func:`declares_chunked` and :func:`chunk_size_line`: the chunked framing
  h11 chose, and its chunk frame (``%x`` CRLF data CRLF), written without h11;
* :func:`refusal_head`: the head of a refusal, written raw (the request may be
  too broken for h11 to answer it).

Header fields
-------------
h11 checks every header it is given with two regular expressions (the name a
``token``, the value ``field-value``: no NUL, no CR/LF or other whitespace
but inner spaces and tabs, none leading or trailing), one Python call and
one match each. :func:`fields_valid` applies the same rules to all names
joined by a line feed and all values joined by one: one ``bytes.translate``
of each through a 256-byte table that keeps an allowed byte (and the line
feed) and changes any other, so the translation equals its input exactly when
every byte is allowed; and a look at each field for a line feed (neither in
a token nor in a field value: one ``memchr``, the needle an int) and at each
value's first and last byte (no space or tab there). No deletion table is
built and no substring searched per call: those argument-parsing method calls
were most of its cost (docs/perf/stream-cost.md). Where it says no, h11
checks the headers itself and raises its own error.

The response head
-----------------
``h11.Connection.send(Response(...))`` checks every header of a response four
times: the ``Response`` itself, then h11 rewrites the framing headers (drops
``Content-Length``, sets ``Transfer-Encoding: chunked``, maybe adds
``Connection: close``) by rebuilding the whole list twice and the event once,
each rebuild checked again. For a streamed answer with a handful of headers
that was most of a response head's cost.

Those rewrites only ever remove ``Content-Length``, ``Transfer-Encoding`` and
``Connection`` headers and append their new values after every other header
(h11 puts a ``Host`` header first). So for a response that has none of those
four, h11's head is exactly: its head for the same status with no headers at
all, with the response's headers inserted after the status line in their
order, and h11 chose the same framing and keep-alive for both (they depend on
the status, the request and those four headers only). The headers are still
checked, once, with h11's rules applied to the whole list at once
(:func:`fields_valid`); any other response goes through
h11 whole.

Chunked bodies
--------------
h11's chunked writer is stateless (each ``Data`` is ``%x`` CRLF, the data,
CRLF: nothing counted or remembered) and ``Data`` changes no state in
``SEND_BODY``, so the connection frames its chunks itself and h11 is still
right about the connection when ``EndOfMessage`` goes through it.
"""

from __future__ import annotations

import functools
import http
import typing
from collections.abc import Sequence
from typing import Final

import h11

H11_TESTED: typing.Final = (0, 16)
"""The h11 minor version the byte layout here was checked against (``h11>=0.16,<0.17``)."""

Header = tuple[bytes, bytes]

# h11/_abnf.py: field_name = token; field_value = (field_vchar+ ([ \t]+ field_vchar+)*)?
# with field_vchar = [^\x00\s] (bytes: \s is space, \t, \n, \r, \f, \v).
TOKEN_CHARS: Final = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The bytes of an HTTP token (a field name, a method)."""
# The translation tables: an allowed byte and the line feed (the joined
# lists' separator) stay as they are, any other byte becomes the next one (so
# it changes). A value may hold anything but NUL, LF, CR, VT and FF; space and
# tab only inside it, checked apart.


def _keeping(allowed: bytes) -> bytes:
    return bytes(c if c in allowed else (c + 1) % 256 for c in range(256))


_NAME_TABLE: Final = _keeping(TOKEN_CHARS + b"\n")
_VALUE_TABLE: Final = _keeping(bytes(c for c in range(256) if c not in b"\x00\r\x0b\x0c"))
_TOKEN_TABLE: Final = _keeping(TOKEN_CHARS)
_VISIBLE_TABLE: Final = _keeping(bytes(range(0x21, 0x7F)))  # h11's vchar: a request target's bytes
_SPACE: Final = 0x20
_TAB: Final = 0x09
_LF: Final = 0x0A


def is_token(data: bytes) -> bool:
    """True if ``data`` is an HTTP token (a method, a field name): one or more :data:`TOKEN_CHARS`."""
    return bool(data) and data.translate(_TOKEN_TABLE) == data


def is_visible(data: bytes) -> bool:
    """True if ``data`` is one or more visible ASCII characters (h11's request target)."""
    return bool(data) and data.translate(_VISIBLE_TABLE) == data


def fields_valid(headers: Sequence[tuple[object, object]]) -> bool:
    """True if h11 would accept every name and value of ``headers`` (each a
    ``bytes`` object: h11 takes other types through other paths, so anything
    else is a no; typed ``object`` so that compiled code checks it here
    rather than refusing it at the call)."""
    if not headers:
        return True
    names: list[bytes] = []
    values: list[bytes] = []
    for item_name, item_value in headers:
        if type(item_name) is not bytes or type(item_value) is not bytes:
            return False
        name: bytes = item_name  # typed, so that compiled code reads them as bytes
        value: bytes = item_value
        if not name or _LF in name or _LF in value:  # an int needle: a memchr
            return False
        if value:
            first = value[0]
            last = value[-1]
            if first in (_SPACE, _TAB) or last in (_SPACE, _TAB):
                return False
        names.append(name)
        values.append(value)
    all_names = b"\n".join(names)
    all_values = b"\n".join(values)
    return all_names.translate(_NAME_TABLE) == all_names and all_values.translate(_VALUE_TABLE) == all_values


# The headers h11 moves or rewrites in a response head (see the module docstring).
_REWRITTEN: Final = frozenset({b"content-length", b"transfer-encoding", b"connection", b"host"})


def send_response_head(conn: h11.Connection, status: int, headers: list[Header]) -> bytes:
    """What ``conn.send(h11.Response(status_code=status, headers=headers))``
    returns (and the same state change of ``conn``), for less work."""
    items: list[Header]
    if fields_valid(headers):  # h11's header rules, the whole list at once
        items = headers
    else:  # h11 says why (or takes what is not bytes)
        items = h11.Response(status_code=status, headers=headers).headers.raw_items()
    if _rewritten(items):
        return conn.send(h11.Response(status_code=status, headers=headers)) or b""
    return _with_fields(conn.send(h11.Response(status_code=status, headers=[])) or b"", items)


def plain_response_head(status: int, headers: list[Header]) -> bytes | None:
    """What h11 writes for this response to a plain request (``http1_plain``:
    HTTP/1.1, keep-alive, not HEAD), a chunked one; None for a response whose
    head h11 must write itself: fields it would refuse or rewrite, or a status
    without a body (1xx, 204, 304) or with none of h11's framing."""
    if status < 200 or status in (204, 304) or not fields_valid(headers) or _rewritten(headers):
        return None
    bare = _plain_bare_head(status)
    return None if bare is None else _with_fields(bare, headers)


CHUNKED_END: typing.Final = b"0\r\n\r\n"
"""What h11 writes for ``EndOfMessage`` (no trailers) ending a chunked body."""


def _rewritten(items: Sequence[Header]) -> bool:
    return any(name.lower() in _REWRITTEN for name, _ in items)


def _with_fields(bare: bytes, items: Sequence[Header]) -> bytes:
    """``bare`` (h11's head with no fields) with ``items`` after its status line."""
    line_end = bare.index(b"\r\n") + 2
    parts = [bare[:line_end]]
    for name, value in items:  # no %-format: each one parses its format again
        parts += (name, b": ", value, b"\r\n")
    parts.append(bare[line_end:])
    return b"".join(parts)


@functools.cache
def _plain_bare_head(status: int) -> bytes | None:
    """h11's head for ``status`` with no fields, answering a plain request
    (asked of h11 once a status), if it frames that body chunked."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    bare = conn.send(h11.Response(status_code=status, headers=[])) or b""
    return bare if declares_chunked(bare, status, b"GET") else None


# How a response head h11 wrote declares a chunked body (the lowered head is searched).
_CHUNKED_HEADER_LINE: Final = b"\r\ntransfer-encoding: chunked\r\n"
# The size line of every chunk shorter than 4 KiB (an event's usual size), made
# once: formatting one per write was a tenth of the sidecar's instructions per event.
_SIZE_LINES: typing.Final[tuple[bytes, ...]] = tuple(b"%x\r\n" % size for size in range(4096))


def declares_chunked(head: bytes, status: int, method: bytes | None) -> bool:
    """Whether h11 framed the response whose ``head`` it wrote as chunked (and
    so gives it a body: not to a HEAD request, not a 204 or 304)."""
    return (_CHUNKED_HEADER_LINE in head.lower() and status not in (204, 304)
            and method != b"HEAD")


def chunk_size_line(size: int) -> bytes:
    """The size line h11 writes before a chunk of ``size`` bytes."""
    return _SIZE_LINES[size] if size < 4096 else b"%x\r\n" % size


def refusal_head(status: int, headers: Sequence[Header]) -> bytes:
    """A refusal's head, ``Connection: close``, written without h11."""
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in headers]
    lines += [b"connection: close", b"", b""]
    return b"\r\n".join(lines)
