"""The client's response head through h11, its headers checked once.

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
(:mod:`~tokenwire.sidecar.downstream.header_fields`); any other response goes through
h11 whole.
"""

from __future__ import annotations

import h11

from .header_fields import fields_valid

Header = tuple[bytes, bytes]

# The headers h11 moves or rewrites in a response head (see the module docstring).
_REWRITTEN = frozenset({b"content-length", b"transfer-encoding", b"connection", b"host"})


def send_response_head(conn: h11.Connection, status: int, headers: list[Header]) -> bytes:
    """What ``conn.send(h11.Response(status_code=status, headers=headers))``
    returns (and the same state change of ``conn``), for less work."""
    items: list[Header]
    if fields_valid(headers):  # h11's header rules, the whole list at once
        items = headers
    else:  # h11 says why (or takes what is not bytes)
        items = h11.Response(status_code=status, headers=headers).headers.raw_items()
    for name, _ in items:
        if name.lower() in _REWRITTEN:
            return conn.send(h11.Response(status_code=status, headers=headers)) or b""
    bare = conn.send(h11.Response(status_code=status, headers=[])) or b""
    line_end = bare.index(b"\r\n") + 2
    return b"".join([bare[:line_end], *(b"%s: %s\r\n" % item for item in items), bare[line_end:]])
