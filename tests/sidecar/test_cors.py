"""CORS on the proxy port: preflights answered by the sidecar, headers on proxied answers."""

from __future__ import annotations

import pytest
from clients import ResponseReader, chat_body, connect, exchange, request_bytes
from tokenwire.middleware import ConfigError
from tokenwire.sidecar.downstream import cors
from tokenwire.sidecar.settings import build_config
from upstreams import FakeUpstream

from tokenwire.tools.cli import load_sidecar_config

PAGE = "http://127.0.0.1:8081"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type"}


def test_preflight_from_allowed_origin_then_answered_204_without_reaching_the_upstream(
        start_sidecar, upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(cors_allow_origins=(PAGE,))
    seen = len(upstream.requests)
    response = exchange(sidecar.port, "OPTIONS", "/normal/v1/chat/completions", headers=PREFLIGHT)
    assert response.status == 204 and response.clean_end
    headers = response.headers
    assert headers["access-control-allow-origin"] == PAGE
    assert "POST" in headers["access-control-allow-methods"]
    allowed = {name.strip() for name in headers["access-control-allow-headers"].split(",")}
    assert {"content-type", "authorization", "last-event-id", "idempotency-key", "x-request-id"} <= allowed
    assert int(headers["access-control-max-age"]) > 0
    assert len(upstream.requests) == seen


def test_preflight_from_other_origin_then_refused_403_without_cors_headers(start_sidecar,
                                                                    upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(cors_allow_origins=(PAGE,))
    seen = len(upstream.requests)
    response = exchange(sidecar.port, "OPTIONS", "/normal/v1/chat/completions",
                        headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert response.status == 403
    assert not any(name.startswith("access-control-") for name in response.headers)
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(upstream.requests) == seen


def test_streamed_answer_for_allowed_origin_carries_allow_and_expose_headers(start_sidecar) -> None:
    sidecar = start_sidecar(cors_allow_origins=(PAGE,))
    response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                        headers={"Origin": PAGE, "X-Request-Id": "cors-1"})
    assert response.status == 200 and response.datas()[-1] == "[DONE]"
    assert response.headers["access-control-allow-origin"] == PAGE
    exposed = {name.strip() for name in response.headers["access-control-expose-headers"].split(",")}
    assert exposed == {"x-request-id", "x-tokenwire-stream-id"}
    assert "origin" in response.headers["vary"].lower()
    other = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                     headers={"Origin": "http://evil.example"})
    # Still proxied (CORS guards the reader), but the browser will not hand it to that page.
    assert other.status == 200 and "access-control-allow-origin" not in other.headers


def test_plain_answer_models_for_allowed_origin_carries_allow_origin(start_sidecar) -> None:
    sidecar = start_sidecar(cors_allow_origins=("*",))
    response = exchange(sidecar.port, "GET", "/models/v1/models", headers={"Origin": "http://any.example:3000"})
    assert response.status == 200 and response.json()["data"][0]["id"] == "fake"
    assert response.headers["access-control-allow-origin"] == "http://any.example:3000"


def test_preflight_then_request_on_one_keep_alive_connection_both_served(start_sidecar) -> None:
    sidecar = start_sidecar(cors_allow_origins=(PAGE,))
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("OPTIONS", "/normal/v1/chat/completions", headers=PREFLIGHT))
        first = ResponseReader(sock)
        assert first.read().status == 204
        sock.sendall(request_bytes("POST", "/normal/v1/chat/completions", body=chat_body(),
                                   headers={"Origin": PAGE}))
        second = ResponseReader(sock, buffered=first.trailing).read()
    assert second.status == 200 and second.datas()[-1] == "[DONE]"
    assert second.headers["access-control-allow-origin"] == PAGE


def test_without_cors_configured_options_is_forwarded_and_no_headers_added(start_sidecar) -> None:
    sidecar = start_sidecar()
    response = exchange(sidecar.port, "OPTIONS", "/echo/v1/chat/completions", headers=PREFLIGHT)
    # The engine answers its own preflights when the sidecar has no CORS policy.
    assert response.status == 200 and response.json()["method"] == "OPTIONS"
    assert "access-control-allow-origin" not in response.headers


# ---------------------------------------------------------------- the pure functions


@pytest.mark.parametrize(("allowed", "origin", "expected"), [
    ((PAGE,), PAGE.encode(), True),
    ((PAGE,), b"HTTP://127.0.0.1:8081", True),
    ((PAGE,), b"http://127.0.0.1:8082", False),
    ((PAGE,), None, False),
    (("*",), b"http://anything", True),
    ((), PAGE.encode(), False),
])
def test_origin_allowed(allowed: tuple[str, ...], origin: bytes | None, expected: bool) -> None:
    assert cors.origin_allowed(allowed, origin) is expected


def test_with_cors_headers_drops_the_upstreams_own_cors_headers() -> None:
    upstream = [(b"content-type", b"text/event-stream"), (b"access-control-allow-origin", b"*")]
    headers = cors.with_cors_headers(upstream, (PAGE,), PAGE.encode())
    assert [v for k, v in headers if k == b"access-control-allow-origin"] == [PAGE.encode()]
    assert cors.with_cors_headers(upstream, (), PAGE.encode()) == upstream


def test_is_preflight_needs_origin_and_request_method() -> None:
    assert cors.is_preflight(b"OPTIONS", [(b"origin", b"x"), (b"access-control-request-method", b"POST")])
    assert not cors.is_preflight(b"OPTIONS", [(b"origin", b"x")])
    assert not cors.is_preflight(b"GET", [(b"origin", b"x"), (b"access-control-request-method", b"POST")])


# ---------------------------------------------------------------- configuration


def test_config_repeated_flag_env_and_toml() -> None:
    config = load_sidecar_config(["--upstream", "http://a:1", "--cors-allow-origin", "http://A:1/",
                                  "--cors-allow-origin", "https://b"], {})
    assert config.cors_allow_origins == ("http://a:1", "https://b")
    config = load_sidecar_config(["--upstream", "http://a:1"],
                                 {"TOKENWIRE_CORS_ALLOW_ORIGINS": "http://a:1, http://b:2"})
    assert config.cors_allow_origins == ("http://a:1", "http://b:2")
    config = build_config(flags={"upstream": ["http://a:1"]}, file_values={"cors_allow_origins": ["*"]})
    assert config.cors_allow_origins == ("*",)


@pytest.mark.parametrize("origin", ["127.0.0.1:8081", "http://h/path", "ftp://h", "http://"])
def test_config_bad_origin_names_the_key(origin: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_config(flags={"upstream": ["http://a:1"], "cors_allow_origins": [origin]})
    assert error.value.key == "cors_allow_origins"
