"""The rules a request head is held to whichever HTTP version carried it.

``http1_faults.request_problem`` and ``http2_request.request_problem`` each
check what only their framing can get wrong (smuggling, upgrades, HPACK
sizes), then ask :func:`head_problem` the rest, so both refuse the same heads
with the same status, in the same order. The rules are nginx's where nginx has
one (a lower-case method, a bad Host, an over-long target: 400, 400, 414) and
stricter where a proxy in front of an engine has no use for leniency: a path
with a dot-segment is refused rather than normalised, since two hops that
normalise differently are how a path gets past a rule meant for it.
Pure functions: the connection sends the refusal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from tokenwire.middleware.core.headers import header_value

Problem = tuple[int, str]
"""An HTTP status and the fault in words, for the refusal."""
Header = tuple[bytes, bytes]

MAX_TARGET_BYTES: Final = 8 * 1024
"""A request target longer than this gets 414 (nginx's default header buffer, 8 KiB)."""
# A dot as an int, the needle of a memchr (why: middleware/core/sse.py, _LF).
_DOT: Final = 0x2E
MAX_HEADER_NAME_BYTES: Final = 1024
"""A header name longer than this gets 431: no header anyone sends is named that
long; values are bounded by the head limit."""
# RFC 3986's reg-name, IPv4 and IP-literal characters (unreserved, pct-encoded,
# sub-delims), the port's ':' and the literal's brackets: no '/', '?', '#', '@'
# or white space, which would make the authority name something else.
_HOST_BYTES: Final = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%!$&'()*+,;=:[]")
# A separator or a dot however it is spelled: what a next hop may decode back.
_SPELLINGS: Final = ((b"%2e", b"."), (b"%2f", b"/"), (b"%5c", b"/"), (b"\\", b"/"))


class HeadLimits(Protocol):
    """The limits both versions share (the sidecar's config has them)."""

    @property
    def max_header_count(self) -> int: ...

    @property
    def max_body_bytes(self) -> int: ...


def head_problem(method: bytes, target: bytes, host: bytes | None, headers: Sequence[Header],
                 limits: HeadLimits) -> Problem | None:
    """Why a request head is refused (status, words), or None.

    ``host``: the Host header, or HTTP/2's ``:authority`` (None without either:
    HTTP/1.0, or an HTTP/2 request that names none)."""
    if len(headers) > limits.max_header_count:
        return 400, f"more than {limits.max_header_count} request headers"
    if len(target) > MAX_TARGET_BYTES:
        return 414, f"request target over {MAX_TARGET_BYTES} bytes"
    if not target.startswith(b"/"):
        return 400, "only origin-form request targets are served"
    if method in (b"CONNECT", b"TRACE"):
        # TRACE would echo the request, credentials and all (nginx: 405).
        return 405, f"{method.decode()} is not supported"
    if method != method.upper():
        return 400, "a method in lower case (methods are case-sensitive: GET, POST)"
    if has_dot_segment(target):
        return 400, "a dot-segment (. or ..) in the request path"
    if host is not None and not valid_host(host):
        return 400, "an invalid Host"
    for name, _ in headers:
        if len(name) > MAX_HEADER_NAME_BYTES:
            return 431, f"a header name over {MAX_HEADER_NAME_BYTES} bytes"
    length = header_value(headers, b"content-length")
    if length is not None:
        if not length.isdigit():
            return 400, "a malformed Content-Length"
        if int(length) > limits.max_body_bytes:
            return 413, f"request body over {limits.max_body_bytes} bytes"
    return None


def has_dot_segment(target: bytes) -> bool:
    """Whether the path of ``target`` has a ``.`` or ``..`` segment, spelled
    plainly, percent-encoded (``%2e``) or between encoded separators
    (``%2f``, ``%5c``, a backslash)."""
    if _DOT not in target and target.find(b"%2e") == -1 and target.find(b"%2E") == -1:
        return False  # no dot however spelled (most API paths): none of the copies below
    path = target.split(b"?", 1)[0].lower()
    for spelled, meant in _SPELLINGS:
        path = path.replace(spelled, meant)
    return any(segment in (b".", b"..") for segment in path.split(b"/"))


def valid_host(host: bytes) -> bool:
    """Whether a Host (or ``:authority``) value names a host, and only that."""
    return bool(host) and all(byte in _HOST_BYTES for byte in host)
