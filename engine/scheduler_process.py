"""The scheduler in a process of its own, so the HTTP side never shares its GIL.

Theory of operation
-------------------
With ``scheduler_process = true`` (the default where the server may use two
CPUs or more: ``config.runs_scheduler_process``) the engine is two processes:

- the **front**: uvicorn, the middleware, the API, tokenization and JSON; it
  holds the tokenizer and no weights (``loader.load_front``);
- the **scheduler process**, spawned by the front: it loads the weights and
  runs the usual engine thread (``runner.py``) over the
  :class:`~tokenwire.engine.scheduler.ContinuousBatchingScheduler`,
  detokenisation included.

In one process the event loop and the engine thread share one GIL: every
torch op gives it up and must take it back, and a loop busy writing 64
streams' chunks makes each step wait for it. Here they share nothing but two
one-way pipes::

    front --down: AddRequest / CancelRequest / _Stop-------------> scheduler process
    front <--up: _Ready | _Failed, then one _Step per step----------- scheduler process

A step's outputs travel as plain tuples (a frozen dataclass costs ten times
more to pickle than its token is worth), in one message with the step's time
and load, and reach the front's loop through ``loop.add_reader``: one loop
callback per step delivers them to the responses, as the thread's one
``call_soon_threadsafe`` does. The up pipe carries length-prefixed pickles
that the front reads without blocking, everything there is in one ``read``
(``_FrameReader``): ``Connection.poll`` builds a selector per call, and
polling before each ``recv`` cost the front a tenth of its time.

The front checks a request before sending it (``check_request``, with the
queue length of the last step), so a refusal is still an HTTP 400/503.

Flow control: the up pipe holds about 16 steps of 64 rows. A client that
reads slowly never fills it (the front only queues outputs per request, as
with the thread), but a front whose loop stalls for that long pauses the
scheduler process at its next send, rather than letting outputs pile up.

Lifetimes: the scheduler process reads the down pipe until ``_Stop`` or end of
file, so a front that dies, however it dies, takes it along. If the scheduler
process dies, every request in flight finishes with an error, new ones get a
503 and ``/health`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from tokenwire.engine.backend import (
    BackendStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
)
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel, load_front
from tokenwire.engine.runner import (
    GIL_SWITCH_INTERVAL_S,
    AddRequest,
    CancelRequest,
    DeliverOutputs,
    StepObserver,
)

log = logging.getLogger("tokenwire.engine.scheduler_process")

_OutputRow = tuple[str, str, tuple[int, ...], int, int, bool, FinishReason | None,
                   int | str | None, str | None, float | None]
"""A :class:`RequestOutput`'s fields in order (``admitted_s`` included: the front's
queue-wait and prefill metrics and the request's log line need it)."""


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """What the scheduler process needs to load the model and schedule."""

    model_path: str
    name: str
    device: str
    dtype: str
    threads: int
    """torch intra-op threads of the scheduler process."""
    config: EngineConfig
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the scheduler process reports of the model it loaded."""

    device: str
    dtype: str
    max_model_len: int
    """The scheduler's context cap (``max_model_len`` of the config applied)."""
    vocab_size: int
    eos_token_ids: frozenset[int]


# -- messages --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


@dataclass(frozen=True, slots=True)
class _Ready:
    facts: ModelFacts


@dataclass(frozen=True, slots=True)
class _Failed:
    message: str


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's outputs, and (after a forward) its time and the load after it."""

    rows: list[_OutputRow]
    step_s: float | None = None
    stats: BackendStats | None = None


def _encode(outputs: list[RequestOutput]) -> list[_OutputRow]:
    return [(o.request_id, o.text, o.token_ids, o.prompt_tokens, o.completion_tokens,
             o.finished, o.finish_reason, o.stop_reason, o.error, o.admitted_s) for o in outputs]


def _decode(rows: list[_OutputRow]) -> list[RequestOutput]:
    return [RequestOutput(*row) for row in rows]


_HEADER = struct.Struct("!I")
"""A frame of the up pipe: the pickle's length, then the pickle."""


class _FrameWriter:
    """The scheduler process's end of the up pipe: one ``write`` per message. Any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        """Write ``message``; raises ``OSError`` once the front is gone."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        with self._lock:
            while data:
                data = data[os.write(self._fd, data):]


class _FrameReader:
    """The front's end of the up pipe: everything readable now, without blocking."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._partial = b""
        """The start of a message whose end has not arrived yet."""
        os.set_blocking(fd, False)

    def wait(self, timeout_s: float) -> bool:
        """Whether the pipe became readable (or closed) within ``timeout_s``."""
        readable, _, _ = select.select([self._fd], [], [], timeout_s)
        return bool(readable)

    def read(self) -> list[object]:
        """The messages complete so far; raises ``EOFError`` once the writer is gone."""
        chunks = [self._partial]
        while True:
            try:
                chunk = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                raise EOFError("the scheduler process closed its pipe")
            chunks.append(chunk)
            if len(chunk) < _READ_BYTES:
                break
        data = b"".join(chunks)
        view = memoryview(data)
        messages: list[object] = []
        start = 0
        while len(data) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(data, start)
            end = start + _HEADER.size + length
            if end > len(data):
                break
            messages.append(pickle.loads(view[start + _HEADER.size:end]))
            start = end
        self._partial = data[start:]
        return messages


_READ_BYTES = 1 << 20


# -- the front's side ------------------------------------------------------------------


class SchedulerProcessError(RuntimeError):
    """The scheduler process could not load the model, or did not start in time."""


@dataclass(frozen=True, slots=True)
class LaunchedScheduler:
    """A scheduler process that has loaded its model and waits for requests."""

    spec: SchedulerSpec
    facts: ModelFacts
    process: BaseProcess
    down: Connection
    up: Connection
    reader: _FrameReader
    """Reads ``up`` (non-blocking from now on)."""

    def front_model(self) -> LoadedModel:
        """The front's view of the model: the tokenizer and the reported facts."""
        return load_front(self.spec.model_path, name=self.spec.name, device=self.facts.device,
                          dtype=self.facts.dtype, max_model_len=self.facts.max_model_len,
                          eos_token_ids=self.facts.eos_token_ids)


def launch_scheduler(spec: SchedulerSpec, *, timeout_s: float = 600.0) -> LaunchedScheduler:
    """Spawn the scheduler process and wait until its model is loaded.

    Raises :class:`SchedulerProcessError` with the child's own error if loading fails.
    """
    return start_scheduler(spec).wait(timeout_s=timeout_s)


@dataclass(frozen=True, slots=True)
class StartingScheduler:
    """A scheduler process spawned and loading: the caller does its own work meanwhile
    (the server imports its web stack while the child imports torch and loads weights)."""

    spec: SchedulerSpec
    process: BaseProcess
    down: Connection
    up: Connection

    def wait(self, *, timeout_s: float = 600.0) -> LaunchedScheduler:
        """Until the model is loaded; raises :class:`SchedulerProcessError` if it fails."""
        return _wait_ready(self.spec, self.process, self.down, self.up, timeout_s)


def start_scheduler(spec: SchedulerSpec) -> StartingScheduler:
    """Spawn the scheduler process; :meth:`StartingScheduler.wait` for its model."""
    # spawn, not fork: the front has imported torch (and may hold CUDA or
    # thread pools), which a forked child would inherit half-initialised.
    context = multiprocessing.get_context("spawn")
    down_reader, down_writer = context.Pipe(duplex=False)
    up_reader, up_writer = context.Pipe(duplex=False)
    process = context.Process(target=scheduler_main, args=(spec, down_reader, up_writer),
                              name="tokenwire-scheduler", daemon=True)
    process.start()
    # The child holds its own copies; closing ours makes its death an EOF here.
    down_reader.close()
    up_writer.close()
    return StartingScheduler(spec, process, down_writer, up_reader)


def _wait_ready(spec: SchedulerSpec, process: BaseProcess, down_writer: Connection,
                up_reader: Connection, timeout_s: float) -> LaunchedScheduler:
    reader = _FrameReader(up_reader.fileno())
    deadline_s = time.monotonic() + timeout_s
    try:
        messages: list[object] = []
        while not messages:
            if not reader.wait(0.2):
                if not process.is_alive():
                    raise SchedulerProcessError(
                        f"the scheduler process exited with code {process.exitcode} while loading")
                if time.monotonic() > deadline_s:
                    raise SchedulerProcessError(f"the scheduler process did not load the model "
                                                f"in {timeout_s:.0f} s")
                continue
            messages = reader.read()
    except (EOFError, OSError, SchedulerProcessError) as error:
        _end(process, down_writer, up_reader)
        if isinstance(error, SchedulerProcessError):
            raise
        process.join(5)
        raise SchedulerProcessError(f"the scheduler process exited while loading "
                                    f"(code {process.exitcode})") from None
    message = messages[0]
    if isinstance(message, _Failed):
        _end(process, down_writer, up_reader)
        raise SchedulerProcessError(message.message)
    assert isinstance(message, _Ready) and len(messages) == 1, messages
    return LaunchedScheduler(spec, message.facts, process, down_writer, up_reader, reader)


class SchedulerProcessRunner:
    """The front's :class:`~tokenwire.engine.runner.Runner` for a launched scheduler process.

    Everything here runs on the front's event loop thread, except ``cancel``
    and ``submit``, which take a lock around the pipe and may run anywhere.
    """

    def __init__(self, launched: LaunchedScheduler, deliver: DeliverOutputs, *,
                 on_step: StepObserver | None = None) -> None:
        self._launched = launched
        self._facts = launched.facts
        self._config = launched.spec.config
        self._deliver = deliver
        self._on_step = on_step
        self._send_lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        """Request ids sent and not finished, with their prompt tokens."""
        self._waiting = 0
        """Requests queued for admission: the last step's count plus those sent since."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost: str | None = None
        """Why the scheduler process is gone, once it is."""
        self._stopped = False

    @property
    def alive(self) -> bool:
        """Started, and the scheduler process is still there."""
        return self._loop is not None and self._lost is None and not self._stopped

    @property
    def pid(self) -> int | None:
        """The scheduler process's id."""
        return self._launched.process.pid

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the scheduler process's outputs on ``loop`` from now on."""
        if self._loop is not None:
            raise RuntimeError("scheduler process runner already started")
        self._loop = loop
        loop.add_reader(self._launched.up.fileno(), self._readable)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the scheduler process after its current step; nothing in flight is finished."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is not None and self._lost is None:
            self._loop.remove_reader(self._launched.up.fileno())
        launched = self._launched
        _end(launched.process, launched.down, launched.up, timeout_s=timeout_s)

    def submit(self, request: GenerationRequest) -> None:
        """Check and send a request; raises ``RequestRejected`` before sending."""
        if self._lost is not None or self._stopped:
            raise RequestRejected(f"the engine cannot take requests: {self._lost or 'stopping'}",
                                  http_status=503)
        from tokenwire.engine.scheduler import check_request

        check_request(request, self._config, max_model_len=self._facts.max_model_len,
                      vocab_size=self._facts.vocab_size, waiting=self._waiting)
        if not self._send(AddRequest(request)):
            raise RequestRejected(f"the engine cannot take requests: {self._lost}",
                                  http_status=503)
        self._in_flight[request.request_id] = len(request.prompt_token_ids)
        self._waiting += 1

    def cancel(self, request_id: str) -> None:
        """Ask for ``request_id`` to leave the batch at the next step."""
        self._send(CancelRequest(request_id))

    def _send(self, message: AddRequest | CancelRequest) -> bool:
        if self._lost is not None or self._stopped:
            return False
        try:
            with self._send_lock:
                self._launched.down.send(message)
        except OSError as error:
            self._lose(f"the scheduler process is gone ({error})")
            return False
        return True

    def _readable(self) -> None:
        """Loop: everything the scheduler process has sent so far."""
        try:
            messages = self._launched.reader.read()
        except (EOFError, OSError):
            # Its pipe is closed, so it is exiting: wait a moment to report how.
            process = self._launched.process
            process.join(1.0)
            how = "" if process.exitcode is None else f" (exit code {process.exitcode})"
            self._lose(f"the scheduler process exited{how}")
            return
        for message in messages:
            assert isinstance(message, _Step), message
            if message.rows:
                outputs = _decode(message.rows)
                in_flight = self._in_flight
                for output in outputs:
                    if output.finished:
                        in_flight.pop(output.request_id, None)
                self._deliver(outputs)
            if message.stats is not None:
                self._waiting = message.stats.waiting
                if self._on_step is not None and message.step_s is not None:
                    self._on_step(message.step_s, message.stats)

    def _lose(self, reason: str) -> None:
        """The scheduler process is gone: end every request in flight with an error."""
        if self._lost is not None:
            return
        self._lost = reason
        log.error("tokenwire engine: %s", reason)
        if self._loop is not None and not self._stopped:
            self._loop.remove_reader(self._launched.up.fileno())
        failed = [RequestOutput(request_id=request_id, text="", token_ids=(),
                                prompt_tokens=prompt_tokens, completion_tokens=0, finished=True,
                                finish_reason="error", error=reason)
                  for request_id, prompt_tokens in self._in_flight.items()]
        self._in_flight.clear()
        if failed and self._loop is not None:
            self._loop.call_soon(self._deliver, failed)


def _end(process: BaseProcess, down: Connection, up: Connection, *, timeout_s: float = 10.0) -> None:
    """Ask the scheduler process to stop, wait, then make sure it has."""
    with contextlib.suppress(OSError):  # already gone
        down.send(_Stop())
    down.close()
    process.join(timeout_s)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
    up.close()


# -- the scheduler process's side ------------------------------------------------------


def scheduler_main(spec: SchedulerSpec, down: Connection, up: Connection) -> None:
    """The scheduler process: load, report, then step until told to stop or orphaned."""
    # Ctrl-C, and a SIGTERM sent to the whole process group, reach us as well as
    # the front: the front stops us once it has drained its streams (we keep
    # generating for them meanwhile), and its death is our pipe's end of file.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # This thread reads the down pipe while the engine thread steps: each request
    # or cancellation waits for the GIL, at most this long, not Python's 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Its lines go where the server's do, in the server's format (one JSON object a
    # line by default); transformers' progress bars and warnings through the same handler.
    from tokenwire.middleware.process.logs import configure_logging
    from transformers.utils import logging as hf_logging

    configure_logging("debug" if spec.log_level.lower() == "trace" else spec.log_level,
                      spec.config.log_format)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    import torch
    from tokenwire.engine.loader import load_model
    from tokenwire.engine.runner import EngineRunner
    from tokenwire.engine.scheduler import ContinuousBatchingScheduler

    torch.set_num_threads(spec.threads)
    try:
        loaded = load_model(Path(spec.model_path), device=spec.device, dtype=spec.dtype,
                            name=spec.name)
        scheduler = ContinuousBatchingScheduler(loaded, spec.config)
    except Exception as error:  # reported to the front, which exits with it
        _FrameWriter(up.fileno()).send(_Failed(f"{type(error).__name__}: {error}"))
        return
    writer = _FrameWriter(up.fileno())

    def send(message: _Step | _Ready) -> None:
        # A failed write means the front is gone: the down pipe's end of file stops us below.
        with contextlib.suppress(OSError):
            writer.send(message)

    # A step's outputs wait for its time and load (``on_step`` follows ``deliver``
    # on this thread), so the front gets one message and one wake-up per step.
    # Outputs handed off with no step to follow (a request refused while idle) go at once.
    pending: list[_OutputRow] = []

    def deliver(outputs: list[RequestOutput]) -> None:
        pending.extend(_encode(outputs))
        if not scheduler.has_work():
            send(_Step(pending[:]))
            pending.clear()

    def on_step(step_s: float, stats: BackendStats) -> None:
        send(_Step(pending[:], step_s, stats))
        pending.clear()

    # torch, transformers and the model are ~200,000 objects that live as long
    # as the process: a full collection walked them all (~60 ms with the GIL
    # held, a stalled step) each time the requests' garbage triggered one.
    gc.collect()
    gc.freeze()
    runner = EngineRunner(scheduler, deliver, on_step=on_step)
    runner.start(None)
    send(_Ready(ModelFacts(
        device=str(loaded.device), dtype=str(loaded.dtype),
        max_model_len=scheduler.max_model_len, vocab_size=scheduler.vocab_size,
        eos_token_ids=loaded.eos_token_ids)))
    try:
        while True:
            try:
                message = down.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, AddRequest):
                runner.enqueue(message.request)
            elif isinstance(message, CancelRequest):
                runner.cancel(message.request_id)
            else:
                break
    finally:
        runner.stop()
        up.close()
    # Nothing is left to flush but the log; skipping the interpreter's teardown of torch
    # (about a second) lets the server exit that much sooner after its drain.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
