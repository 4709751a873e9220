"""Per-request wire settings (middleware/core/client_settings.py): a request's
``Tokenwire-…`` headers, accepted inside the operator's ``client_settings``."""

from __future__ import annotations

import pytest
from tokenwire.middleware import ClientError, ConfigError, WireConfig
from tokenwire.middleware.core import client_settings
from tokenwire.middleware.core.config import SlowClientPolicy

RESUMING = WireConfig(resume=True, resume_grace_s=5.0)


def test_settings_inside_the_bounds_are_applied_and_not_sent_upstream() -> None:
    headers = [(b"tokenwire-heartbeat-s", b"5"), (b"content-type", b"application/json"),
               (b"tokenwire-write-deadline-s", b" 60 "), (b"tokenwire-summary", b"true")]
    config, applied, kept = client_settings.apply(RESUMING, headers)
    assert (config.heartbeat_s, config.write_deadline_s) == (5.0, 60.0)
    assert applied == "heartbeat_s=5.0,write_deadline_s=60.0"
    # The summary header is not a setting: it goes on to the core (and upstream) as before.
    assert kept == [(b"content-type", b"application/json"), (b"tokenwire-summary", b"true")]
    assert config.resume_grace_s == RESUMING.resume_grace_s  # what was not asked stays


@pytest.mark.parametrize(("value", "grace_s"), [(b"true", 600.0), (b"false", 0.0), (b"30", 30.0)])
def test_keep_generating_sets_the_grace_within_its_bound(value: bytes, grace_s: float) -> None:
    config, applied, _ = client_settings.apply(RESUMING, [(b"tokenwire-keep-generating", value)])
    assert config.resume_grace_s == grace_s and applied == f"keep_generating_s={grace_s}"


def test_a_responses_background_request_keeps_generating_where_resume_is_on() -> None:
    def grace_s(body: bytes | None, dialect: str = "responses") -> float:
        return client_settings.for_request(RESUMING, [], body, dialect)[0].resume_grace_s

    assert grace_s(b'{"model": "m", "background": true, "stream": true}') == 600.0
    for body in (b'{"background": "yes"}', b"{", b'{"background": false}', None):
        assert grace_s(body) == RESUMING.resume_grace_s
    assert grace_s(b'{"background": true}', "chat.completions") == RESUMING.resume_grace_s
    config, applied, _ = client_settings.apply(RESUMING, [], background=True)
    assert config.resume_grace_s == 600.0 and applied == "keep_generating_s=600.0"
    # Without resume, background is the engine's own business: nothing applied, nothing refused.
    config, applied, _ = client_settings.apply(WireConfig(), [], background=True)
    assert config == WireConfig() and applied == ""
    # Where the operator allows no keep-generating, background is served as any request, never refused.
    for bounds in ((), ("keep_generating_s=0..0",)):
        strict = RESUMING.replace(client_settings=bounds)
        config, applied, _ = client_settings.apply(strict, [], background=True)
        assert config.resume_grace_s == strict.resume_grace_s and applied == ""
    # Asking for nothing to be kept is no mistake where nothing is.
    assert client_settings.apply(WireConfig(), [(b"tokenwire-keep-generating", b"false")])[1] == ""
    # The header says otherwise: the header wins.
    stop = [(b"tokenwire-keep-generating", b"false")]
    config, _, _ = client_settings.apply(RESUMING, stop, background=True)
    assert config.resume_grace_s == 0.0


@pytest.mark.parametrize(("config", "header", "says"), [
    (RESUMING, (b"tokenwire-heartbeat-s", b"0.5"), "outside what this server allows (1..60 seconds)"),
    (RESUMING, (b"tokenwire-heartbeat-s", b"nan"), "outside"),
    (RESUMING, (b"tokenwire-heartbeat-s", b"soon"), "outside"),
    (RESUMING, (b"tokenwire-keep-generating", b"601"), "0..600"),
    (RESUMING, (b"tokenwire-slow-client-policy", b"drop"), "not a setting this server lets a request choose"),
    (RESUMING, (b"tokenwire-heartbeat", b"5"), "unknown header 'tokenwire-heartbeat'"),
    (WireConfig(), (b"tokenwire-keep-generating", b"true"), "resume is off"),
    (RESUMING.replace(client_settings=("keep_generating_s=0..0",)), (b"tokenwire-keep-generating", b"true"),
     "does not keep answers generating"),
])
def test_a_setting_outside_the_bounds_is_a_400_naming_the_header(
        config: WireConfig, header: tuple[bytes, bytes], says: str) -> None:
    with pytest.raises(ClientError) as refused:
        client_settings.apply(config, [header])
    assert refused.value.http_status == 400 and says in str(refused.value)
    assert header[0].decode() in str(refused.value)


def test_the_policy_when_the_operator_allows_it() -> None:
    config = RESUMING.replace(client_settings=("slow_client_policy=coalesce|block",))
    chosen, _, _ = client_settings.apply(config, [(b"tokenwire-slow-client-policy", b"block")])
    assert chosen.slow_client_policy is SlowClientPolicy.BLOCK
    with pytest.raises(ClientError, match=r"one of coalesce\|block"):
        client_settings.apply(config, [(b"tokenwire-slow-client-policy", b"drop")])


@pytest.mark.parametrize("spec", ["heartbeat=1..5", "heartbeat_s=5..1", "heartbeat_s=1", "heartbeat_s=a..b",
                                  "slow_client_policy=fast", "write_deadline_s=-1..5"])
def test_bounds_that_do_not_parse_are_refused_at_start_up(spec: str) -> None:
    with pytest.raises(ConfigError, match="client_settings"):
        WireConfig(client_settings=(spec,))


def test_asks_is_false_for_requests_without_settings() -> None:
    assert not client_settings.asks([(b"content-type", b"x"), (b"tokenwire-summary", b"1")])
    assert client_settings.asks([(b"tokenwire-heartbeat-s", b"1")])


def test_through_the_middleware_a_refused_setting_is_a_400_and_the_app_never_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    """On a real uvicorn: the app is the upstream, so a refusal must come before it runs."""
    import logging

    from tokenwire.middleware import TokenWireMiddleware

    from .asgi_apps import joined_text, open_request, read_response, running_server
    from .test_asgi_openai import chat_app

    ran: list[str] = []
    seen_headers: list[bytes] = []
    inner = chat_app(None)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        ran.append(scope.get("path", ""))
        seen_headers.extend(name for name, _ in scope["headers"])
        await inner(scope, receive, send)

    caplog.set_level(logging.INFO, logger="tokenwire.middleware")
    with running_server(TokenWireMiddleware(app), "uvicorn-h11") as port:
        for value, status in (("0.01", 400), ("2", 200)):
            body = b'{"messages": [{"role": "user", "content": "w"}]}'
            sock = open_request(port, "/v1/chat/completions", method="POST", body=body,
                                headers=(("Tokenwire-Heartbeat-S", value),
                                         ("Content-Type", "application/json")))
            try:
                response = read_response(sock)
            finally:
                sock.close()
            assert response.status == status, response.body
    assert ran == ["/v1/chat/completions"]  # the refused one never reached the app
    assert b"content-type" in seen_headers and b"tokenwire-heartbeat-s" not in seen_headers
    assert joined_text(response.body)
    ended = [r for r in caplog.records if r.getMessage().startswith("stream ended")]
    assert [r.__dict__["fields"].get("client_settings") for r in ended][-1] == "heartbeat_s=2.0"
