"""``send_response_head`` writes exactly what h11 writes, and leaves the
connection in exactly the state h11 leaves it, for any response."""

from __future__ import annotations

from pathlib import Path

import h11
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire.sidecar.downstream.h11_layout import H11_TESTED, send_response_head

Header = tuple[bytes, bytes]

_HEADERS: list[Header] = [
    (b"content-type", b"text/event-stream"), (b"Content-Type", b"application/json"),
    (b"cache-control", b"no-cache"), (b"date", b"Tue, 01 Dec 2026 04:00:00 GMT"),
    (b"x-request-id", b"0123456789abcdef"), (b"X-Accel-Buffering", b"no"),
    (b"content-length", b"5"), (b"Content-Length", b"0"), (b"transfer-encoding", b"chunked"),
    (b"connection", b"close"), (b"Connection", b"keep-alive"), (b"host", b"example"),
    (b"vary", b"origin"), (b"access-control-allow-origin", b"https://a.example"),
]


def _connection(method: bytes, version: bytes, extra: list[Header]) -> h11.Connection:
    conn = h11.Connection(h11.SERVER)
    lines = [b"%s /v1/chat/completions HTTP/%s" % (method, version), b"host: sidecar"]
    lines += [b"%s: %s" % header for header in extra]
    conn.receive_data(b"\r\n".join(lines) + b"\r\n\r\n")
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    return conn


def _outcome(send: object) -> tuple[str, object]:
    try:
        return "ok", send() if callable(send) else send
    except h11.LocalProtocolError as error:
        return "error", str(error)


@settings(max_examples=400, deadline=None)
@given(method=st.sampled_from([b"GET", b"POST", b"HEAD"]),
       version=st.sampled_from([b"1.0", b"1.1"]),
       request_extra=st.lists(st.sampled_from([(b"connection", b"close"), (b"connection", b"keep-alive")]),
                              max_size=1),
       status=st.sampled_from([200, 201, 204, 304, 404, 500, 502, 503]),
       headers=st.lists(st.sampled_from(_HEADERS), max_size=8),
       body=st.sampled_from([b"", b"hello", b"data: x\n\n"]))
def test_response_head_is_h11s_own_bytes_and_state(method: bytes, version: bytes, request_extra: list[Header],
                                              status: int, headers: list[Header], body: bytes) -> None:
    by_h11 = _connection(method, version, request_extra)
    ours = _connection(method, version, request_extra)
    expected = _outcome(lambda: by_h11.send(h11.Response(status_code=status, headers=list(headers))))
    got = _outcome(lambda: send_response_head(ours, status, list(headers)))
    assert got == expected
    assert (ours.our_state, ours.their_state) == (by_h11.our_state, by_h11.their_state)
    if expected[0] != "ok":
        return
    for event in ([h11.Data(data=body)] if body else []) + [h11.EndOfMessage()]:
        assert _outcome(lambda e=event: ours.send(e)) == _outcome(lambda e=event: by_h11.send(e))
        assert (ours.our_state, ours.their_state) == (by_h11.our_state, by_h11.their_state)


def test_response_head_still_refuses_an_invalid_header() -> None:
    for bad in [(b"x-bad", b"a\r\nb"), (b"bad name", b"v"), (b"x-nul", b"a\x00b")]:
        conn = _connection(b"POST", b"1.1", [])
        headers = [(b"content-type", b"x"), bad]
        assert _outcome(lambda c=conn, h=headers: send_response_head(c, 200, h))[0] == "error"


def test_the_installed_h11_is_the_version_its_byte_layout_was_checked_against() -> None:
    """h11_layout writes some of h11's bytes itself: the pin in pyproject.toml,
    the installed h11 and H11_TESTED must name the same minor version."""
    installed = tuple(int(part) for part in h11.__version__.split(".")[:2])
    assert installed == H11_TESTED
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    major, minor = H11_TESTED
    assert f'"h11>={major}.{minor},<{major}.{minor + 1}"' in pyproject
