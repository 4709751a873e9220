"""CORS on the proxy port: which browser pages may call it, as pure functions.

A page served from another origin (the playground on the admin port, a web
app on its own host) can only read a streamed answer from the proxy if the
proxy says so. ``cors_allow_origins`` lists the origins that may; for them:

* a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
  is answered here, ``204``, never forwarded: engines do not know the
  sidecar's policy, and a preflight costs no engine time;
* every proxied response gains ``Access-Control-Allow-Origin`` and
  ``Access-Control-Expose-Headers`` (the request id and the resume stream id,
  which a page needs to read).

The admin port's own origins (the playground's, :func:`admin_origins`) are
allowed by default, so the page works on a plain ``tokenwire sidecar
--admin-listen ...``: that lets the page read what its user's own requests
return, nothing more, as the proxy's rules (stream ownership included) apply
to its requests as to any client's. With no list configured, only requests
from those origins are handled here (:func:`origins_for`); the rest are left
to the engine as before.

A preflight from any other origin gets ``403``; a plain request from one is
still proxied (CORS protects the reader, not the server) but without the
headers, so the browser withholds the answer from that page. With the list
empty nothing here applies and ``OPTIONS`` is forwarded as before, which
leaves an engine's own CORS handling intact.

Header names are lower-case bytes, as h11 gives them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from typing import Final

from tokenwire.middleware import ClientError, ErrorCode
from tokenwire.middleware.core import client_settings
from tokenwire.middleware.core.frames import FRAMES_HEADER
from tokenwire.middleware.core.headers import STREAM_ID_HEADER, SUMMARY_HEADER, header_value

Header = tuple[bytes, bytes]

ANY_ORIGIN: Final = "*"
"""The ``cors_allow_origins`` entry that allows every origin."""

ALLOWED_METHODS: Final = b"GET, POST, DELETE, OPTIONS"
# What the OpenAI SDKs and EventSource-style resumes send beyond the safelisted
# headers, and a request's own wire settings (middleware/core/client_settings.py).
ALLOWED_HEADERS: Final = (b"content-type", b"authorization", b"last-event-id", b"idempotency-key",
                   b"x-request-id", SUMMARY_HEADER, FRAMES_HEADER, *client_settings.HEADERS)
# Browsers cache a preflight this long (Chromium caps it at two hours).
MAX_AGE_S: Final = 600


def admin_origins(host: str, port: int) -> list[str]:
    """The origins a browser may load the admin port's playground from.

    A loopback admin port is reached as ``127.0.0.1``, ``localhost`` or
    ``[::1]`` alike, and the browser's ``Origin`` is whichever was typed; on
    every interface, the page's origin cannot be known, so the loopback names
    and this host's name are covered (others: ``cors_allow_origins``).
    """
    hosts = [f"[{host}]" if ":" in host else host]
    if host in ("127.0.0.1", "localhost", "::1"):
        hosts = ["127.0.0.1", "localhost", "[::1]"]
    elif host in ("0.0.0.0", "::", ""):
        hosts = ["127.0.0.1", "localhost", "[::1]", socket.gethostname().lower()]
    return [f"http://{name}:{port}" for name in hosts]


def origins_for(configured: tuple[str, ...], own: tuple[str, ...],
                origin: bytes | None) -> tuple[str, ...]:
    """The allowed origins that apply to a request from ``origin``; empty = no
    CORS here (preflights forwarded, no headers added).

    ``configured`` is ``cors_allow_origins``, ``own`` the admin port's origins.
    """
    if configured:
        return (*configured, *(o for o in own if o not in configured))
    if own and origin_allowed(own, origin):
        return own
    return ()


def normalize_origin(origin: str) -> str:
    """An origin as browsers serialize it: lower-case, no trailing slash."""
    return origin.strip().rstrip("/").lower()


def origin_allowed(allowed_origins: Sequence[str], origin: bytes | None) -> bool:
    """True if a request with this ``Origin`` header may read the proxy's answers."""
    if origin is None or not allowed_origins:
        return False
    if ANY_ORIGIN in allowed_origins:
        return True
    return normalize_origin(origin.decode("latin-1")) in allowed_origins


def is_preflight(method: bytes, headers: Iterable[Header]) -> bool:
    """True for a CORS preflight (a plain ``OPTIONS`` is an ordinary request)."""
    if method != b"OPTIONS":
        return False
    headers = list(headers)
    return (header_value(headers, b"origin") is not None
            and header_value(headers, b"access-control-request-method") is not None)


def _allowed_headers(request_id_header: bytes) -> bytes:
    names = list(ALLOWED_HEADERS)
    if request_id_header not in names:
        names.append(request_id_header)
    return b", ".join(names)


def preflight_response(allowed_origins: Sequence[str], headers: Iterable[Header], *,
                       request_id_header: bytes = b"x-request-id") -> tuple[int, list[Header], bytes]:
    """The answer to a preflight: (status, headers, body); 403 for an origin not allowed."""
    origin = header_value(headers, b"origin")
    if origin is None or not origin_allowed(allowed_origins, origin):
        error = ClientError("this origin may not call the proxy (see cors_allow_origins)",
                            ErrorCode.BAD_REQUEST, http_status=403)
        body = error.body()
        return 403, [*error.response_headers(), (b"content-length", str(len(body)).encode())], body
    return 204, [
        (b"access-control-allow-origin", origin),
        (b"access-control-allow-methods", ALLOWED_METHODS),
        (b"access-control-allow-headers", _allowed_headers(request_id_header)),
        (b"access-control-max-age", str(MAX_AGE_S).encode()),
        (b"vary", b"Origin"),
    ], b""


def with_cors_headers(response_headers: Iterable[Header], allowed_origins: Sequence[str],
                      origin: bytes | None, *, request_id_header: bytes = b"x-request-id") -> list[Header]:
    """A proxied response's headers with this sidecar's CORS headers, if the origin is allowed.

    The upstream's own ``Access-Control-*`` headers are dropped whenever CORS
    is configured here: a second ``Access-Control-Allow-Origin`` makes
    browsers reject the response outright.
    """
    result = list(response_headers)
    if not allowed_origins:
        return result
    result = [(name, value) for name, value in result if not name.startswith(b"access-control-")]
    # The answer differs by Origin, so a shared cache must not hand one page's answer to another.
    result.append((b"vary", b"Origin"))
    if origin is not None and origin_allowed(allowed_origins, origin):
        result.append((b"access-control-allow-origin", origin))
        result.append((b"access-control-expose-headers", request_id_header + b", " + STREAM_ID_HEADER))
    return result
