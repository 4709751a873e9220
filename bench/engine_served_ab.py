"""The engine served over HTTP, this tree against a git ref, each beside the scheduler alone.

Not a test. ``engine_bench.py --parts served`` compares the served engine with
the scheduler alone; this runs that comparison for two trees at once, so a
change to the served path is measured as a ratio of ratios on the same
(shared, noisy) machine: ``tokenwire engine`` started from this tree and from
``--baseline REF`` (``git archive`` into a temporary folder, first on
``PYTHONPATH``, as ``engine_http_bench.py`` lays it out), in thread or process
mode or each tree's default (``--modes default``: no placement flag), and the
scheduler alone in this process. Each round runs every server once, in an
order that alternates, with the scheduler alone before the first and after
each one; a served run's ratio is to the alone runs either side of it, and the
figure is the median over rounds of served / alone::

    python bench/engine_served_ab.py --baseline main --streams 64 --rounds 8

Each round prints the 1-minute load average beside it; the summary adds the
ratio of the medians, the quartiles, and the CPU per token of each server (and
of its scheduler process) against the scheduler alone's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engine_bench
import engine_http_bench

ROOT = Path(__file__).resolve().parent.parent


def _threads_schedstat_s(pid: int) -> dict[int, tuple[float, float]]:
    """Per thread other than the main one: (seconds on a CPU, seconds runnable but waiting for one)."""
    stats = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        if int(task.name) != pid:
            run_ns, wait_ns = (task / "schedstat").read_text().split()[:2]
            stats[int(task.name)] = (int(run_ns) / 1e9, int(wait_ns) / 1e9)
    return stats


def _own_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` itself, its children not counted."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _steps(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    match = re.search(r"^tokenwire_engine_step_seconds_count (\S+)", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _start(model_path: Path, python_path: str | None, process_mode: bool | None, streams: int,
           environ: dict[str, str]) -> tuple[Any, int]:
    port = engine_bench._free_port()
    saved = dict(os.environ)
    if python_path is not None:
        os.environ["PYTHONPATH"] = python_path
    os.environ.update(environ)
    try:
        # Not in the repository's root: there ``python -m`` would import this tree's
        # ``tokenwire/`` before the baseline's on PYTHONPATH (both servers would run this tree).
        server = engine_bench._start_engine(model_path, port, 1, "cpu", "float32", streams, process_mode,
                                            cwd=tempfile.gettempdir())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return server, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a git ref, e.g. main or HEAD~3")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["thread"], choices=["thread", "process", "default"],
                        help="where the scheduler runs: a thread, a process, or wherever each tree's "
                             "default puts it (no placement flag, no --threads)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="one more server of this tree with these environment variables "
                             "(e.g. a TOKENWIRE_ENGINE_* key)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tokenwire.engine.loader import load_model
    from tokenwire.engine.tiny import ensure_tiny_model

    torch.set_num_threads(1)
    model_path = ensure_tiny_model()
    loaded = load_model(model_path, device="cpu", dtype="float32", name="bench")
    prompts = engine_bench._prompts(loaded, args.streams)
    with tempfile.TemporaryDirectory() as scratch:
        base = engine_http_bench._baseline_tree(args.baseline, Path(scratch))
        trees: dict[str, tuple[str | None, dict[str, str]]] = {"new": (None, {}), "base": (base, {})}
        for variant in args.variant:
            name, _, assignments = variant.partition(":")
            trees[name] = (None, dict(item.split("=", 1) for item in assignments.split(",") if item))
        servers: dict[str, tuple[Any, int]] = {}
        try:
            for tree, (path, environ) in trees.items():
                for mode in args.modes:
                    placement = None if mode == "default" else mode == "process"
                    servers[f"{mode} {tree}"] = _start(model_path, path, placement, args.streams, environ)
            for _, port in servers.values():
                engine_bench.run_clients(engine_bench._stream_once(port, prompts[0], 4))
            ratios: dict[str, list[float]] = {name: [] for name in servers}
            blocked: dict[str, list[float]] = {name: [] for name in servers}
            rates: dict[str, list[float]] = {name: [] for name in servers}
            front_us: dict[str, list[float]] = {name: [] for name in servers}
            child_us: dict[str, list[float]] = {name: [] for name in servers}
            busy: dict[str, list[float]] = {name: [] for name in servers}
            step_counts: dict[str, list[float]] = {name: [] for name in servers}
            alone_busy: list[float] = []
            alone_steps: list[float] = []
            alones: list[float] = []
            alone_us: list[float] = []
            loads: list[float] = []
            tokens = args.streams * args.tokens

            def alone_run() -> tuple[float, float]:
                cpu_s = time.thread_time()
                rate, steps, elapsed_s = engine_bench.scheduler_alone(loaded, prompts, args.tokens)
                used_s = time.thread_time() - cpu_s
                alone_busy.append(used_s / elapsed_s)
                alone_steps.append(steps)
                return rate, 1e6 * used_s / tokens

            for round_index in range(args.rounds):
                names = list(servers) if round_index % 2 == 0 else list(reversed(servers))
                served: dict[str, float] = {}
                denominators: dict[str, float] = {}
                # The scheduler alone between every two served runs (A S1 A S2 ... A): each
                # served run is divided by the alone runs just before and after it (their
                # mean time), so the other agents' load moving within a round moves both sides.
                before_alone, first_us = alone_run()
                round_alones, round_us = [before_alone], [first_us]
                for name in names:
                    port = servers[name][1]

                    async def run(port: int = port) -> list[list[float]]:
                        return await asyncio.gather(*(
                            engine_bench._stream_once(port, prompts[i], args.tokens)
                            for i in range(args.streams)))

                    server_pid = servers[name][0].pid
                    thread_mode = name.startswith("thread")
                    steps = _steps(port)
                    before = _threads_schedstat_s(server_pid)
                    front_before_s, all_before_s = _own_cpu_s(server_pid), engine_bench._cpu_s(server_pid)
                    started_s = time.perf_counter()
                    engine_bench.run_clients(run())
                    elapsed_s = time.perf_counter() - started_s
                    front_s = _own_cpu_s(server_pid) - front_before_s
                    child_s = engine_bench._cpu_s(server_pid) - all_before_s - front_s
                    front_us[name].append(1e6 * front_s / tokens)
                    child_us[name].append(1e6 * child_s / tokens)
                    # The scheduler's share of a core while served (with a thread, the
                    # whole server's: the loop's time included).
                    busy[name].append((child_s if child_s > 0.05 * front_s else front_s) / elapsed_s)
                    step_counts[name].append(_steps(port) - steps)
                    served[name] = tokens / elapsed_s
                    rates[name].append(served[name])
                    if thread_mode:
                        # The engine thread: the one (not the main one) that ran the most.
                        tid, after = max(((tid, stat) for tid, stat in _threads_schedstat_s(
                            server_pid).items() if tid in before),
                            key=lambda item: item[1][0] - before[item[0]][0])
                        before_run_s, before_wait_s = before[tid]
                        # Off a CPU without waiting for one: the engine thread waited for
                        # the GIL (or, before the first request, for work).
                        off_s = elapsed_s - (after[0] - before_run_s) - (after[1] - before_wait_s)
                        blocked[name].append(1000 * off_s / max(1.0, _steps(port) - steps))
                    after_alone, after_us = alone_run()
                    denominators[name] = 2 / (1 / before_alone + 1 / after_alone)
                    round_alones.append(after_alone)
                    round_us.append(after_us)
                    before_alone = after_alone
                alones.extend(round_alones)
                alone_us.extend(round_us)
                loads.append(os.getloadavg()[0])
                for name, tokens_per_s in served.items():
                    ratios[name].append(tokens_per_s / denominators[name])
                print(f"round {round_index}: alone {min(round_alones):.0f}-{max(round_alones):.0f} tok/s; "
                      + "; ".join(f"{name} {served[name]:.0f} (x{served[name] / denominators[name]:.2f})"
                                  for name in servers) + f"; load {loads[-1]:.1f}"
                      + "".join(f"; {name} engine blocked {values[-1]:.2f} ms/step"
                                for name, values in blocked.items() if values), flush=True)
        finally:
            for server, _ in servers.values():
                server.terminate()
            for server, _ in servers.values():
                server.wait(20)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds, "
          f"load {min(loads):.1f}-{max(loads):.1f}: median served / alone "
          + "; ".join(f"{name} x{statistics.median(values):.3f}" for name, values in ratios.items()))
    print(f"scheduler alone: median {statistics.median(alones):.0f} tok/s "
          f"(range {min(alones):.0f}-{max(alones):.0f}), CPU {statistics.median(alone_us):.1f} us/token, "
          f"{statistics.median(alone_busy):.2f} of a core, {statistics.median(alone_steps):.0f} steps")
    for name, values in ratios.items():
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        print(f"{name}: served / alone per round median x{statistics.median(values):.3f}, "
              f"quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, range {min(values):.2f}-{max(values):.2f}; "
              f"ratio of medians x{statistics.median(rates[name]) / statistics.median(alones):.3f}; "
              f"CPU per token: server {statistics.median(front_us[name]):.1f} us"
              + (f" + its scheduler process {statistics.median(child_us[name]):.1f} us"
                 if statistics.median(child_us[name]) > 1 else "")
              + f"; the scheduler {statistics.median(busy[name]):.2f} of a core, "
                f"{statistics.median(step_counts[name]):.0f} steps")
    for name, values in blocked.items():
        if values:
            print(f"{name}: the engine thread off a CPU, not waiting for one (the GIL), "
                  f"median {statistics.median(values):.2f} ms per step")
    for mode in args.modes:
        if f"{mode} base" not in ratios:
            continue
        pairs = [new / base for new, base in zip(ratios[f"{mode} new"], ratios[f"{mode} base"], strict=True)]
        print(f"{mode}: new / base per round, median x{statistics.median(pairs):.3f} "
              f"(range {min(pairs):.2f}-{max(pairs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
