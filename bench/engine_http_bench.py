"""The engine's HTTP side alone: event-loop CPU per streamed token, this tree against a git ref.

Not a test. ``tokenwire engine``'s app (the API, tokenwire's middleware, the
access log, uvicorn) served over a *fake* backend, so no model runs: each step
holds the GIL for ``--busy-ms`` (the scheduler's Python) then sleeps
``--free-ms`` (a kernel, GIL released), and gives every running request one
token. N raw-socket streaming clients at once (``engine_bench.py``'s); the
figure is the server's main thread CPU time (``/proc``), i.e. the event loop's,
per token delivered, plus tokens/s. With ``--baseline REF`` the same server is
also run from that commit (``git archive`` into a temporary folder, imported
first on ``PYTHONPATH``), and the two take turns, round by round::

    python bench/engine_http_bench.py --baseline HEAD~3 --rounds 6

One process per server, the clients in this one; run it on a machine as quiet
as you can, and read the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engine_bench  # the clients and helpers

ROOT = Path(__file__).resolve().parent.parent
_WORDS = [" the", " cat", " sat", " on", " a", " warm", " mat", ",", " and", " then", "\n", ' "so"']


def serve(port: int, busy_ms: float, free_ms: float, loop: str = "tree") -> None:
    """The server process: the engine's app over a fake backend, on ``port``."""
    sys.setswitchinterval(0.001)  # as `tokenwire engine` does
    import uvicorn
    from tokenwire.engine.access_log import AccessLog
    from tokenwire.engine.api import build_app
    from tokenwire.engine.backend import BackendStats, GenerationRequest, RequestOutput
    from tokenwire.engine.config import EngineConfig
    from tokenwire.engine.loader import load_front
    from tokenwire.engine.server import _wrap_in_middleware
    from tokenwire.engine.tiny import ensure_tiny_model
    from tokenwire.middleware.asgi.middleware import listening_socket

    class FakeBackend:
        max_model_len = 4096

        def __init__(self) -> None:
            self.running: dict[str, list[Any]] = {}
            self.cancelled: list[str] = []

        def check(self, request: GenerationRequest) -> None:
            pass

        def add(self, request: GenerationRequest) -> None:
            self.running[request.request_id] = [request, 0]

        def cancel(self, request_id: str) -> None:
            self.cancelled.append(request_id)

        def has_work(self) -> bool:
            return bool(self.running or self.cancelled)

        def stats(self) -> BackendStats:
            return BackendStats(len(self.running), 0, 0, 0, 0)

        def step(self) -> list[RequestOutput]:
            until_s = time.thread_time() + busy_ms / 1000
            while time.thread_time() < until_s:
                pass
            time.sleep(free_ms / 1000)
            outputs = []
            for request_id in self.cancelled:
                if self.running.pop(request_id, None) is not None:
                    outputs.append(RequestOutput(request_id, "", (), 1, 0, True, "abort"))
            self.cancelled = []
            for request_id, state in list(self.running.items()):
                request, count = state[0], state[1] + 1
                state[1] = count
                done = count >= request.params.max_tokens
                outputs.append(RequestOutput(
                    request_id, _WORDS[count % len(_WORDS)], (count,), len(request.prompt_token_ids),
                    count, done, "length" if done else None,
                    admitted_s=time.monotonic() if count == 1 else None))
                if done:
                    del self.running[request_id]
            return outputs

    loaded = load_front(ensure_tiny_model(), name="bench", device="cpu", dtype="float32",
                        max_model_len=4096, eos_token_ids=frozenset())
    config = EngineConfig(served_model_name="bench")
    app = AccessLog(_wrap_in_middleware(build_app(loaded, config, backend=FakeBackend())))
    if loop == "tree":
        try:  # the tree's own choice of event loop, where it makes one (as `tokenwire engine`)
            from tokenwire.engine.config import event_loop
            loop = event_loop(config)
        except ImportError:
            loop = "auto"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, loop=loop,
                                           access_log=False, timeout_graceful_shutdown=1))
    server.run(sockets=[listening_socket("127.0.0.1", port, config.wire)])


def _start(python_path: str | None, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int]:
    port = engine_bench._free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--busy-ms", str(args.busy_ms),
         "--free-ms", str(args.free_ms), "--loop", args.loop], env=env, cwd=tempfile.gettempdir())
    deadline_s = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline_s:
                process.kill()
                raise RuntimeError("the server did not start") from None
            time.sleep(0.2)


def _baseline_tree(ref: str, into: Path) -> str:
    """``ref``'s packages laid out as ``tokenwire.*`` under ``into``: a PYTHONPATH entry."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref,
                    "tokenwire", "middleware", "sidecar", "engine"], check=True)
    source = into / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    package = into / "path" / "tokenwire"
    package.parent.mkdir()
    (source / "tokenwire").rename(package)
    for name in ("middleware", "sidecar", "engine"):
        (source / name).rename(package / name)
    # The compiled core's extensions are not in git: copy this tree's when the core's
    # source is the same at ``ref``, so both sides run the same core.
    same_core = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", ref, "--", "middleware",
                                "sidecar"]).returncode == 0
    if same_core:
        for name in ("middleware", "sidecar"):
            for extension in (ROOT / name).glob("*.so"):
                shutil.copy2(extension, package / name / extension.name)
    else:
        print(f"{ref}: middleware/ or sidecar/ differ from this tree's: it runs the pure-Python core")
    return str(into / "path")


def _main_thread_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--busy-ms", type=float, default=6.0)
    parser.add_argument("--free-ms", type=float, default=4.0)
    parser.add_argument("--baseline", help="a git ref to compare with, e.g. HEAD~3")
    parser.add_argument("--loop", default="tree", choices=["tree", "asyncio", "uvloop"],
                        help="the servers' event loop: each tree's own choice (as `tokenwire engine` "
                             "with the scheduler thread), or this one for both")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.busy_ms, args.free_ms, args.loop)
        return 0
    prompts = [tuple(range(5, 15 + index % 30)) for index in range(args.streams)]
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, str | None] = {"this tree": None}
        if args.baseline:
            trees[args.baseline] = _baseline_tree(args.baseline, Path(scratch))
        servers = {name: _start(path, args) for name, path in trees.items()}
        figures: dict[str, dict[str, list[float]]] = {name: {"tps": [], "us": [], "clients": []}
                                                  for name in trees}
        try:
            for _, port in servers.values():
                engine_bench.run_clients(engine_bench._stream_once(port, prompts[0], 4))
            for round_index in range(args.rounds):
                order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
                for name in order:
                    process, port = servers[name]

                    async def run(port: int = port) -> list[list[float]]:
                        return await asyncio.gather(*(
                            engine_bench._stream_once(port, prompts[i], args.tokens)
                            for i in range(args.streams)))

                    cpu_before_s = _main_thread_cpu_s(process.pid)
                    clients_before_s = time.process_time()
                    started_s = time.perf_counter()
                    engine_bench.run_clients(run())
                    elapsed_s = time.perf_counter() - started_s
                    clients_us = 1e6 * (time.process_time() - clients_before_s) / (args.streams * args.tokens)
                    tokens = args.streams * args.tokens
                    loop_us = 1e6 * (_main_thread_cpu_s(process.pid) - cpu_before_s) / tokens
                    figures[name]["tps"].append(tokens / elapsed_s)
                    figures[name]["us"].append(loop_us)
                    figures[name]["clients"].append(clients_us)
                    print(f"round {round_index} {name}: {tokens / elapsed_s:.0f} tok/s, event loop "
                          f"{loop_us:.1f} us CPU per token (clients {clients_us:.1f}), "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(10)
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values['tps']):.0f} tok/s, event loop "
              f"{statistics.median(values['us']):.1f} us CPU per token (clients "
              f"{statistics.median(values['clients']):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
