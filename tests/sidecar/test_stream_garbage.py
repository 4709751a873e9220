"""A finished stream's objects are freed by reference counting, not left to the cyclic collector.

A reference cycle anywhere in a stream's object graph (a table of the core's
bound methods kept on the core, a timer's callback back to its exchange, an
attempt's callbacks kept by the traceback of its cancelled task) keeps the
whole graph alive until a collection finds it: every stream's connection,
exchange, core and h11 state, walked by the collector (pauses of 1-5 ms with a
few hundred streams behind them) and freed late. The test runs streams that
complete and streams whose clients reset mid-answer through a sidecar in this
process, with the collector saving what it finds (``DEBUG_SAVEALL``), and
looks for the stream's objects among it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from clients import chat_body, exchange, open_silent_streams, reset, wait_for
from conftest import RunningSidecar
from upstreams import FakeUpstream

# The per-stream objects of the sidecar and its core.
_STREAM_TYPES = frozenset({"ClientConnection", "Exchange", "WireStream", "UpstreamAttempt", "_AttemptBody",
                           "UpstreamConnection", "DeadlineTimer", "ResumeRecorder"})


def _settled(sidecar: RunningSidecar) -> bool:
    context = sidecar.sidecar.context
    assert context is not None
    return len(context.registry) == 0 and len(context.departures) == 0


def test_finishedAndResetStreams_leaveNoCyclicGarbage(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body())
            assert response.status == 200
        ids = [f"garbage-{i}" for i in range(5)]
        socks = open_silent_streams(sidecar.port, ids)
        wait_for(lambda: all(upstream.requests_with(request_id) for request_id in ids))
        for sock in socks:
            reset(sock)
        wait_for(lambda: _settled(sidecar), timeout_s=10)
        gc.collect()
        left = sorted(type(found).__name__ for found in gc.garbage
                      if type(found).__name__ in _STREAM_TYPES)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
