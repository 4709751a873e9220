"""TLS termination with trustme certificates: streams, old protocols refused, mTLS, reload."""

from __future__ import annotations

import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from clients import ResponseReader, chat_body, connect, read_response, request_bytes
from processes import spawn
from upstreams import FakeUpstream


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_files(tmp_path: Path, ca: trustme.CA) -> dict[str, str]:
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    for blob in cert.cert_chain_pems:
        with open(cert_path, "ab") as file:
            file.write(blob.bytes())
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    return {"tls_cert": str(cert_path), "tls_key": str(key_path), "ca": str(ca_path)}


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def _stream_over_tls(port: int, context: ssl.SSLContext) -> bytes:
    with connect(port, ssl_context=context) as sock:
        assert isinstance(sock, ssl.SSLSocket)
        assert sock.selected_alpn_protocol() in (None, "http/1.1")
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body()))
        response = read_response(sock)
    assert response.status == 200 and response.clean_end
    return response.body


def test_tls_client_gets_the_stream(start_sidecar, ca: trustme.CA, server_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"])
    context = client_context(ca)
    context.set_alpn_protocols(["http/1.1"])
    assert b"data: [DONE]" in _stream_over_tls(sidecar.port, context)


def test_echo_sees_https_as_forwarded_proto(
        start_sidecar, ca: trustme.CA, server_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"])
    with connect(sidecar.port, ssl_context=client_context(ca)) as sock:
        sock.sendall(request_bytes("GET", "/echo/"))
        assert read_response(sock).json()["headers"]["x-forwarded-proto"] == "https"


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_tls_1_1_is_refused(start_sidecar, server_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    context.minimum_version = ssl.TLSVersion.TLSv1_1
    context.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError):
        connect(sidecar.port, ssl_context=context)


def test_mtls_refuses_a_client_without_a_certificate(start_sidecar, ca: trustme.CA,
                                                      server_files: dict[str, str]) -> None:
    sidecar = start_sidecar(tls_cert=server_files["tls_cert"], tls_key=server_files["tls_key"],
                            tls_client_ca=server_files["ca"])
    refused = False
    try:
        with connect(sidecar.port, ssl_context=client_context(ca)) as sock:
            # TLS 1.3 reports a missing client certificate after the handshake, on first read.
            sock.sendall(request_bytes("GET", "/models/v1/models"))
            refused = read_response(sock).status == 0
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        refused = True
    assert refused
    context = client_context(ca)
    ca.issue_cert("client@example.com").configure_cert(context)
    with connect(sidecar.port, ssl_context=context) as sock:
        sock.sendall(request_bytes("GET", "/models/v1/models"))
        assert read_response(sock).status == 200


@pytest.fixture
def fresh_ca() -> Iterator[trustme.CA]:
    yield trustme.CA()


@pytest.mark.slow
def test_sighup_reloads_the_certificate_while_an_open_stream_continues(
        upstream: FakeUpstream, ca: trustme.CA, fresh_ca: trustme.CA, server_files: dict[str, str]) -> None:
    process = spawn(["--upstream", upstream.url, "--tls-cert", server_files["tls_cert"],
                     "--tls-key", server_files["tls_key"]])
    try:
        sock = connect(process.port, ssl_context=client_context(ca))
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": "1.0"}))
        reader = ResponseReader(sock)
        assert reader.read(head_only=True).status == 200
        # Replace the files with a certificate from another CA, then SIGHUP.
        new_cert = fresh_ca.issue_cert("localhost", "127.0.0.1")
        Path(server_files["tls_cert"]).write_bytes(b"".join(b.bytes() for b in new_cert.cert_chain_pems))
        new_cert.private_key_pem.write_to_path(server_files["tls_key"])
        process.signal(signal.SIGHUP)
        deadline_ok = False
        for _ in range(50):
            try:
                _stream_over_tls(process.port, client_context(fresh_ca))
                deadline_ok = True
                break
            except ssl.SSLError:
                time.sleep(0.05)
        assert deadline_ok, "the new certificate was never served"
        with pytest.raises(ssl.SSLError):
            connect(process.port, ssl_context=client_context(ca))
        rest = reader.read()
        assert rest.clean_end and rest.datas()[-1] == "[DONE]"
        sock.close()
    finally:
        assert process.stop() == 0
