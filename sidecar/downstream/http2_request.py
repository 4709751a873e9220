"""What an HTTP/2 request's head says, and what is wrong with it.

h2 has validated the fields (RFC 9113 section 8.2: lower-case names, the
pseudo-header fields first and known); :func:`request_head` splits them into
a :class:`RequestHead`, and :func:`request_problem` holds it to the sidecar's
limits and the methods and targets it serves, as the HTTP/1.1 side does
(``http1_faults.py``). Pure functions: the connection sends the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .request_rules import HeadLimits, Problem, head_problem

Header = tuple[bytes, bytes]

# What HPACK counts per header field beyond its name and value (RFC 7541 section 4.1).
_FIELD_OVERHEAD_BYTES = 32


@dataclass(frozen=True, slots=True)
class RequestHead:
    """An HTTP/2 request's head, pseudo-header fields apart."""

    stream_id: int
    method: bytes
    path: bytes
    scheme: bytes
    authority: bytes | None
    headers: tuple[Header, ...]
    """The regular fields, lower-case, in order (``cookie`` crumbs joined)."""

    def header(self, name: bytes) -> bytes | None:
        """The first value of ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None



class RequestLimits(HeadLimits, Protocol):
    """The limits an HTTP/2 request head is held to: the shared ones and its HPACK size."""

    @property
    def http2_max_header_list_bytes(self) -> int: ...


def request_head(stream_id: int, fields: list[tuple[bytes, bytes]]) -> RequestHead:
    """Split pseudo-header fields from regular ones (h2 has validated both)."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[Header] = []
    cookies: list[bytes] = []
    for name, value in fields:
        name, value = bytes(name), bytes(value)
        if name.startswith(b":"):
            pseudo[name] = value
        elif name == b"cookie":
            cookies.append(value)
        else:
            regular.append((name, value))
    if cookies:
        # RFC 9113 section 8.2.3: crumbs are joined for an HTTP/1.1 hop.
        regular.append((b"cookie", b"; ".join(cookies)))
    return RequestHead(stream_id=stream_id, method=pseudo.get(b":method", b""),
                       path=pseudo.get(b":path", b""), scheme=pseudo.get(b":scheme", b""),
                       authority=pseudo.get(b":authority"), headers=tuple(regular))


def request_problem(head: RequestHead, fields: list[tuple[bytes, bytes]],
                    limits: RequestLimits) -> Problem | None:
    """Why a request head is refused (status, words), or None: its HPACK size
    here, the rest :func:`~.request_rules.head_problem`'s, as for HTTP/1.1."""
    size = sum(len(name) + len(value) + _FIELD_OVERHEAD_BYTES for name, value in fields)
    if size > limits.http2_max_header_list_bytes:
        return 431, f"request header list over {limits.http2_max_header_list_bytes} bytes"
    host = head.authority if head.authority is not None else head.header(b"host")
    return head_problem(head.method, head.path, host, head.headers, limits)
