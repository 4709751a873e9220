"""``Finished`` builds its record when first read: the record is still the
one as of the input that finished the stream, whatever the driver did between."""

from __future__ import annotations

import dataclasses

import pytest
from tokenwire.middleware import (
    AbortUpstream,
    ClientGone,
    EndReason,
    Finished,
    SocketPaused,
    Tick,
    UpstreamData,
    UpstreamEnded,
    WriteCompleted,
)

from .wire_harness import Driver, chunk, event

DONE = "[DONE]"


def _gone_at(at: float) -> tuple[Driver, Finished]:
    d = Driver(now=0.0)
    d.sse_headers(at=0.1)
    d.send(event(chunk("a")), at=0.2)
    d.send(SocketPaused(), at=0.3)
    d.send(event(chunk("b")), at=0.4)  # pending: the client left before it was written
    actions = d.send(ClientGone(), at=at)
    assert any(isinstance(a, AbortUpstream) for a in actions)
    return d, d.finished


def test_finished_when_read_after_later_inputs_then_the_record_is_as_of_the_finishing_input() -> None:
    d, finished = _gone_at(5.0)
    expected = d.stream.record(5.0)
    # What a driver may still feed once the stream is over changes nothing.
    for late, at in ((Tick(), 9.0), (UpstreamData(b"data: x\n\n"), 9.5), (WriteCompleted(), 9.6),
                     (UpstreamEnded(), 9.7)):
        assert d.stream.handle(late, at) == []
    assert d.stream.data_to_send(10.0) == b""
    assert d.stream.forward_read(b"data: y\n\n", 10.0) is None
    record = finished.record
    assert record == expected
    assert record.duration_s == pytest.approx(5.0)
    assert record.end_reason is EndReason.CLIENT_GONE
    assert record.events_out == 1 and record.events_in == 2
    assert finished.record is record  # built once, then kept


def test_finished_record_as_then_the_same_record_with_the_drivers_pod() -> None:
    d, finished = _gone_at(2.0)
    as_pod = finished.record_as("http://10.0.0.7:8000")
    assert as_pod.upstream == "http://10.0.0.7:8000"
    assert as_pod == dataclasses.replace(d.stream.record(2.0), upstream="http://10.0.0.7:8000")
    # Read either way, in either order, the figures are the same.
    assert dataclasses.replace(finished.record, upstream=as_pod.upstream) == as_pod
    assert finished.record_as("other") == dataclasses.replace(as_pod, upstream="other")


def test_finished_when_given_a_record_then_it_carries_it_as_the_dataclass_did() -> None:
    d = Driver()
    d.sse_headers()
    d.send(event(chunk("a")))
    d.send(event(DONE))
    d.send(UpstreamEnded(), at=3.0)
    built = d.finished
    given = Finished(built.record)
    assert given.record is built.record
    assert given == built and hash(given) == hash(built)
    assert given.record_as("pod").upstream == "pod"
    assert repr(given).startswith("Finished(record=StreamRecord(")
    with pytest.raises(AttributeError):
        given.record = built.record  # type: ignore[misc]  # read-only, as the frozen dataclass was
    with pytest.raises(TypeError):
        Finished()
