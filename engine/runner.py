"""The engine thread: drives a backend step by step and hands outputs to asyncio.

The event loop never waits on the engine and the engine never waits on the
event loop. Requests and cancellations cross into the engine thread through a
lock-protected inbox; each step's outputs cross back with exactly one
``loop.call_soon_threadsafe``, whose callback hands each to its request
without awaiting (``service.py``). A slow or vanished client can therefore
never stall a step.

The same thread runs inside the scheduler process (``scheduler_process.py``),
started without a loop: there each step's outputs go straight to the pipe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenwire.engine.backend import BackendStats, EngineBackend, GenerationRequest, RequestOutput

GIL_SWITCH_INTERVAL_S = 0.001
"""``sys.setswitchinterval`` of a process where the engine thread shares the GIL with
another busy thread (the event loop; in the scheduler process, its pipe reader):
the engine thread gives up the GIL inside every torch op and must take it back,
and the other thread, asking for it, waits for the interval each time. Python's
default 5 ms lets the loop hold up a step for that long per op, or keeps a
request waiting in the pipe that long per message."""

DeliverOutputs = Callable[[list[RequestOutput]], None]
"""Runs on the event loop with one step's outputs."""
StepObserver = Callable[[float, BackendStats], None]
"""Runs on the engine thread after each step: (step seconds, load snapshot)."""


class Runner(Protocol):
    """What the HTTP side needs of whatever runs the scheduler: a thread or a process."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin stepping; outputs are delivered on ``loop``."""
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping; requests still in flight are not finished."""
        ...

    def submit(self, request: GenerationRequest) -> None:
        """Check and queue a request; raises ``RequestRejected`` before queueing."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ask for ``request_id`` to leave the batch at the next step."""
        ...

    @property
    def alive(self) -> bool:
        """Started and still stepping (what ``/health`` reports)."""
        ...


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue ``request``: a message of the engine thread's inbox and of the scheduler
    process's down pipe."""

    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Take ``request_id`` out of the batch at the next step (inbox and down pipe)."""

    request_id: str


class EngineRunner:
    """Owns the engine thread for one backend."""

    def __init__(
        self,
        backend: EngineBackend,
        deliver: DeliverOutputs,
        *,
        on_step: StepObserver | None = None,
        idle_poll_s: float = 1.0,
    ) -> None:
        self._backend = backend
        self._deliver = deliver
        self._on_step = on_step
        self._idle_poll_s = idle_poll_s
        self._inbox: list[AddRequest | CancelRequest] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Start the engine thread; outputs go to ``loop``, or with ``None`` to
        ``deliver`` called on the engine thread itself (the scheduler process)."""
        if self._thread is not None:
            raise RuntimeError("engine runner already started")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tokenwire-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; requests still in flight are not finished."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def alive(self) -> bool:
        """Started and its thread still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> None:
        """Check and queue a request; raises ``RequestRejected`` before queueing."""
        self._backend.check(request)
        self._post(AddRequest(request))

    def enqueue(self, request: GenerationRequest) -> None:
        """Queue a request checked elsewhere (by the front of the scheduler process). Any thread."""
        self._post(AddRequest(request))

    def cancel(self, request_id: str) -> None:
        """Ask for ``request_id`` to leave the batch at the next step. Any thread."""
        self._post(CancelRequest(request_id))

    def _post(self, message: AddRequest | CancelRequest) -> None:
        with self._inbox_lock:
            self._inbox.append(message)
        self._wake.set()

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox_lock:
            messages, self._inbox = self._inbox, []
        rejected: list[RequestOutput] = []
        for message in messages:
            if isinstance(message, AddRequest):
                try:
                    self._backend.add(message.request)
                except Exception as error:
                    rejected.append(
                        RequestOutput(
                            request_id=message.request.request_id, text="", token_ids=(),
                            prompt_tokens=len(message.request.prompt_token_ids),
                            completion_tokens=0, finished=True, finish_reason="error",
                            error=str(error),
                        )
                    )
            else:
                self._backend.cancel(message.request_id)
        return rejected

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            outputs = self._drain_inbox()
            if not self._backend.has_work():
                if outputs:
                    self._hand_off(outputs)
                self._wake.wait(self._idle_poll_s)
                continue
            started_s = time.perf_counter()
            outputs.extend(self._backend.step())
            step_s = time.perf_counter() - started_s
            if outputs:
                self._hand_off(outputs)
            if self._on_step is not None:
                self._on_step(step_s, self._backend.stats())

    def _hand_off(self, outputs: list[RequestOutput]) -> None:
        if self._loop is None:
            self._deliver(outputs)
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        except RuntimeError:
            # The loop is closed: the server is shutting down and nobody listens.
            self._stopping.set()
