"""Issue 19's second pass through the sidecar, over real sockets: streams belong to
their caller, the admin port asks for its token, and a client's request id is
never the key of an engine abort."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from clients import ResponseReader, chat_body, connect, exchange, request_bytes, reset, wait_for
from conftest import LoopThread, RunningSidecar, make_config
from resume_client import SSEResponse, open_stream, resume
from tokenwire.middleware import ConfigError
from tokenwire.sidecar.downstream.cors import origins_for
from tokenwire.sidecar.process.admin import AdminAccess
from tokenwire.sidecar.process.server import Sidecar
from tokenwire.sidecar.settings import is_loopback
from tokenwire.sidecar.upstream.pools import UpstreamPools
from upstreams import FakeUpstream, expected_text

from tokenwire.tools.cli import main

PATH = "/normal/v1/chat/completions"
ALICE = {"Authorization": "Bearer sk-alice"}
MALLORY = {"Authorization": "Bearer sk-mallory"}
ADMIN_TOKEN = "admin-secret-7"


def _post(sidecar: RunningSidecar, headers: dict[str, str], *, tokens: int = 5,
          body: bytes | None = None) -> SSEResponse:
    return open_stream(sidecar.port, "POST", PATH, body=body if body is not None else chat_body(),
                       headers={"x-fake-tokens": str(tokens), **headers})


def _text(response: SSEResponse) -> str:
    parts = []
    for event in response.data_events:
        if event.data and event.data != "[DONE]":
            for choice in json.loads(event.data).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


# ---------------------------------------------------------------- streams belong to their caller


@pytest.mark.parametrize("other", [MALLORY, {}], ids=["another-credential", "no-credential"])
def test_resume_by_another_caller_is_the_same_404_as_an_unknown_stream(
        start_sidecar: Callable[..., RunningSidecar], other: dict[str, str]) -> None:
    sidecar = start_sidecar(resume=True)
    first = _post(sidecar, {**ALICE, "x-request-id": "owned-1"})
    stream_id = first.stream_id
    unknown = exchange(sidecar.port, "GET", "/v1/streams/NoSuchStreamAtAll", headers=other)
    for last_event_id in (None, first.ids[2]):
        headers = {**other, **({"Last-Event-ID": last_event_id} if last_event_id else {})}
        stolen = exchange(sidecar.port, "GET", f"/v1/streams/{stream_id}", headers=headers)
        assert stolen.status == 404 == unknown.status
        assert stolen.json()["error"]["code"] == unknown.json()["error"]["code"] == "stream_not_found"
        # The same body but for the id it names (a random id: a check for token text
        # must not look inside it).
        assert (stolen.body.replace(stream_id.encode(), b"ID")
                == unknown.body.replace(b"NoSuchStreamAtAll", b"ID"))
    # A re-sent POST with Last-Event-ID is a resume too.
    resent = exchange(sidecar.port, "POST", PATH, body=chat_body(),
                      headers={**other, "Last-Event-ID": first.ids[2]})
    assert resent.status == 404 and resent.json()["error"]["code"] == "stream_not_found"
    # The owner still gets it.
    mine = open_stream(sidecar.port, "GET", f"/v1/streams/{stream_id}",
                       headers={**ALICE, "Last-Event-ID": first.ids[2]})
    assert mine.status == 200 and mine.clean_end
    assert [e.data for e in mine.data_events] == [e.data for e in first.data_events][3:]
    assert _text(first) == expected_text(5)


def test_streams_without_a_credential_are_one_caller(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(resume=True)
    first = _post(sidecar, {})
    assert resume(sidecar.port, first.stream_id, None).status == 200
    # ... but a credential does not open a stream made without one.
    assert exchange(sidecar.port, "GET", f"/v1/streams/{first.stream_id}", headers=ALICE).status == 404


def test_owner_header_is_configurable(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(resume=True, resume_owner_header="x-api-key")
    first = _post(sidecar, {"x-api-key": "k-1", **ALICE})
    path = f"/v1/streams/{first.stream_id}"
    # Authorization no longer counts; x-api-key does.
    assert exchange(sidecar.port, "GET", path, headers={"x-api-key": "k-2", **ALICE}).status == 404
    assert open_stream(sidecar.port, "GET", path, headers={"x-api-key": "k-1"}).status == 200


def test_idempotency_key_is_scoped_by_caller_no_replay_and_no_422_across_callers(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True)
    key = {"Idempotency-Key": "order-77"}
    first = _post(sidecar, {**ALICE, **key, "x-request-id": "idem-alice"})
    assert first.clean_end and len(upstream.requests_with("idem-alice")) == 1
    # Same key, same body, another caller: its own generation, not Alice's answer.
    theirs = _post(sidecar, {**MALLORY, **key, "x-request-id": "idem-mallory"})
    assert theirs.clean_end and theirs.stream_id != first.stream_id
    assert len(upstream.requests_with("idem-mallory")) == 1
    # Same key, another body, a third caller: no 422 (that would say the key exists).
    other_body = _post(sidecar, {**key, "x-request-id": "idem-anon"}, body=chat_body(temperature=0.5))
    assert other_body.status == 200 and len(upstream.requests_with("idem-anon")) == 1
    # Alice herself: the replay, and the 422 for another body.
    again = _post(sidecar, {**ALICE, **key, "x-request-id": "idem-alice-2"})
    assert again.stream_id == first.stream_id and upstream.requests_with("idem-alice-2") == []
    assert [e.data for e in again.data_events] == [e.data for e in first.data_events]
    reused = exchange(sidecar.port, "POST", PATH, body=chat_body(temperature=0.5),
                      headers={**ALICE, **key})
    assert reused.status == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"


def test_streams_list_shows_no_stream_id(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(resume=True)
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": "30", "X-Request-Id": "listed-1"}))
        head = ResponseReader(sock).read(head_only=True)
        assert head.status == 200
        stream_id = head.headers["x-tokenwire-stream-id"]
        listing = httpx.get(sidecar.admin_url + "/streams")
        (entry,) = listing.json()
        assert entry["request_id"] == "listed-1" and entry["resumable"] is True
        assert re.fullmatch(r"[0-9a-f]{32}", entry["upstream_request_id"])
        assert stream_id not in listing.text
        # The unique upstream id names the stream for a cancel too.
        assert httpx.delete(f"{sidecar.admin_url}/streams/{entry['upstream_request_id']}").status_code == 200


# ---------------------------------------------------------------- the admin token


def test_admin_token_guards_everything_but_the_probes_and_the_page(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(admin_token=ADMIN_TOKEN)
    good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for path in ("/healthz", "/readyz", "/"):
        assert httpx.get(sidecar.admin_url + path).status_code == 200, path
    for path in ("/metrics", "/streams"):
        refused = httpx.get(sidecar.admin_url + path)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(sidecar.admin_url + path, headers=MALLORY).status_code == 401
        assert httpx.get(sidecar.admin_url + path, headers=good).status_code == 200
    with connect(sidecar.port) as sock:
        sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                   headers={"x-fake-silence-s": "30", "X-Request-Id": "victim-1"}))
        reader = ResponseReader(sock)
        assert reader.read(head_only=True).status == 200
        # Cancelling another's stream takes the admin token.
        assert httpx.delete(sidecar.admin_url + "/streams/victim-1").status_code == 401
        assert httpx.delete(sidecar.admin_url + "/streams/victim-1", headers=MALLORY).status_code == 401
        assert [s["request_id"] for s in httpx.get(sidecar.admin_url + "/streams", headers=good).json()] \
            == ["victim-1"]
        assert httpx.delete(sidecar.admin_url + "/streams/victim-1", headers=good).status_code == 200
        rest = reader.read()
    assert json.loads(rest.datas()[-1])["error"]["code"] == "cancelled"


def test_metrics_public_opens_only_metrics(start_sidecar: Callable[..., RunningSidecar]) -> None:
    sidecar = start_sidecar(admin_token=ADMIN_TOKEN, metrics_public=True)
    assert httpx.get(sidecar.admin_url + "/metrics").status_code == 200
    assert httpx.get(sidecar.admin_url + "/streams").status_code == 401


def test_non_loopback_admin_without_token_refuses_to_start_naming_the_flag(
        upstream: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        make_config(upstream.url, admin_listen="0.0.0.0:0")
    assert refused.value.key == "admin_token" and "--admin-token-file" in str(refused.value)
    assert main(["sidecar", "--upstream", upstream.url, "--admin-listen", "0.0.0.0:0"]) == 2
    error = capsys.readouterr().err
    assert "configuration error" in error and "--admin-token" in error and "127.0.0.1" in error
    # Loopback needs none; a token (or its file) lets any address through.
    make_config(upstream.url, admin_listen="127.0.0.1:0")
    make_config(upstream.url, admin_listen="[::1]:0")
    make_config(upstream.url, admin_listen="0.0.0.0:0", admin_token=ADMIN_TOKEN)


def test_admin_token_file_is_read_at_start(
        loop_thread: LoopThread, upstream: FakeUpstream, tmp_path: Any) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {ADMIN_TOKEN}\n")
    sidecar = Sidecar(make_config(upstream.url, admin_listen="0.0.0.0:0", admin_token_file=str(token_file),
                                  log_file=""))
    loop_thread.run(sidecar.start())
    try:
        admin = sidecar.admin_address
        assert admin is not None
        url = f"http://127.0.0.1:{admin[1]}/streams"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
    finally:
        loop_thread.run(sidecar.shutdown())
    token_file.write_text("")
    empty = Sidecar(make_config(upstream.url, admin_listen="0.0.0.0:0", admin_token_file=str(token_file)))
    with pytest.raises(ConfigError, match="admin_token_file"):
        loop_thread.run(empty.start())


# ---------------------------------------------------------------- request ids and the abort call


def test_abort_call_uses_the_sidecars_own_id_and_the_client_keeps_its_own(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(abort_url=upstream.url + "/abort/{request_id}")
    sock = connect(sidecar.port)
    sock.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                               headers={"x-fake-silence-s": "30", "X-Request-Id": "a?admin=1#frag"}))
    head = ResponseReader(sock).read(head_only=True)
    assert head.status == 200 and head.headers["x-request-id"] == "a?admin=1#frag"
    (seen,) = upstream.requests_with("a?admin=1#frag")
    minted = seen.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", minted)
    reset(sock)
    wait_for(lambda: any(r.path == f"/abort/{minted}" for r in upstream.requests))
    assert not any("admin=1" in r.path for r in upstream.requests)
    assert sidecar.record("a?admin=1#frag").end_reason == "client_gone"


def test_a_client_sent_request_id_cannot_abort_anothers_generation(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(abort_url=upstream.url + "/abort/{request_id}")
    with connect(sidecar.port) as victim:
        victim.sendall(request_bytes("POST", PATH, body=chat_body(), headers={
            "x-fake-tokens": "30", "x-fake-delay-s": "0.03", "X-Request-Id": "shared-id"}))
        victim_reader = ResponseReader(victim)
        assert victim_reader.read(head_only=True).status == 200
        (victim_seen,) = upstream.requests_with("shared-id")
        attacker = connect(sidecar.port)
        attacker.sendall(request_bytes("POST", "/silent/v1/chat/completions", body=chat_body(),
                                       headers={"x-fake-silence-s": "30", "X-Request-Id": "shared-id"}))
        assert ResponseReader(attacker).read(head_only=True).status == 200
        attacker_seen = upstream.requests_with("shared-id")[-1]
        reset(attacker)
        attacker_abort = f"/abort/{attacker_seen.headers['x-request-id']}"
        wait_for(lambda: any(r.path == attacker_abort for r in upstream.requests))
        finished = victim_reader.read()
    # The victim's answer is whole, and no abort ever named its upstream id.
    assert finished.clean_end and finished.datas()[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in finished.datas()[:-1] if json.loads(d).get("choices")) == expected_text(30)
    assert victim_seen.headers["x-request-id"] != attacker_seen.headers["x-request-id"]
    assert not any(r.path == f"/abort/{victim_seen.headers['x-request-id']}" for r in upstream.requests)


def test_abort_url_percent_encodes_the_id(loop_thread: LoopThread, upstream: FakeUpstream) -> None:
    pools = UpstreamPools(make_config(upstream.url, abort_url=upstream.url + "/abort/{request_id}"))
    before = len(upstream.requests)

    async def call() -> None:
        pools.send_abort("a?admin=1#frag /x")
        for _ in range(500):
            if len(upstream.requests) > before:
                break
            await asyncio.sleep(0.01)
        await pools.aclose()

    loop_thread.run(call())
    assert upstream.requests[-1].path == "/abort/a%3Fadmin%3D1%23frag%20%2Fx"


# ---------------------------------------------------------------- the pure rules


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("localhost", True), ("LocalHost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("box.example", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("access", "path", "authorization", "allowed"), [
    (AdminAccess(), "/streams", None, True),  # no token: open (loopback only)
    (AdminAccess("t"), "/streams", None, False),
    (AdminAccess("t"), "/streams", b"Bearer t", True),
    (AdminAccess("t"), "/streams", b"bearer  t ", True),
    (AdminAccess("t"), "/streams", b"Bearer t2", False),
    (AdminAccess("t"), "/streams", b"Basic t", False),
    (AdminAccess("t"), "/streams", b"t", False),
    (AdminAccess("t"), "/streams/abc", b"", False),
    (AdminAccess("t"), "/metrics", None, False),
    (AdminAccess("t", metrics_public=True), "/metrics", None, True),
    (AdminAccess("t", metrics_public=True), "/streams", None, False),
    (AdminAccess("t"), "/healthz", None, True),
    (AdminAccess("t"), "/readyz", None, True),
    (AdminAccess("t"), "/", None, True),
])
def test_admin_access(access: AdminAccess, path: str, authorization: bytes | None, allowed: bool) -> None:
    assert access.allows(path, authorization) is allowed


OWN = ("http://127.0.0.1:9090", "http://localhost:9090")


@pytest.mark.parametrize(("configured", "origin", "expected"), [
    ((), b"http://127.0.0.1:9090", OWN),  # the playground, on a plain sidecar
    ((), b"http://127.0.0.1:9091", ()),  # any other origin: left to the engine, as without CORS
    ((), None, ()),
    (("http://app.example",), b"http://app.example", ("http://app.example", *OWN)),
    (("http://app.example",), None, ("http://app.example", *OWN)),
])
def test_cors_origins_for(configured: tuple[str, ...], origin: bytes | None,
                        expected: tuple[str, ...]) -> None:
    assert origins_for(configured, OWN, origin) == expected
