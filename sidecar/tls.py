"""TLS termination: Mozilla "intermediate" settings, optional mTLS, reload on SIGHUP.

Reloading loads the new certificate into the *same* ``SSLContext``: OpenSSL
copies the context's certificate into each connection when its handshake
starts, so new connections get the new certificate while open ones, streams
included, carry on untouched.
"""

from __future__ import annotations

import ssl

from tokenwire.middleware import ConfigError

from .settings import SidecarConfig

# Mozilla intermediate (v5.7) for TLS 1.2: ECDHE/DHE key exchange, AEAD only.
# TLS 1.3 suites are all AEAD and are left at OpenSSL's defaults.
INTERMEDIATE_CIPHERS_TLS12 = ":".join((
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
    "DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384", "DHE-RSA-CHACHA20-POLY1305",
))


def server_context(config: SidecarConfig) -> ssl.SSLContext:
    """A server context for ``config``'s certificate (and client CA, for mTLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(INTERMEDIATE_CIPHERS_TLS12)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(["http/1.1"])
    load_certificates(context, config)
    return context


def load_certificates(context: ssl.SSLContext, config: SidecarConfig) -> None:
    """(Re)load the certificate chain and client CA from the configured files."""
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError("tls_cert", f"cannot load {config.tls_cert} / {config.tls_key}: {error}") from None
    if config.tls_client_ca:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError("tls_client_ca", f"cannot load {config.tls_client_ca}: {error}") from None
        context.verify_mode = ssl.CERT_REQUIRED
