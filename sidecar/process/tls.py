"""TLS termination: Mozilla "intermediate" settings (ciphers and groups), optional mTLS, reload on SIGHUP.

Reloading loads the new certificate into the *same* ``SSLContext``: OpenSSL
copies the context's certificate into each connection when its handshake
starts, so new connections get the new certificate while open ones, streams
included, carry on untouched.
"""

from __future__ import annotations

import _ssl
import asyncio
import ctypes
import logging
import os
import socket
import ssl
from asyncio import sslproto

from tokenwire.middleware import ConfigError

from ..settings import SidecarConfig
from .acceptor import AcceptedFactory

logger = logging.getLogger("tokenwire.sidecar")

# Mozilla's "intermediate" configuration (Server Side TLS guidelines 6): for
# TLS 1.2 ECDHE key exchange with AEAD ciphers only. Guidelines 5.x also listed
# DHE-RSA suites, to be used with ffdhe2048 parameters; without parameters
# OpenSSL never offers them, so listing them only misled scanners, and 6 dropped
# them. TLS 1.3 suites are all AEAD and OpenSSL's defaults are Mozilla's.
INTERMEDIATE_CIPHERS_TLS12 = ":".join((
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
))
# Mozilla intermediate's key-exchange groups (OpenSSL 3.0 also offers X448,
# secp521r1 and the ffdhe groups by default).
INTERMEDIATE_GROUPS = "X25519:prime256v1:secp384r1"
# SSL_CTX_ctrl's command for SSL_CTX_set1_groups_list (a macro in ssl.h).
_SSL_CTRL_SET_GROUPS_LIST = 92


def set_groups(context: ssl.SSLContext, groups: str) -> bool:
    """Limit the key-exchange groups of ``context`` (TLS 1.2 and 1.3); False if
    this Python cannot (then OpenSSL's defaults stay, with a warning).

    Python's ``ssl`` has no call for it before 3.15 (``set_ecdh_curve`` takes one
    curve), so the OpenSSL function is called on the context's ``SSL_CTX``
    through ctypes. The pointer is read from the context object (right after its
    object header, in every CPython from 3.7) and trusted only if OpenSSL,
    asked through it, reports this context's own options.
    """
    setter = getattr(context, "set_groups", None)
    if setter is not None:  # pragma: no cover - Python 3.15+
        setter(groups)
        return True
    try:
        library = ctypes.CDLL(_ssl.__file__)
        get_options = library.SSL_CTX_get_options
        ctrl = library.SSL_CTX_ctrl
    except (OSError, AttributeError):
        return False
    get_options.restype, get_options.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
    ctrl.restype, ctrl.argtypes = ctypes.c_long, [ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
                                                  ctypes.c_char_p]
    pointer = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
    if not pointer or get_options(pointer) != int(context.options):
        return False
    return bool(ctrl(pointer, _SSL_CTRL_SET_GROUPS_LIST, 0, groups.encode()) == 1)


def server_context(config: SidecarConfig) -> ssl.SSLContext:
    """A server context for ``config``'s certificate (and client CA, for mTLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(INTERMEDIATE_CIPHERS_TLS12)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    # h2 first: a client offering both gets HTTP/2 (RFC 7301: the server picks).
    context.set_alpn_protocols(["h2", "http/1.1"] if config.http2 else ["http/1.1"])
    if not set_groups(context, INTERMEDIATE_GROUPS):
        logger.warning("cannot limit TLS key-exchange groups to %s on this Python; "
                       "OpenSSL's defaults are offered", INTERMEDIATE_GROUPS)
    load_certificates(context, config)
    return context


def load_certificates(context: ssl.SSLContext, config: SidecarConfig) -> None:
    """(Re)load the certificate chain and client CA from the configured files."""
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as error:
        raise certificate_error(config.tls_cert, config.tls_key, error) from None
    if config.tls_client_ca:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError("tls_client_ca", f"cannot load {config.tls_client_ca}: {error}") from None
        context.verify_mode = ssl.CERT_REQUIRED


def certificate_error(cert_path: str, key_path: str, error: OSError) -> ConfigError:
    """Which of the two files ``load_cert_chain`` refused, and why.

    OpenSSL says ``PEM lib`` for a bad certificate and a bad key alike, so
    the certificate is tried on its own (as a trust anchor, which parses it
    and nothing else) to tell the two apart."""
    for key, path in (("tls_cert", cert_path), ("tls_key", key_path)):
        if not os.access(path, os.R_OK):
            reason = "no such file" if not os.path.exists(path) else "not readable"
            return ConfigError(key, f"cannot read {path}: {reason}")
    if getattr(error, "reason", None) == "KEY_VALUES_MISMATCH":
        return ConfigError("tls_key", f"{key_path} is not the private key of the certificate in {cert_path}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_path)
    except (OSError, ssl.SSLError):
        return ConfigError("tls_cert", f"{cert_path} holds no PEM certificate")
    return ConfigError("tls_key", f"{key_path} holds no PEM private key (or one encrypted with a passphrase)")


class _AlertingSSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol, but a failed handshake sends its alert.

    asyncio (and uvloop's copy of it) drop the transport when the handshake
    fails without writing what OpenSSL left for the peer: a client whose
    certificate was refused sees the connection vanish instead of
    ``unknown_ca`` or ``certificate_required`` (CPython gh-98078, fixed after
    3.14). Writing the outgoing bytes first is that fix.
    """

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        if handshake_exc is not None:
            try:
                self._process_outgoing()  # type: ignore[attr-defined]  # (not in typeshed)
            except Exception:  # the alert is a courtesy; the close must happen regardless
                logger.debug("could not send the TLS alert", exc_info=True)
        super()._on_handshake_complete(handshake_exc)


def alerting_protocol_factory(
    app_protocol: AcceptedFactory, context: ssl.SSLContext, handshake_timeout_s: float | None,
) -> AcceptedFactory | None:
    """A listener's protocol factory that terminates TLS with alerts (for mTLS,
    where a refused certificate is the client's to learn about); None if this
    Python's asyncio has not the shape the fix relies on (then the loop's own
    TLS is used, without the alert)."""
    if not all(hasattr(sslproto.SSLProtocol, name) for name in ("_on_handshake_complete",
                                                                "_process_outgoing")):
        return None

    def build(sock: socket.socket, address: object) -> asyncio.BaseProtocol:
        # No waiter: nobody awaits the handshake of a server-side connection here
        # (typeshed's stub wants a future; asyncio accepts None).
        return _AlertingSSLProtocol(
            asyncio.get_running_loop(), app_protocol(sock, address), context, None,  # type: ignore[arg-type]
            server_side=True, ssl_handshake_timeout=handshake_timeout_s)  # type: ignore[arg-type]

    return build
