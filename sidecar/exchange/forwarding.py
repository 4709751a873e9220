"""Request classification and the headers a proxy adds or strips.

Nothing here is wire policy (that lives in ``tokenwire.middleware``): these are
the facts about one request that the driver needs before it can build a
:class:`~tokenwire.middleware.WireStream` and an upstream request.
"""

from __future__ import annotations

import base64
import email.utils
import functools
import json
import os
import re
import time
from collections.abc import Iterable
from typing import Final

from tokenwire.middleware.core.headers import header_value, strip_hop_by_hop

Header = tuple[bytes, bytes]

# Set by the sidecar itself from what it saw on the socket; a client's own
# values would let it spoof its address, scheme or certificate to the engine
# (nginx's proxy_set_header examples replace the same set).
# An underscore as an int, the needle of a memchr (why: middleware/core/sse.py, _LF).
_UNDERSCORE: Final = 0x5F
_REPLACED_UPSTREAM: Final = frozenset({
    b"host", b"content-length", b"accept-encoding", b"expect",
    b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-forwarded-port",
    b"x-real-ip", b"forwarded",
})
# Client-certificate headers, by what their names hold rather than a list of the
# spellings seen (RFC 9440's Client-Cert, nginx's X-SSL-Client-*, Envoy's
# X-Forwarded-Client-Cert, X-Client-Cert-DN, ...): an engine that trusts one
# must only ever see the sidecar's own (Client-Cert with mTLS), as Envoy
# sanitises x-forwarded-client-cert by default.
_CLIENT_CERT_PARTS: Final = (b"client-cert", b"client-verify", b"client-dn", b"client-s-dn", b"client-i-dn",
                      b"ssl-client", b"x-ssl-")
# One search for all of them: ``part in name`` on bytes first tries ``part`` as
# an integer and formats the TypeError it raises, ~2,000 instructions a test, 7
# a header: 4 % of a short stream's set-up (docs/perf/stream-cost.md).
_CLIENT_CERT_NAME: Final = re.compile(b"|".join(re.escape(part) for part in _CLIENT_CERT_PARTS))


def _client_cert_header(name: bytes) -> bool:
    return _CLIENT_CERT_NAME.search(name) is not None


def wants_stream(headers: Iterable[Header], body: bytes) -> bool:
    """True if the request asked for a streamed answer.

    OpenAI-style APIs say so with ``"stream": true`` in the JSON body;
    EventSource clients with ``Accept: text/event-stream``.
    """
    accept = header_value(headers, b"accept")
    if accept is not None and accept.lower().find(b"text/event-stream") != -1:
        return True
    # Most bodies are small JSON; skip the parse when the key is plainly absent.
    if b'"stream"' not in body:
        return False
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(payload, dict) and payload.get("stream") is True


def new_request_id() -> str:
    """A fresh request id: 32 hex digits, 128 random bits (``uuid4().hex`` built a
    ``UUID`` object, in Python, once a stream, to fix 6 of them)."""
    return os.urandom(16).hex()


CLIENT_REQUEST_ID_HEADER: Final = b"x-client-request-id"
"""Carries the client's own request id upstream, for the engine's logs only."""


def request_id_from(headers: Iterable[Header], header_name: bytes) -> str:
    """The client's request id if it sent a usable one, else a new one."""
    value = header_value(headers, header_name)
    if value is not None:
        text = value.decode("ascii", "replace").strip()
        # Bounded and printable: it ends up in logs, metrics labels and URLs.
        if 0 < len(text) <= 200 and text.isprintable() and "/" not in text:
            return text
    return new_request_id()


def upstream_request_id(headers: Iterable[Header], header_name: bytes, request_id: str) -> str:
    """The id the upstream knows a request by, and the key of its abort call.

    Never the client's: a client that sent another's id and hung up would cut
    that other generation short (``--abort-url``), and an engine that refuses
    a duplicate id would refuse the victim's retry. Where the client sent no
    id, the one the sidecar made up serves for both.
    """
    return request_id if header_value(headers, header_name) is None else new_request_id()


def upstream_request_headers(
    headers: Iterable[Header],
    *,
    body_bytes: int,
    peer_host: str | None,
    scheme: str,
    request_id: str,
    request_id_header: bytes,
    client_request_id: str | None = None,
    server_port: int | None = None,
    client_cert_der: bytes | None = None,
    drop_underscores: bool = True,
) -> list[Header]:
    """The client's headers as forwarded upstream.

    ``request_id`` is the upstream's id for the request (see
    :func:`upstream_request_id`); a client's own id, when it differs, goes
    along as ``X-Client-Request-Id``. Hop-by-hop headers go; so do names with
    ``_`` when ``drop_underscores`` (nginx's default). The forwarding headers
    are the sidecar's own, as in nginx's ``proxy_set_header`` examples:
    ``X-Forwarded-For`` is every value the client sent, in order, plus the real
    peer; ``X-Real-IP``, ``X-Forwarded-Proto``/``-Host``/``-Port`` and
    ``Forwarded`` say what the sidecar saw; client-certificate headers are
    dropped, and with mTLS ``Client-Cert`` (RFC 9440) carries the verified
    certificate. The body is
    always sent whole with a ``Content-Length``; the upstream is asked for
    ``identity`` so an SSE body can be parsed and coalesced.
    """
    headers = list(headers)
    kept = [(k, v) for k, v in strip_hop_by_hop(headers)
            if k not in _REPLACED_UPSTREAM and k != request_id_header and k != CLIENT_REQUEST_ID_HEADER
            and not _client_cert_header(k)
            and not (drop_underscores and _UNDERSCORE in k)]
    host = header_value(headers, b"host")
    chain = [v.strip() for k, v in headers if k == b"x-forwarded-for" and v.strip()]
    if peer_host is not None:
        chain.append(peer_host.encode())
        kept.append((b"x-real-ip", peer_host.encode()))
    if chain:
        kept.append((b"x-forwarded-for", b", ".join(chain)))
    kept.append((b"x-forwarded-proto", scheme.encode()))
    if host is not None:
        kept.append((b"x-forwarded-host", host))
    if server_port is not None:
        kept.append((b"x-forwarded-port", str(server_port).encode()))
    kept.append((b"forwarded", _forwarded(peer_host, host, scheme)))
    if client_cert_der is not None:
        kept.append((b"client-cert", b":" + base64.b64encode(client_cert_der) + b":"))
    kept.append((request_id_header, request_id.encode()))
    if client_request_id is not None and client_request_id != request_id:
        kept.append((CLIENT_REQUEST_ID_HEADER, client_request_id.encode()))
    kept.append((b"accept-encoding", b"identity"))
    kept.append((b"content-length", str(body_bytes).encode()))
    return kept


def _forwarded(peer_host: str | None, host: bytes | None, scheme: str) -> bytes:
    """RFC 7239 ``Forwarded`` for this hop (IPv6 and Host quoted, as the RFC requires)."""
    parts: list[bytes] = []
    if peer_host is not None:
        node = f'"[{peer_host}]"' if ":" in peer_host else peer_host
        parts.append(b"for=" + node.encode())
    if host is not None:
        parts.append(b'host="' + host.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"')
    parts.append(b"proto=" + scheme.encode())
    return b";".join(parts)


# The engine's own server and date are not the client's business; a proxy
# states its own date (nginx's proxy_hide_header defaults do the same).
_HIDDEN_RESPONSE: Final = frozenset({b"server", b"date"})


def client_response_headers(headers: Iterable[Header], request_id_header: bytes,
                            request_id: str) -> list[Header]:
    """The response head for the client: the upstream's ``Server`` and ``Date``
    replaced by the sidecar's ``Date``, and the client's request id (the
    upstream echoes the id it was sent, which is the sidecar's own)."""
    result = [(k, v) for k, v in headers if k not in _HIDDEN_RESPONSE and k != request_id_header]
    result.append((b"date", _http_date(int(time.time()))))
    result.append((request_id_header, request_id.encode()))
    return result


@functools.lru_cache(maxsize=2)
def _http_date(whole_s: int) -> bytes:
    # Every response of one second shares its Date: formatting it costs more than a lookup.
    return email.utils.formatdate(whole_s, usegmt=True).encode()
