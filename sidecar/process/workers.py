"""``--workers N``: a supervisor and N sidecar processes sharing the proxy port.

Theory of operation
-------------------
Like nginx's ``worker_processes``: each worker is an ordinary sidecar process
(``tokenwire sidecar … --workers 1``) that binds the proxy port with
``SO_REUSEPORT``, so the kernel spreads new connections over the workers and
each runs its own event loop on its own core. The supervisor serves no
traffic; it

* holds the port (bound, not listening) so ``listen = "…:0"`` resolves once
  and every worker binds the same port;
* starts the workers, each with a private admin listener on 127.0.0.1, and
  waits for their ready lines before printing its own;
* serves the one public admin port (``admin_listen``): ``/metrics`` adds up
  the workers' figures (see "Metrics" below), ``GET /streams`` is the union
  (each entry says its ``worker``), ``DELETE /streams/{id}`` asks each worker
  until one had it, anything else is answered by a live worker;
* forwards SIGTERM/SIGINT (every worker drains, then the supervisor exits) and
  SIGHUP (every worker reloads its TLS certificates);
* restarts a worker that dies. The streams it held end with it; the
  supervisor writes a ``worker_lost`` record for each stream the worker listed
  at its last poll (every ``_POLL_S``: a stream opened after that poll and lost
  with the worker goes unrecorded), and counts as many in
  ``tokenwire_streams_lost_total{reason="worker_lost"}``: the log and the
  counter come from the same list, so they agree.

Metrics
-------
The supervisor's ``/metrics`` merges the workers' expositions
(:mod:`~tokenwire.sidecar.process.exposition`, whose docstring says how), and
adds its own: ``tokenwire_streams_lost_total{reason="worker_lost"}``,
``tokenwire_worker_restarts_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import h11
from prometheus_client import CONTENT_TYPE_LATEST
from tokenwire.middleware import EndReason, StreamRecord
from tokenwire.middleware.core.headers import header_value

from ..logs import StreamLog
from ..settings import (
    SHARED_LIMITS,
    SidecarConfig,
    format_host_port,
    parse_host_port,
    read_admin_token,
    worker_share,
)
from ..tasks import spawn
from . import metrics as sidecar_metrics
from .admin import AdminAccess, serve_one
from .exposition import Exposition, merge_expositions, parse_exposition, render_exposition, totals_of

logger = logging.getLogger("tokenwire.sidecar")

WORKER_ENV = "TOKENWIRE_WORKER_INDEX"
"""Set in a worker's environment (its index): bind the proxy port with SO_REUSEPORT."""

# How often the supervisor reads each worker's open streams (for worker_lost records).
_POLL_S = 0.25
# How often it reads each worker's /metrics between scrapes (what a dead worker
# counted after the last read is lost from the sums).
_METRICS_POLL_S = 1.0
# A worker that dies sooner than this after starting is restarted only after this long.
_RESTART_BACKOFF_S = 1.0
_READY_TIMEOUT_S = 60.0
_ADMIN_TIMEOUT_S = 5.0


@dataclass
class Worker:
    """One worker process as the supervisor knows it."""

    index: int
    process: asyncio.subprocess.Process
    admin: tuple[str, int]
    started_at: float
    streams: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    metrics: Exposition | None = None
    """Its last ``/metrics`` answer, parsed (None: none yet, or folded in at its death)."""
    retired: bool = False
    """Dead, and its last totals folded into the supervisor's: it counts no more."""
    scrape_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One read of its ``/metrics`` at a time, so the answers are kept in the order given."""


async def _fetch(address: tuple[str, int], method: str, path: str, token: str = "",
                 timeout_s: float = _ADMIN_TIMEOUT_S) -> tuple[int, bytes, bytes]:
    """One request to a worker's admin port: (status, content type, body).
    ``token``: the admin token, which a worker given one asks for too."""
    authorization = f"Authorization: Bearer {token}\r\n" if token else ""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(*address)
        try:
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: worker\r\n{authorization}"
                         "Connection: close\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    content_type = b"application/octet-stream"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-type":
            content_type = value.strip()
        elif name == b"content-length" and int(value) != len(body):
            # Cut short (the worker died while answering): a partial /metrics is no answer.
            raise ValueError(f"{len(body)} of {int(value)} body bytes")
    return status, content_type, body


class Supervisor:
    """Starts, watches and fronts the workers; see the module docstring."""

    def __init__(self, config: SidecarConfig, argv: Sequence[str], *, out: TextIO = sys.stdout) -> None:
        self.config = config
        self._argv = list(argv)
        self._out = out
        self.workers: dict[int, Worker] = {}
        self._stopping = False
        self._holder: socket.socket | None = None
        self._listen = ("", 0)
        self._admin: asyncio.Server | None = None
        self._log = StreamLog.open(config.log_file)
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = sidecar_metrics.SupervisorMetrics()
        self._retired: Exposition = {}
        """The last totals of every worker that died, added up."""
        # The public admin port asks what a single sidecar's would (issue: the
        # admin surface), and the workers' own admin ports get the token along.
        self._access = AdminAccess(read_admin_token(config), config.metrics_public)

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        host, port = parse_host_port(self.config.listen, "listen")
        self._holder = self._hold_port(host, port)
        self._listen = (host, int(self._holder.getsockname()[1]))
        try:
            started = await asyncio.gather(*(self._start_worker(i) for i in range(self.config.worker_count)),
                                           return_exceptions=True)
            failed = [error for error in started if isinstance(error, BaseException)]
            if failed:
                for worker in self.workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.kill()
                logger.error("a worker did not start: %s", failed[0])
                return 1
            loop = asyncio.get_running_loop()
            stopped = asyncio.Event()

            def stop() -> None:
                self._stopping = True
                for worker in self.workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGTERM)
                stopped.set()

            def reload() -> None:
                for worker in self.workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGHUP)

            loop.add_signal_handler(signal.SIGTERM, stop)
            loop.add_signal_handler(signal.SIGINT, stop)
            loop.add_signal_handler(signal.SIGHUP, reload)
            if self.config.admin_listen:
                admin_host, admin_port = parse_host_port(self.config.admin_listen, "admin_listen")
                self._admin = await asyncio.start_server(self._serve_admin, admin_host, admin_port,
                                                         reuse_address=True)
            self._spawn(self._poll_streams())
            self._spawn(self._poll_metrics())
            scheme = "https" if self.config.tls else "http"
            ready = (f"ready listen={format_host_port(*self._listen)} scheme={scheme} "
                     f"workers={len(self.workers)}")
            if self._admin is not None:
                admin_address = self._admin.sockets[0].getsockname()
                ready += f" admin={format_host_port(admin_address[0], admin_address[1])}"
            print(ready, file=self._out, flush=True)
            await stopped.wait()
            await asyncio.gather(*(w.process.wait() for w in list(self.workers.values())))
            logger.info("exiting: every worker has")
            return 0
        finally:
            self._stopping = True
            for task in list(self._tasks):
                task.cancel()
            for worker in self.workers.values():
                if worker.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGTERM)
            if self._admin is not None:
                self._admin.close()
            if self._holder is not None:
                self._holder.close()
            self._log.close()

    @staticmethod
    def _hold_port(host: str, port: int) -> socket.socket:
        """Bind (not listen) the proxy address with SO_REUSEPORT: port 0 resolves
        once, and the workers' listening sockets join the same port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        return sock

    def _spawn(self, coro: Any) -> None:
        spawn(self._tasks, coro)

    async def _start_worker(self, index: int, restarts: int = 0) -> Worker:
        host, port = self._listen
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # The group's limits, split: the kernel spreads connections over the
        # workers, and each holds its part, so together they never pass them.
        shares = [arg for key in SHARED_LIMITS if (limit := getattr(self.config, key))
                  for arg in ("--" + key.replace("_", "-"),
                              str(worker_share(limit, self.config.worker_count, index)))]
        command = [sys.executable, "-m", "tokenwire.sidecar", "sidecar", *self._argv, *shares,
                   "--workers", "1", "--listen", listen, "--admin-listen", "127.0.0.1:0"]
        env = {**os.environ, WORKER_ENV: str(index)}
        process = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.PIPE)
        assert process.stdout is not None
        admin: tuple[str, int] | None = None
        try:
            async with asyncio.timeout(_READY_TIMEOUT_S):
                while admin is None:
                    line = await process.stdout.readline()
                    if not line:
                        raise RuntimeError(f"worker {index} exited (status {await process.wait()})")
                    text = line.decode(errors="replace")
                    if text.startswith("ready "):
                        fields = dict(part.split("=", 1) for part in text.split()[1:] if "=" in part)
                        admin_host, _, admin_port = fields["admin"].rpartition(":")
                        admin = (admin_host, int(admin_port))
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise
        worker = Worker(index, process, admin, time.monotonic(), restarts=restarts)
        self.workers[index] = worker
        self._spawn(self._drain_stdout(process))
        self._spawn(self._watch(worker))
        logger.info("worker %d started (pid %d)", index, process.pid)
        return worker

    @staticmethod
    async def _drain_stdout(process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while await process.stdout.read(65536):
            pass

    async def _watch(self, worker: Worker) -> None:
        status = await worker.process.wait()
        if self._stopping:
            return
        logger.error("worker %d (pid %d) exited with status %d; %d open streams lost; restarting",
                     worker.index, worker.process.pid, status, len(worker.streams))
        self._retire(worker)
        self._record_lost(worker)
        if time.monotonic() - worker.started_at < _RESTART_BACKOFF_S:
            await asyncio.sleep(_RESTART_BACKOFF_S)
        while not self._stopping:
            try:
                await self._start_worker(worker.index, worker.restarts + 1)
                return
            except (RuntimeError, OSError, TimeoutError) as error:
                logger.error("worker %d did not restart: %s", worker.index, error)
                await asyncio.sleep(_RESTART_BACKOFF_S)

    def _retire(self, worker: Worker) -> None:
        """Keep a dead worker's last totals: its successor counts from zero."""
        if worker.metrics is not None:
            self._retired = merge_expositions([self._retired, totals_of(worker.metrics)])
        worker.metrics = None
        worker.retired = True
        self.metrics.worker_restarts.inc()

    def _record_lost(self, worker: Worker) -> None:
        """A ``worker_lost`` record for each stream the dead worker last listed,
        and as many in ``tokenwire_streams_lost_total``."""
        self.metrics.worker_lost.inc(len(worker.streams))
        now = time.time()
        for entry in worker.streams:
            age_s = float(entry.get("age_s") or 0.0)
            record = StreamRecord(
                request_id=str(entry.get("request_id", "")), upstream=str(entry.get("upstream", "")),
                status=0, end_reason=EndReason.WORKER_LOST, error_code=None,
                started_at=now - age_s, duration_s=age_s, ttfb_s=None, max_event_gap_s=0.0,
                event_gap_buckets=(), events_in=int(entry.get("events_in") or 0),
                events_out=int(entry.get("events_out") or 0), bytes_out=0, heartbeats=0,
                coalesced_events=0, dropped_events=0, retries=0, refused_retries=0,
                pending_high_water_bytes=0)
            self._log.write(record, worker=worker.index)
        worker.streams = []

    async def _poll_streams(self) -> None:
        while True:
            for worker in list(self.workers.values()):
                if worker.process.returncode is not None:
                    continue
                with contextlib.suppress(OSError, TimeoutError, ValueError, IndexError):
                    status, _, body = await _fetch(worker.admin, "GET", "/streams", self._access.token,
                                                   timeout_s=1.0)
                    if status == 200 and worker.process.returncode is None:
                        worker.streams = json.loads(body)
            await asyncio.sleep(_POLL_S)

    async def _scrape(self, worker: Worker) -> None:
        """Read one worker's ``/metrics`` and keep it (a failed read keeps the last)."""
        async with worker.scrape_lock:
            if worker.retired or worker.process.returncode is not None:
                return
            with contextlib.suppress(OSError, TimeoutError, ValueError, IndexError):
                status, _, body = await _fetch(worker.admin, "GET", "/metrics", self._access.token)
                if status == 200 and not worker.retired:
                    worker.metrics = parse_exposition(body)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(_METRICS_POLL_S)
            await asyncio.gather(*(self._scrape(worker) for worker in self._live()))

    def render_metrics(self) -> bytes:
        """The workers' last ``/metrics``, the dead workers' totals and the
        supervisor's own counters, as one exposition."""
        known = [worker.metrics for _, worker in sorted(self.workers.items())
                 if worker.metrics is not None and not worker.retired]
        own = parse_exposition(self.metrics.render())
        return render_exposition(merge_expositions([*known, self._retired, own]))

    # ------------------------------------------------------------ the admin port

    def _live(self) -> list[Worker]:
        return [w for _, w in sorted(self.workers.items()) if w.process.returncode is None]

    async def _gather(self, method: str, path: str) -> list[tuple[Worker, tuple[int, bytes, bytes] | None]]:
        workers = self._live()

        async def one(worker: Worker) -> tuple[int, bytes, bytes] | None:
            try:
                return await _fetch(worker.admin, method, path, self._access.token)
            except (OSError, TimeoutError, ValueError, IndexError):
                return None

        answers = await asyncio.gather(*(one(w) for w in workers))
        return list(zip(workers, answers, strict=True))

    async def route(self, method: bytes, target: bytes) -> tuple[int, bytes, bytes]:
        """The supervisor's admin answer: (status, content type, body)."""
        path = urllib.parse.unquote(target.split(b"?", 1)[0].decode("ascii", "replace"))
        quoted = target.split(b"?", 1)[0].decode("ascii", "replace")
        json_type = b"application/json"
        if method in (b"GET", b"HEAD") and path == "/metrics":
            await asyncio.gather(*(self._scrape(worker) for worker in self._live()))
            return 200, CONTENT_TYPE_LATEST.encode(), self.render_metrics()
        if method in (b"GET", b"HEAD") and path == "/streams":
            streams: list[Any] = []
            for worker, answer in await self._gather("GET", "/streams"):
                if answer is not None and answer[0] == 200:
                    streams += [{**entry, "worker": worker.index} for entry in json.loads(answer[2])]
            return 200, json_type, json.dumps(streams, separators=(",", ":")).encode()
        if method in (b"GET", b"HEAD") and path == "/workers":
            listing = [{"index": w.index, "pid": w.process.pid, "restarts": w.restarts,
                        "alive": w.process.returncode is None, "streams": len(w.streams)}
                       for _, w in sorted(self.workers.items())]
            return 200, json_type, json.dumps(listing, separators=(",", ":")).encode()
        if method in (b"GET", b"HEAD") and path == "/upstreams":
            # Each worker balances on its own: one view per worker.
            views = [{**json.loads(answer[2]), "worker": worker.index}
                     for worker, answer in await self._gather("GET", "/upstreams")
                     if answer is not None and answer[0] == 200]
            return 200, json_type, json.dumps({"workers": views}, separators=(",", ":")).encode()
        if method == b"POST" and path.startswith("/upstreams/"):
            # A drain is every worker's: the first answer that found the pod speaks for all.
            replies = [reply for _, reply in await self._gather("POST", quoted) if reply is not None]
            found = [reply for reply in replies if reply[0] == 200]
            if found or replies:
                return (found or replies)[0]
        if path == "/drain" and method in (b"GET", b"HEAD", b"POST"):
            # Every worker's: draining once all are, the open streams of them all.
            answers = [answer for _, answer in await self._gather(method.decode(), "/drain")]
            states = [json.loads(answer[2]) for answer in answers if answer is not None and answer[0] < 300]
            if not states or len(states) < len(answers):
                return 503, json_type, b'{"status":"a worker did not answer"}'
            state = {"draining": all(s["draining"] for s in states),
                     "open_streams": sum(s["open_streams"] for s in states)}
            return (202 if method == b"POST" else 200), json_type, json.dumps(
                state, separators=(",", ":")).encode()
        if method in (b"GET", b"HEAD") and path == "/readyz":
            if self._stopping:
                return 503, json_type, b'{"status":"draining"}'
            return await self._readyz()
        if method == b"DELETE" and path.startswith("/streams/"):
            last: tuple[int, bytes, bytes] | None = None
            for _, answer in await self._gather("DELETE", quoted):
                if answer is not None and answer[0] == 200:
                    return answer
                last = answer if answer is not None else last
            if last is not None:
                return last
        live = self._live()
        if not live:
            return 503, json_type, b'{"status":"no worker running"}'
        try:
            return await _fetch(live[0].admin, method.decode("ascii", "replace"),
                                target.decode("ascii", "replace"), self._access.token)
        except (OSError, TimeoutError, ValueError, IndexError):
            return 502, json_type, b'{"status":"worker did not answer"}'

    async def _readyz(self) -> tuple[int, bytes, bytes]:
        """Ready when every live worker is: the kernel hands a new connection to any
        of them. Otherwise the first unready worker's answer, naming it."""
        answers = await self._gather("GET", "/readyz")
        if not answers:
            return 503, b"application/json", b'{"status":"no worker running"}'
        for worker, answer in answers:
            if answer is None:
                return 503, b"application/json", json.dumps(
                    {"status": "not_ready", "worker": worker.index,
                     "reasons": [{"code": "worker_silent", "message": "a worker did not answer"}]},
                    separators=(",", ":")).encode()
            if answer[0] != 200:
                try:
                    body = {**json.loads(answer[2]), "worker": worker.index}
                except (ValueError, TypeError):
                    body = {"status": "not_ready", "worker": worker.index}
                return answer[0], b"application/json", json.dumps(body, separators=(",", ":")).encode()
        return answers[0][1] or (200, b"application/json", b'{"status":"ready"}')

    async def _serve_admin(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_one(reader, writer, self._answer)

    async def _answer(self, request: h11.Request) -> tuple[int, bytes, bytes]:
        """The token rule of a single sidecar's admin port, then the route."""
        path = urllib.parse.unquote(request.target.split(b"?", 1)[0].decode("ascii", "replace"))
        if not self._access.allows(path, header_value(request.headers, b"authorization")):
            return 401, b"application/json", b'{"status":"admin token required"}'
        return await self.route(request.method, request.target)


def supervise(config: SidecarConfig, argv: Sequence[str], *, out: TextIO = sys.stdout) -> int:
    """Run the supervisor until SIGTERM (the ``tokenwire sidecar --workers N`` command)."""
    return asyncio.run(Supervisor(config, argv, out=out).run())


def die_with_parent() -> None:
    """In a worker: get SIGTERM if the supervisor dies (Linux), so no worker is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
