"""TLS at the edge: old protocols, non-AEAD ciphers and bad client certificates refused.

(TLS 1.1, mTLS without a certificate and the SIGHUP reload under open streams
are in test_tls.py.) A refusal only means something if the client could have
succeeded elsewhere, so each weak client is first shown to complete a handshake
with a permissive in-memory server; where this OpenSSL cannot speak the old
protocol at all the case is skipped rather than passed.
"""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
import trustme
from clients import connect, read_response, request_bytes, tls_client_context, tls_server_files
from conftest import RunningSidecar, make_config
from tokenwire.sidecar.process.tls import server_context, set_groups

StartSidecar = Callable[..., RunningSidecar]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_files(tmp_path: Path, ca: trustme.CA) -> dict[str, str]:
    return tls_server_files(ca, tmp_path)


def _handshakes_with_a_permissive_server(client: ssl.SSLContext, ca: trustme.CA,
                                        key_type: trustme.KeyType = trustme.KeyType.ECDSA) -> bool:
    """Whether ``client`` completes a handshake with a server that allows anything."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    server.set_ciphers("ALL:@SECLEVEL=0")
    ca.issue_cert("localhost", key_type=key_type).configure_cert(server)
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client_side = client.wrap_bio(client_in, client_out, server_hostname="localhost")
    server_side = server.wrap_bio(server_in, server_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    return False
        server_in.write(client_out.read())
        client_in.write(server_out.read())
        if all(done.values()):
            return True
    return False


def _weak_client(version: ssl.TLSVersion, ciphers: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_ciphers(ciphers)
    context.minimum_version = version
    context.maximum_version = version
    return context


def _served(port: int, context: ssl.SSLContext) -> bool:
    """True if a request over ``context`` got an answer; False if TLS refused it
    (during the handshake, or for TLS 1.3 client certificates, on first read)."""
    try:
        with connect(port, ssl_context=context) as sock:
            sock.sendall(request_bytes("GET", "/models/v1/models"))
            return read_response(sock).status == 200
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return False


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1], ids=["1.0", "1.1"])
def test_tls_when_client_offers_only_tls10_or11_then_handshake_refused(
        start_sidecar: StartSidecar, ca: trustme.CA, server_files: dict[str, str],
        version: ssl.TLSVersion) -> None:
    client = _weak_client(version, "ALL:@SECLEVEL=0")
    if not _handshakes_with_a_permissive_server(client, ca):
        pytest.skip(f"this OpenSSL cannot speak {version.name} at all")
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"])
    with pytest.raises(ssl.SSLError):
        connect(sidecar.port, ssl_context=client)


@pytest.mark.parametrize("ciphers", [
    "ECDHE-ECDSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA",          # CBC with SHA-1
    "ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES256-SHA384",    # CBC with SHA-2
])
def test_tls_when_client_offers_only_non_aead_ciphers_then_handshake_refused(
        start_sidecar: StartSidecar, ca: trustme.CA, server_files: dict[str, str], ciphers: str) -> None:
    client = _weak_client(ssl.TLSVersion.TLSv1_2, ciphers + ":@SECLEVEL=0")
    assert _handshakes_with_a_permissive_server(client, ca), "the weak client cannot handshake anywhere"
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"])
    with pytest.raises(ssl.SSLError):
        connect(sidecar.port, ssl_context=client)
    # The same server still serves a modern TLS 1.2 client.
    modern = tls_client_context(ca)
    modern.maximum_version = ssl.TLSVersion.TLSv1_2
    assert _served(sidecar.port, modern)


@pytest.mark.parametrize("client_cert", ["from-another-ca", "expired", "not-yet-valid"])
def test_tls_when_mtls_client_certificate_is_not_acceptable_then_refused(
        start_sidecar: StartSidecar, ca: trustme.CA, server_files: dict[str, str], client_cert: str) -> None:
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"],
                            tls_client_ca=server_files["ca"])
    now = datetime.datetime.now(datetime.UTC)
    if client_cert == "from-another-ca":
        leaf = trustme.CA().issue_cert("client@example.com")
    elif client_cert == "expired":
        leaf = ca.issue_cert("client@example.com", not_before=now - datetime.timedelta(days=30),
                             not_after=now - datetime.timedelta(days=1))
    else:
        leaf = ca.issue_cert("client@example.com", not_before=now + datetime.timedelta(days=1),
                             not_after=now + datetime.timedelta(days=30))
    refused = tls_client_context(ca)
    leaf.configure_cert(refused)
    assert not _served(sidecar.port, refused)
    # A current certificate from the configured CA is let in, on both protocol versions.
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        accepted = tls_client_context(ca)
        accepted.maximum_version = version
        ca.issue_cert("client@example.com").configure_cert(accepted)
        assert _served(sidecar.port, accepted), version


_GROUPS = [("X25519", True), ("prime256v1", True), ("secp384r1", True), ("X448", False),
           ("secp521r1", False), ("ffdhe2048", False)]


# ffdhe groups are key shares in TLS 1.3 only; in 1.2 they name DHE parameters.
@pytest.mark.parametrize(("version", "group", "accepted"), [
    pytest.param(version, group, accepted, id=f"{group}-{label}")
    for version, label in ((ssl.TLSVersion.TLSv1_2, "1.2"), (ssl.TLSVersion.TLSv1_3, "1.3"))
    for group, accepted in _GROUPS
    if not (group.startswith("ffdhe") and version is ssl.TLSVersion.TLSv1_2)])
def test_tls_key_exchange_groups_are_exactly_mozilla_intermediate(
        start_sidecar: StartSidecar, ca: trustme.CA, tmp_path: Path, version: ssl.TLSVersion,
        group: str, accepted: bool) -> None:
    # An RSA certificate: with ECDSA, TLS 1.2 would also need the certificate's
    # own curve among the client's groups.
    cert = ca.issue_cert("localhost", "127.0.0.1", key_type=trustme.KeyType.RSA)
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "rsa.pem"))
    client = tls_client_context(ca)
    client.minimum_version = client.maximum_version = version
    assert set_groups(client, group), "this Python cannot limit a context's groups"
    if not accepted:
        assert _handshakes_with_a_permissive_server(client, ca, trustme.KeyType.RSA), \
            f"{group} is refused everywhere"
    sidecar = start_sidecar(tls_cert=str(tmp_path / "rsa.pem"), tls_key=str(tmp_path / "rsa.pem"))
    if accepted:
        assert _served(sidecar.port, client)
    else:
        with pytest.raises(ssl.SSLError):
            connect(sidecar.port, ssl_context=client)


def test_tls_cipher_suites_are_exactly_mozilla_intermediate(server_files: dict[str, str]) -> None:
    """What the server context would negotiate is what it lists: no DHE suite is
    listed without the parameters to offer it."""
    config = make_config("http://127.0.0.1:1", tls_cert=server_files["tls_cert"],
                         tls_key=server_files["tls_key"])
    offered = {cipher["name"] for cipher in server_context(config).get_ciphers()}
    assert offered == {
        "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
        "TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256",
    }


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["1.2", "1.3"])
@pytest.mark.parametrize(("client_cert", "alert"), [
    ("none", ("handshake failure", "certificate required")),
    ("from-another-ca", ("unknown ca",)),
    ("expired", ("certificate expired",)),
])
def test_tls_when_mtls_handshake_fails_then_client_is_told_why_by_an_alert(
        start_sidecar: StartSidecar, ca: trustme.CA, server_files: dict[str, str], version: ssl.TLSVersion,
        client_cert: str, alert: tuple[str, ...]) -> None:
    """Not a vanished connection: the alert names the fault, as nginx sends it."""
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"],
                            tls_client_ca=server_files["ca"])
    client = tls_client_context(ca)
    client.maximum_version = version
    now = datetime.datetime.now(datetime.UTC)
    if client_cert == "from-another-ca":
        trustme.CA().issue_cert("client@example.com").configure_cert(client)
    elif client_cert == "expired":
        ca.issue_cert("client@example.com", not_before=now - datetime.timedelta(days=30),
                      not_after=now - datetime.timedelta(days=1)).configure_cert(client)
    with pytest.raises(ssl.SSLError) as refused, connect(sidecar.port, ssl_context=client) as sock:
        # TLS 1.3 checks the client's certificate after the client's side of the
        # handshake is done: the alert is what its first read gets.
        sock.sendall(request_bytes("GET", "/models/v1/models"))
        sock.recv(100)
    assert "alert" in str(refused.value).lower() and any(a in str(refused.value).lower().replace("_", " ")
                                                         for a in alert), refused.value
