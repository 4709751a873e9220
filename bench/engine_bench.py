"""Engine benchmark: batching throughput, chunked prefill, served over HTTP, abort latency.

Not a test. Every figure is a ratio of two things measured side by side in the
same run (the machine may be shared)::

    python bench/engine_bench.py            # writes bench/results/engine.{json,png}
    python bench/engine_bench.py --parts served --streams 64   # one part

1. **Throughput**: N streams (``--streams``, default 1, 16, 64) submitted at
   once to the scheduler, greedy, ``ignore_eos``, fixed output length;
   aggregate generated tokens per wall-clock second, prefill included.
   Baseline: ``model.generate`` on the same prompts one at a time (the first
   16 timed; their mean stands for the rest).
2. **Chunked prefill**: 16 streams decoding, then a 4,000-token prompt
   arrives. Every step gives each running stream one token, so a stream's
   inter-token gap is the step time; we record it from the arrival until 20
   steps after the long prompt's first token, for each ``--chunk-tokens``
   value of ``max_prefill_tokens_per_step`` and 0 (no chunking), each beside a
   control (the same 16 streams, no long prompt) stepped in lockstep.
3. **Served**: ``tokenwire engine`` in its own process, N raw-socket streaming
   clients at once, with the scheduler in a process of its own and in a
   thread of the server (the default), against the scheduler alone in this
   process; the three take turns. Tokens/s (medians, and the median of each
   round's served / alone), each stream's time to first token and
   inter-token gaps (p50, p99), the load average after each round.
4. **Abort**: the engine served by uvicorn behind the middleware (scheduler
   thread, in this process, so the batch can be read), 16 streams running; a
   17th client reads its first token and then resets its TCP connection
   (``SO_LINGER`` 0). We measure the time and the scheduler steps from the
   reset until its row has left the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenwire.engine.backend import GenerationRequest
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel, load_model
from tokenwire.engine.sampling import SamplingParams
from tokenwire.engine.scheduler import ContinuousBatchingScheduler
from tokenwire.engine.tiny import ensure_tiny_model, load_corpus_paragraphs

RESULTS_DIR = Path(__file__).parent / "results"


def _prompts(loaded: LoadedModel, count: int) -> list[tuple[int, ...]]:
    paragraphs = load_corpus_paragraphs()
    prompts = []
    for index in range(count):
        words = paragraphs[index % len(paragraphs)].split()
        # Mixed lengths, 8 to 40 words, so rows really are left-padded.
        prompts.append(tuple(loaded.tokenizer(" ".join(words[: 8 + (index * 7) % 33])).input_ids))
    return prompts


# -- 1. throughput ---------------------------------------------------------------------


def scheduler_alone(loaded: LoadedModel, prompts: list[tuple[int, ...]], output_tokens: int,
                    ) -> tuple[float, int, float]:
    """All ``prompts`` added at once to a fresh scheduler, stepped until done in this thread:
    (generated tokens per second, steps, seconds)."""
    scheduler = ContinuousBatchingScheduler(
        loaded, EngineConfig(max_running=max(64, len(prompts)), kv_budget_tokens=1 << 22,
                             max_prefill_tokens_per_step=2048))
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    started_s = time.perf_counter()
    for index, prompt in enumerate(prompts):
        scheduler.add(GenerationRequest(f"t{index}", prompt, params))
    generated = 0
    steps = 0
    while scheduler.has_work():
        generated += sum(len(o.token_ids) for o in scheduler.step())
        steps += 1
    elapsed_s = time.perf_counter() - started_s
    return generated / elapsed_s, steps, elapsed_s


def bench_throughput(loaded: LoadedModel, stream_counts: list[int], output_tokens: int) -> dict[str, Any]:
    results: dict[str, Any] = {"output_tokens": output_tokens, "streams": {}}
    largest = max(stream_counts)
    prompts = _prompts(loaded, largest)
    # One-at-a-time generate costs the same per prompt whatever N is: time the
    # first 16 and use their mean (256 of them would take minutes on a GPU).
    baseline_s: list[float] = []
    for prompt in prompts[:16]:
        input_ids = torch.tensor([prompt], device=loaded.device)
        started_s = time.perf_counter()
        with torch.inference_mode():
            loaded.model.generate(input_ids, max_new_tokens=output_tokens,
                                  min_new_tokens=output_tokens, do_sample=False)
        baseline_s.append(time.perf_counter() - started_s)
    for streams in stream_counts:
        timed = baseline_s[:streams]
        generate_tokens_per_s = len(timed) * output_tokens / sum(timed)
        batched_tokens_per_s, steps, elapsed_s = scheduler_alone(loaded, prompts[:streams],
                                                                 output_tokens)
        results["streams"][str(streams)] = {
            "batched_tokens_per_s": round(batched_tokens_per_s, 1),
            "generate_one_at_a_time_tokens_per_s": round(generate_tokens_per_s, 1),
            "speedup": round(batched_tokens_per_s / generate_tokens_per_s, 2),
            "steps": steps,
            "elapsed_s": round(elapsed_s, 3),
        }
        print(f"throughput {streams:>3} streams: {batched_tokens_per_s:8.0f} tok/s batched, "
              f"{generate_tokens_per_s:6.0f} tok/s generate, "
              f"x{batched_tokens_per_s / generate_tokens_per_s:.1f}", flush=True)
    return results


# -- 2. chunked prefill ----------------------------------------------------------------


def bench_chunked_prefill(loaded: LoadedModel, long_prompt_tokens: int,
                          chunk_sizes: list[int]) -> dict[str, Any]:
    paragraphs = " ".join(load_corpus_paragraphs())
    long_prompt = tuple(loaded.tokenizer(paragraphs * 3).input_ids[:long_prompt_tokens])
    assert len(long_prompt) == long_prompt_tokens
    prompts = _prompts(loaded, 16)
    results: dict[str, Any] = {"long_prompt_tokens": long_prompt_tokens}
    results["runs"] = []
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)

    def decoding_scheduler(chunk: int) -> ContinuousBatchingScheduler:
        scheduler = ContinuousBatchingScheduler(
            loaded, EngineConfig(max_prefill_tokens_per_step=chunk, kv_budget_tokens=1 << 22))
        for index, prompt in enumerate(prompts):
            scheduler.add(GenerationRequest(f"s{index}", prompt, params))
        while len(scheduler.batch_row_ids) < 16:
            scheduler.step()
        return scheduler

    def timed_step(scheduler: ContinuousBatchingScheduler) -> tuple[float, list[Any]]:
        started_s = time.perf_counter()
        outputs = scheduler.step()
        return (time.perf_counter() - started_s) * 1000, outputs

    def p95(values: list[float]) -> float:
        return sorted(values)[max(0, round(0.95 * len(values)) - 1)]

    for chunk in [*chunk_sizes, 0]:
        label = f"chunk {chunk}" if chunk else "unchunked"
        # The control: the same 16 streams with no long prompt, stepped in
        # lockstep with the measured scheduler (one step of each in turn), so
        # both see the same machine: on a shared box the noise of the minute
        # is the same for both, and their caches grow alike.
        scheduler = decoding_scheduler(chunk)
        control = decoding_scheduler(chunk)
        step_ms: list[float] = []
        control_ms: list[float] = []
        phase: list[str] = []
        after_first_token: int | None = None
        while after_first_token is None or after_first_token < 20:
            if len(step_ms) == 30:
                scheduler.add(GenerationRequest("long", long_prompt,
                                                SamplingParams(max_tokens=64, ignore_eos=True)))
            ms, outputs = timed_step(scheduler)
            step_ms.append(ms)
            control_ms.append(timed_step(control)[0])
            if len(step_ms) <= 30:
                phase.append("steady")
            elif after_first_token is None:
                phase.append("prefill")
                if any(o.request_id == "long" for o in outputs):
                    after_first_token = 0
            else:
                phase.append("joined")
                after_first_token += 1
        del control
        window = step_ms[30:]
        control_window = control_ms[30:]
        steady_ms = statistics.median(ms for ms, p in zip(step_ms, phase, strict=True) if p == "steady")
        control_median_ms = statistics.median(control_window)
        prefill_gaps = [ms for ms, p in zip(step_ms, phase, strict=True) if p == "prefill"]
        joined = [ms for ms, p in zip(step_ms, phase, strict=True) if p == "joined"]
        worst_ms = max(window)
        results["runs"].append({
            "label": label,
            "max_prefill_tokens_per_step": chunk,
            "steady_gap_ms": round(steady_ms, 2),
            "control_gap_ms": round(control_median_ms, 2),
            "control_p95_gap_ms": round(p95(control_window), 2),
            "control_worst_gap_ms": round(max(control_window), 2),
            "median_gap_ms": round(statistics.median(window), 2),
            "p95_gap_ms": round(p95(window), 2),
            "worst_gap_during_prefill_ms": round(max(prefill_gaps), 2),
            "worst_gap_after_join_ms": round(max(joined), 2),
            "median_gap_after_join_ms": round(statistics.median(joined), 2),
            "worst_gap_ms": round(worst_ms, 2),
            "worst_over_steady": round(worst_ms / steady_ms, 2),
            "worst_over_control": round(worst_ms / control_median_ms, 2),
            "worst_over_control_worst": round(worst_ms / max(control_window), 2),
            "p95_over_control_p95": round(p95(window) / p95(control_window), 2),
            "p95_over_control": round(p95(window) / control_median_ms, 2),
            "prefill_steps": phase.count("prefill"),
            "long_prompt_first_token_ms": round(sum(prefill_gaps), 1),
            "gaps_ms": [round(ms, 2) for ms in step_ms],
            "control_gaps_ms": [round(ms, 2) for ms in control_ms],
            "phases": phase,
        })
        run = results["runs"][-1]
        print(f"prefill {label:>9}: control median {control_median_ms:.1f} ms; worst {worst_ms:.1f} ms "
              f"= x{run['worst_over_control_worst']} the control's worst "
              f"(x{run['worst_over_control']} its median); p95 {run['p95_gap_ms']} ms = "
              f"x{run['p95_over_control_p95']} the control's p95 (x{run['p95_over_control']} its "
              f"median); prefill steps {phase.count('prefill')}", flush=True)
    return results


# -- 2b. served over HTTP beside the scheduler alone --------------------------------------


T = TypeVar("T")


def run_clients(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` for the benchmark's clients, on uvloop when it is installed.

    The clients share the machine with the server they measure: on a 2-core box
    every microsecond they spend per event is taken from the server beside them."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


class _StreamReader(asyncio.Protocol):
    """One streamed completion's client: counts ``data: {`` events as they arrive."""

    def __init__(self, request: bytes, times: list[float], done: asyncio.Future[None]) -> None:
        self._request = request
        self._times = times
        self._done = done
        self._tail = b""
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:  # uvloop's is no asyncio.Transport
        self._transport = transport
        self._times.append(time.perf_counter())
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._times.extend([now] * data.count(b"data: {"))
        # [DONE] in this read, or across the end of the last one and this one.
        ended = b"data: [DONE]" in data or b"data: [DONE]" in self._tail + data[:16]
        self._tail = data[-16:]
        if ended and not self._done.done():
            self._done.set_result(None)
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)


async def _stream_once(port: int, prompt: tuple[int, ...], output_tokens: int) -> list[float]:
    """One streamed completion over a raw socket; returns the arrival time of each
    ``data: {`` event before ``[DONE]`` (events that arrive in one read share a time),
    the request's send time first."""
    body = json.dumps({"prompt": list(prompt), "max_tokens": output_tokens, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n"
               b"Content-Type: application/json\r\nConnection: close\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    loop = asyncio.get_running_loop()
    times: list[float] = []
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _StreamReader(request, times, done),
                                                "127.0.0.1", port)
    try:
        await done
    finally:
        transport.close()
    return times


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def _start_engine(model_path: Path, port: int, threads: int, device: str, dtype: str,
                  largest: int, scheduler_process: bool | None, cwd: str | None = None) -> Any:
    """``tokenwire engine`` in a process of its own; ``scheduler_process=None`` gives
    neither the placement flag nor ``--threads`` (the default configuration decides both).
    ``cwd``: run it there (``python -m`` puts the working directory first on ``sys.path``:
    in the repository's root, its ``tokenwire/`` wins over a ``PYTHONPATH`` tree)."""
    import subprocess

    placement = ([] if scheduler_process is None else
                 ["--threads", str(threads),
                  "--scheduler-process" if scheduler_process else "--no-scheduler-process"])
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenwire.engine.server", "--model", str(model_path),
         "--listen", f"127.0.0.1:{port}", "--device", device,
         "--dtype", dtype, "--max-running", str(max(64, largest)),
         "--kv-budget-tokens", str(1 << 22), "--max-prefill-tokens-per-step", "2048",
         "--log-level", "warning", "--served-model-name", "bench", *placement],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    deadline_s = time.monotonic() + 180
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline_s:
                server.kill()
                error = server.stderr.read().decode() if server.stderr else ""
                raise RuntimeError("engine did not start: " + error) from None
            time.sleep(0.2)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its children (Linux ``/proc``)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return total
    return total + sum(_cpu_s(int(child)) for child in children)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bench_served(model_path: Path, loaded: LoadedModel, stream_counts: list[int],
                 output_tokens: int, threads: int, device: str, dtype: str,
                 repeats: int = 3) -> dict[str, Any]:
    """``tokenwire engine`` in its own process (uvicorn, the middleware, JSON,
    detokenisation), N raw-socket streaming clients at once, twice (the scheduler in
    its own process; and in a thread of the server, the default), against the
    scheduler alone in this process on the same prompts. Tokens per second,
    side by side: the three take turns, ``repeats`` rounds, medians. Also each
    served stream's time to first token and inter-token gaps (p50 / p99)."""
    largest = max(stream_counts)
    prompts = _prompts(loaded, largest)
    kinds = {"process": True, "thread": False}
    servers: dict[str, Any] = {}
    ports: dict[str, int] = {}
    try:
        for kind, in_process in kinds.items():
            ports[kind] = _free_port()
            servers[kind] = _start_engine(model_path, ports[kind], threads, device, dtype,
                                          largest, in_process)
            run_clients(_stream_once(ports[kind], prompts[0], 4))  # warm-up

        cpu: dict[str, list[float]] = {}

        def served(kind: str, streams: int) -> tuple[float, list[float], list[float]]:
            async def run() -> list[list[float]]:
                return await asyncio.gather(*(_stream_once(ports[kind], prompts[i], output_tokens)
                                              for i in range(streams)))
            server_cpu_s, clients_cpu_s = _cpu_s(servers[kind].pid), time.process_time()
            started_s = time.perf_counter()
            streams_times = run_clients(run())
            elapsed_s = time.perf_counter() - started_s
            cpu.setdefault(kind, []).extend([_cpu_s(servers[kind].pid) - server_cpu_s,
                                             time.process_time() - clients_cpu_s])
            events = sum(len(times) - 1 for times in streams_times)
            cpu[kind].append(events)
            if events < streams * output_tokens * 0.5:
                raise RuntimeError(f"only {events} events for {streams} streams")
            ttft = [times[1] - times[0] for times in streams_times if len(times) > 1]
            gaps = [later - earlier for times in streams_times
                    for earlier, later in itertools.pairwise(times[1:])]
            return streams * output_tokens / elapsed_s, ttft, gaps

        results: dict[str, Any] = {"output_tokens": output_tokens, "repeats": repeats,
                                   "streams": {}}
        for streams in stream_counts:
            cpu.clear()
            runs: dict[str, list[float]] = {"process": [], "thread": [], "alone": []}
            ttft: dict[str, list[float]] = {"process": [], "thread": []}
            gaps: dict[str, list[float]] = {"process": [], "thread": []}
            loads: list[float] = []
            alone_cpu_s: list[float] = []
            for _ in range(repeats):
                for kind in kinds:
                    tokens_per_s, first, between = served(kind, streams)
                    runs[kind].append(tokens_per_s)
                    ttft[kind].extend(first)
                    gaps[kind].extend(between)
                cpu_before_s = time.process_time()
                runs["alone"].append(scheduler_alone(loaded, prompts[:streams], output_tokens)[0])
                alone_cpu_s.append(time.process_time() - cpu_before_s)
                loads.append(os.getloadavg()[0])
            medians = {kind: statistics.median(values) for kind, values in runs.items()}
            row: dict[str, Any] = {
                "scheduler_only_tokens_per_s": round(medians["alone"], 1),
                "scheduler_runs": [round(x, 1) for x in runs["alone"]],
                "scheduler_cpu_s": [round(x, 2) for x in alone_cpu_s],
                # 1-minute load average after each round (the machine may be shared).
                "load_avg": [round(x, 1) for x in loads],
            }
            for kind in kinds:
                # Each served run against the scheduler-alone run of the same round: the
                # median of these follows a load that drifts between rounds less than the
                # ratio of the two medians does.
                pairs = [served_s / alone_s for served_s, alone_s in zip(runs[kind], runs["alone"],
                                                                           strict=True)]
                row[kind] = {
                    "served_tokens_per_s": round(medians[kind], 1),
                    "served_over_scheduler": round(medians[kind] / medians["alone"], 3),
                    "per_round_ratio": [round(x, 3) for x in pairs],
                    "per_round_ratio_median": round(statistics.median(pairs), 3),
                    "runs": [round(x, 1) for x in runs[kind]],
                    "ttft_ms_p50": round(1000 * _percentile(ttft[kind], 0.5), 2),
                    "ttft_ms_p99": round(1000 * _percentile(ttft[kind], 0.99), 2),
                    "itl_ms_p50": round(1000 * _percentile(gaps[kind], 0.5), 2),
                    "itl_ms_p99": round(1000 * _percentile(gaps[kind], 0.99), 2),
                    # Per round: the server's CPU seconds (its scheduler process included),
                    # the clients' (this process), and the SSE events they read.
                    "server_cpu_s": [round(x, 2) for x in cpu[kind][0::3]],
                    "clients_cpu_s": [round(x, 2) for x in cpu[kind][1::3]],
                    "events": [int(x) for x in cpu[kind][2::3]],
                }
            # The figure: the default (the scheduler thread) against the scheduler alone.
            row["served_over_scheduler"] = row["thread"]["served_over_scheduler"]
            results["streams"][str(streams)] = row
            print(f"served {streams:>3} streams (load {min(loads):.1f}-{max(loads):.1f}): "
                  f"scheduler alone {medians['alone']:7.0f} tok/s; "
                  + "; ".join(
                      f"{kind} {medians[kind]:7.0f} tok/s x{row[kind]['served_over_scheduler']:.2f}"
                      f" (per round x{row[kind]['per_round_ratio_median']:.2f})"
                      f" (TTFT p50/p99 {row[kind]['ttft_ms_p50']}/{row[kind]['ttft_ms_p99']} ms,"
                      f" ITL p50/p99 {row[kind]['itl_ms_p50']}/{row[kind]['itl_ms_p99']} ms)"
                      for kind in kinds), flush=True)
        return results
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            try:
                server.wait(20)
            except Exception:
                server.kill()


# -- 3. abort latency over HTTP ----------------------------------------------------------


def bench_abort(loaded: LoadedModel, trials: int) -> dict[str, Any]:
    import httpx
    import uvicorn
    from tokenwire.engine.api import build_app
    from tokenwire.engine.server import _wrap_in_middleware

    app = build_app(loaded, EngineConfig(kv_budget_tokens=1 << 22))
    engine = app.state.engine
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_wrap_in_middleware(app), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"

    def steps_so_far() -> float:
        return engine.metrics.registry.get_sample_value("tokenwire_engine_step_seconds_count") or 0

    background_stop = threading.Event()

    def background_stream(index: int) -> None:
        body = {"prompt": f"Background {index}", "max_tokens": 8000 - 16, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            while not background_stop.is_set():
                with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if background_stop.is_set():
                            break

    workers = [threading.Thread(target=background_stream, args=(i,), daemon=True)
               for i in range(16)]
    for worker in workers:
        worker.start()
    while len(engine.backend.batch_row_ids) < 16:
        time.sleep(0.01)
    samples = []
    for trial in range(trials):
        request_id = f"reset-{trial}"
        body = json.dumps({"prompt": "Reset me", "max_tokens": 4000, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        received = b""
        while b"data:" not in received:
            received += sock.recv(65536)
        while request_id not in engine.backend.batch_row_ids:
            time.sleep(0.0005)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        steps_before = steps_so_far()
        reset_s = time.perf_counter()
        sock.close()  # RST, not FIN
        while request_id in engine.backend.batch_row_ids:
            time.sleep(0.0002)
        left_s = time.perf_counter()
        samples.append({"ms": round((left_s - reset_s) * 1000, 2),
                        "steps": int(steps_so_far() - steps_before)})
        time.sleep(0.05)
    step_count = engine.metrics.registry.get_sample_value("tokenwire_engine_step_seconds_count")
    step_sum = engine.metrics.registry.get_sample_value("tokenwire_engine_step_seconds_sum")
    background_stop.set()
    server.should_exit = True
    thread.join(15)
    results = {
        "trials": samples,
        "median_ms": statistics.median(s["ms"] for s in samples),
        "max_ms": max(s["ms"] for s in samples),
        "median_steps": statistics.median(s["steps"] for s in samples),
        "max_steps": max(s["steps"] for s in samples),
        "mean_step_ms_under_load": round(1000 * step_sum / step_count, 2) if step_count else None,
    }
    print(f"abort: median {results['median_ms']} ms / {results['median_steps']} steps, "
          f"max {results['max_ms']} ms / {results['max_steps']} steps", flush=True)
    return results


# -- figure ---------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    streams = list(results["throughput"]["streams"])
    batched = [results["throughput"]["streams"][s]["batched_tokens_per_s"] for s in streams]
    baseline = [results["throughput"]["streams"][s]["generate_one_at_a_time_tokens_per_s"]
                for s in streams]
    x = range(len(streams))
    left.bar([i - 0.2 for i in x], baseline, 0.4, label="model.generate, one at a time")
    left.bar([i + 0.2 for i in x], batched, 0.4, label="tokenwire scheduler")
    for i, s in enumerate(streams):
        left.annotate(f"x{results['throughput']['streams'][s]['speedup']}", (i + 0.2, batched[i]),
                      ha="center", va="bottom")
    left.set_xticks(list(x), [f"{s} streams" for s in streams])
    left.set_ylabel("generated tokens / s")
    left.set_title("Aggregate throughput")
    left.legend()

    for run in results["chunked_prefill"]["runs"]:
        gaps = run["gaps_ms"]
        middle.plot(range(len(gaps)), gaps, linewidth=1,
                    label=f"{run['label']}: worst x{run['worst_over_control_worst']}, "
                          f"p95 x{run['p95_over_control_p95']} the control's")
    middle.axvline(30, color="grey", linestyle="--", label="4,000-token prompt arrives")
    middle.set_yscale("log")
    middle.set_xlabel("scheduler step")
    middle.set_ylabel("inter-token gap of the 16 streams (ms)")
    middle.set_title("Long prompt arriving during decode")
    middle.legend(fontsize=8)

    abort = results["abort"]["trials"]
    right.bar(range(len(abort)), [t["ms"] for t in abort])
    for i, trial in enumerate(abort):
        right.annotate(f"{trial['steps']}", (i, trial["ms"]), ha="center", va="bottom", fontsize=8)
    right.set_xlabel("trial (label: scheduler steps)")
    right.set_ylabel("TCP reset to row leaving the batch (ms)")
    right.set_title("Abort latency, 16 other streams running")
    figure.suptitle(results["environment"]["summary"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=4000)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64],
                        help="stream counts for the throughput and served parts")
    parser.add_argument("--served-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: steady on a shared small machine)")
    parser.add_argument("--abort-trials", type=int, default=10)
    parser.add_argument("--served-output-tokens", type=int, default=128)
    parser.add_argument("--parts", nargs="+", default=["throughput", "prefill", "served", "abort"],
                        choices=["throughput", "prefill", "served", "abort"])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "engine")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    path = ensure_tiny_model() if args.model == "tiny" else Path(args.model)
    loaded = load_model(path, device=args.device, dtype=args.dtype, name="bench")
    load_before = os.getloadavg()
    summary = (f"{args.model} on {loaded.device.type} ({loaded.dtype}), torch "
               f"{torch.__version__}, {torch.get_num_threads()} threads, "
               f"{os.cpu_count()} CPUs, load avg {load_before[0]:.1f} at start")
    print(summary, flush=True)
    results: dict[str, Any] = {"environment": {
        "summary": summary, "device": str(loaded.device), "dtype": str(loaded.dtype),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "load_avg_start": load_before,
        "python": sys.version.split()[0],
    }}
    if "throughput" in args.parts:
        results["throughput"] = bench_throughput(loaded, args.streams, args.output_tokens)
    if "prefill" in args.parts:
        results["chunked_prefill"] = bench_chunked_prefill(loaded, args.long_prompt_tokens,
                                                           args.chunk_tokens)
    if "served" in args.parts:
        results["served"] = bench_served(path, loaded, args.streams, args.served_output_tokens,
                                         args.threads, args.device, args.dtype,
                                         args.served_repeats)
    if "abort" in args.parts:
        results["abort"] = bench_abort(loaded, args.abort_trials)
    results["environment"]["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out.with_suffix('.json')}")
    if all(part in results for part in ("throughput", "chunked_prefill", "abort")):
        try:
            plot(results, args.out.with_suffix(".png"))
            print(f"wrote {args.out.with_suffix('.png')}")
        except ImportError:
            print("no figure: matplotlib is not installed (tokenwire[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
