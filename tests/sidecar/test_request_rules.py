"""The request rules both HTTP versions share (sidecar/downstream/request_rules.py),
as pure functions; the sockets' side is the payload corpus and test_http2_attacks.py."""

from __future__ import annotations

import pytest
from tokenwire.sidecar.downstream.request_rules import has_dot_segment, valid_host


@pytest.mark.parametrize(("target", "found"), [
    (b"/v1/chat/completions", False),
    (b"/v1/models/a..b/.well", False),
    (b"/v1/x?next=../../etc", False),  # the query is not the path
    (b"/v1/../x", True),
    (b"/v1/.", True),
    (b"/v1/%2E%2E/x", True),  # upper case only: no plain dot to find first
    (b"/v1/%2e/x", True),
    (b"/v1/..%2fx", True),
    (b"/v1/..%5Cx", True),
    (b"/v1\\..\\x", True),
])
def test_has_dot_segment(target: bytes, found: bool) -> None:
    assert has_dot_segment(target) is found


@pytest.mark.parametrize(("host", "valid"), [
    (b"127.0.0.1:8080", True), (b"[::1]:8080", True), (b"api.example.com", True),
    (b"", False), (b"a/b", False), (b"user@evil", False), (b"x, y", False), (b"a?b", False), (b"a#b", False),
])
def test_valid_host(host: bytes, valid: bool) -> None:
    assert valid_host(host) is valid
