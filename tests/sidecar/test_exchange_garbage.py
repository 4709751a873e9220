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


def _mine(found: object, ids: set[str], context: object) -> str | None:
    """``found``'s type name if it is one of this test's streams' objects
    (other tests' sidecars share this process: their garbage is not ours).
    Every cycle found so far ran through the exchange, the core or the connection."""
    name = type(found).__name__
    if name in ("Exchange", "WireStream") and getattr(found, "request_id", None) in ids:
        return name
    if name == "ClientConnection" and getattr(found, "_context", None) is context:
        return name
    return None


def _settled(sidecar: RunningSidecar) -> bool:
    context = sidecar.sidecar.context
    assert context is not None
    return len(context.registry) == 0 and len(context.departures) == 0


def test_finished_and_reset_streams_leave_no_cyclic_garbage(
        start_sidecar: Callable[..., RunningSidecar], upstream: FakeUpstream) -> None:
    sidecar = start_sidecar()
    context = sidecar.sidecar.context
    completed = [f"garbage-done-{i}" for i in range(5)]
    reset_ids = [f"garbage-reset-{i}" for i in range(5)]
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for request_id in completed:
            response = exchange(sidecar.port, "POST", "/normal/v1/chat/completions", body=chat_body(),
                                headers={"X-Request-Id": request_id})
            assert response.status == 200
        socks = open_silent_streams(sidecar.port, reset_ids)
        wait_for(lambda: all(upstream.requests_with(request_id) for request_id in reset_ids))
        for sock in socks:
            reset(sock)
        wait_for(lambda: _settled(sidecar), timeout_s=10)
        gc.collect()
        ids = {*completed, *reset_ids}
        left = sorted(name for name in (_mine(found, ids, context) for found in gc.garbage) if name)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
