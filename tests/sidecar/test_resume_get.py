"""A browser EventSource's own reconnect of a GET stream: resumed from the
replay store, never generated a second time (real sockets, in-memory store)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conftest import RunningSidecar
from resume_client import open_stream
from test_resume import text_of
from upstreams import FakeUpstream, expected_text

PATH = "/live/events"  # a GET event stream of no known dialect: passed exactly


def get(sidecar: RunningSidecar, request_id: str, **kwargs: Any) -> Any:
    headers = {"Accept": "text/event-stream", "x-fake-tokens": "30", "x-fake-delay-s": "0.005",
               "x-request-id": request_id, **kwargs.pop("headers", {})}
    return open_stream(sidecar.port, "GET", PATH, headers=headers, **kwargs)


def test_a_get_stream_reconnected_with_last_event_id_is_resumed_not_generated_again(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True, resume_grace_s=10.0)
    first = get(sidecar, "get-1", stop_after=5)
    assert first.status == 200 and len(first.ids) == 5
    again = get(sidecar, "get-1", headers={"Last-Event-ID": first.ids[-1]})
    assert again.status == 200 and again.clean_end
    last_seq = int(first.ids[-1].rpartition(".")[2])
    assert [int(i.rpartition(".")[2]) for i in again.ids][:1] == [last_seq + 1]
    assert text_of(first.data_events + again.data_events) == expected_text(30)
    assert len(upstream.requests_with("get-1")) == 1


def test_a_get_with_an_unknown_last_event_id_is_refused_and_generates_nothing(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar(resume=True)
    refused = get(sidecar, "get-2", headers={"Last-Event-ID": "AAAAAAAAAAAAAAAAAAAAAA.3"})
    assert refused.status == 404
    assert upstream.requests_with("get-2") == []
    malformed = get(sidecar, "get-3", headers={"Last-Event-ID": "not an id"})
    assert malformed.status == 400
    assert upstream.requests_with("get-3") == []
