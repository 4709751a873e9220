"""Where a burst of client resets spends its time: a kernel timeline per stream.

Runs the scenario of ``sidecar_bench.py --resets`` (50 clients read 3 events,
then all reset back to back; the fake upstream stamps each connection's
``connection_lost``) under ``perf record -a -k CLOCK_MONOTONIC`` with
tracepoints, so every moment below is on the clock the bench stamps with:

* ``reset``: the client's stamp before its ``close()`` (``SO_LINGER`` 0);
* ``rst_in``: the proxy's socket takes the RST (``tcp:tcp_receive_reset``);
* ``lost``: tokenwire's ``connection_lost`` (a sidecar stamp, only with
  ``TW_RESET_TRACE``-instrumented code; absent otherwise);
* ``fin_out``: the proxy's upstream socket leaves ESTABLISHED (its FIN or RST,
  ``sock:inet_sock_set_state``);
* ``up_kernel``: the upstream's socket takes it (CLOSE_WAIT or CLOSE);
* ``up_stamp``: the upstream process's ``connection_lost`` stamp, the bench's figure.

Per round it also reports each process's time on a CPU from the first reset
to the last upstream stamp (``cpu_ms_by``: on this 2-core VM a third busy
process, even one not ours, is what makes a round late), the proxy's loop turns (``epoll_wait`` returns)
between the first RST taken and the last FIN sent, and whether the proxy was
on a CPU when the first RST arrived (``sched_switch``/``sched_wakeup``).

Needs ``perf`` and permission for system-wide tracepoints (root).
Usage: ``python bench/reset_trace.py --rounds 6 [--base DIR] [--stamps PATH]``
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar_bench import client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/

from testbed.targets import LOAD, PY, free_port, nginx, nginx_worker_pid, process, sidecar

EVENTS = ("sock:inet_sock_set_state", "tcp:tcp_receive_reset", "syscalls:sys_exit_epoll_wait",
          "syscalls:sys_exit_epoll_pwait", "sched:sched_switch", "sched:sched_wakeup")
_LINE = re.compile(r"^\s*(.*?)\s+(\d+)/(\d+)\s+(\d+)\.(\d+):\s+(\S+):\s*(.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


def parse_perf(path: Path) -> list[tuple[int, int, str, dict[str, str], str]]:
    """(ns, tid, event, fields, raw) of every sample, in time order."""
    out = subprocess.run(["perf", "script", "-i", str(path), "--ns", "-F", "comm,pid,tid,time,event,trace"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        _, _, tid, sec, frac, event, rest = match.groups()
        ns = int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])
        rows.append((ns, int(tid), event, dict(_FIELD.findall(rest)), rest))
    rows.sort(key=lambda row: row[0])
    return rows


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def analyse(rows: list[tuple[int, int, str, dict[str, str], str]], window: tuple[int, int],
            detail: dict[str, Any], proxy_pid: int, upstream_port: int, upstream_pid: int,
            stamps: dict[str, dict[int, list[int]]]) -> dict[str, Any]:
    """The per-stream timeline of one round (ns, within ``window``)."""
    start, end = window
    lo = bisect.bisect_left(rows, start, key=lambda row: row[0])
    hi = bisect.bisect_right(rows, end, key=lambda row: row[0])
    rst_in: dict[int, int] = {}
    left: dict[int, int] = {}
    up_kernel: dict[int, int] = {}
    epolls: list[tuple[int, int]] = []
    sched: list[tuple[int, str]] = []
    takers: list[tuple[int, int]] = []
    switches: list[tuple[int, dict[str, str]]] = []
    for ns, tid, event, f, raw in rows[lo:hi]:
        if event == "tcp:tcp_receive_reset":
            rst_in.setdefault(int(f["dport"]), ns)
        elif event == "sock:inet_sock_set_state" and f.get("oldstate") == "TCP_ESTABLISHED":
            sport, dport = int(f["sport"]), int(f["dport"])
            if dport == upstream_port:
                left.setdefault(sport, ns)
            elif sport == upstream_port:
                up_kernel.setdefault(dport, ns)
        elif event.startswith("syscalls:sys_exit_epoll") and tid == proxy_pid:
            epolls.append((ns, int(raw.rsplit(None, 1)[-1], 16)))
        elif event == "sched:sched_switch":
            switches.append((ns, f))
            if f.get("next_pid") == str(proxy_pid):
                sched.append((ns, "in"))
            elif f.get("prev_pid") == str(proxy_pid):
                # prev_state R: preempted (runnable), else it went to sleep.
                preempted = f.get("prev_state", "").startswith("R")
                sched.append((ns, "out-preempted" if preempted else "out"))
                if preempted:
                    takers.append((ns, int(f.get("next_pid", "0"))))
        elif event == "sched:sched_wakeup" and f.get("pid") == str(proxy_pid):
            sched.append((ns, "wake"))
    streams = []
    for info in detail.values():
        cport, uport = info["client_port"], info["proxy_upstream_port"]
        lost = [t for t in stamps.get("C", {}).get(cport, []) if start <= t <= end]
        s0 = [t for t in stamps.get("S0", {}).get(uport, []) if start <= t <= end]
        s1 = [t for t in stamps.get("S1", {}).get(uport, []) if start <= t <= end]
        streams.append({"reset": info["reset_ns"], "rst_in": rst_in.get(cport),
                        "lost": lost[0] if lost else None, "s0": s0[0] if s0 else None,
                        "s1": s1[0] if s1 else None, "fin_out": left.get(uport),
                        "up_kernel": up_kernel.get(uport), "up_stamp": info["upstream_closed_ns"]})

    def span(a: str, b: str) -> list[float]:
        return [(s[b] - s[a]) / 1e6 for s in streams if s[a] is not None and s[b] is not None]

    segments = {
        "reset->rst_in": span("reset", "rst_in"), "rst_in->lost": span("rst_in", "lost"),
        "lost->shutdown_call": span("lost", "s0"), "shutdown_call": span("s0", "s1"),
        "rst_in->fin_out": span("rst_in", "fin_out"), "fin_out->up_kernel": span("fin_out", "up_kernel"),
        "up_kernel->up_stamp": span("up_kernel", "up_stamp"), "reset->fin_out": span("reset", "fin_out"),
        "reset->up_stamp (bench)": span("reset", "up_stamp"),
    }
    result: dict[str, Any] = {name: {"p50": median(v), "max": round(max(v), 3) if v else None, "n": len(v)}
                              for name, v in segments.items()}
    firsts = [s["rst_in"] for s in streams if s["rst_in"] is not None]
    lasts = [s["fin_out"] for s in streams if s["fin_out"] is not None]
    resets = [s["reset"] for s in streams]
    if firsts and lasts:
        first_in, last_out = min(firsts), max(lasts)
        turns = [(t, n) for t, n in epolls if first_in <= t <= last_out]
        before = [kind.split("-")[0] for t, kind in sched if t <= first_in]
        woke = next((t for t, kind in sched if t > first_in and kind == "wake"), None)
        ran = next((t for t, kind in sched if t > first_in and kind == "in"), None)
        # Off a CPU between the first RST taken and the last FIN sent: preempted
        # (still runnable) or waiting in epoll with nothing to do.
        off_preempted = off_idle = 0
        out_at: tuple[int, str] | None = None
        for t, kind in sched:
            if kind.startswith("out"):
                out_at = (t, kind)
            elif kind == "in" and out_at is not None:
                lo_t, hi_t = max(out_at[0], first_in), min(t, last_out)
                if hi_t > lo_t:
                    if out_at[1] == "out-preempted":
                        off_preempted += hi_t - lo_t
                    else:
                        off_idle += hi_t - lo_t
                out_at = None
        lost_times = sorted(s["lost"] for s in streams if s["lost"] is not None)
        first_turn = next((t for t, _ in epolls if t >= first_in), None)
        by = ["upstream" if pid == upstream_pid else "other"
              for t, pid in takers if first_in <= t <= last_out]
        result["round"] = {
            "cpu_ms_by": _cpu_by(switches, min(resets), max(s["up_stamp"] for s in streams),
                                 {proxy_pid: "proxy", upstream_pid: "upstream"}),
            "preempted_by": {who: by.count(who) for who in set(by)},
            "preempted_ms_in_burst": round(off_preempted / 1e6, 3),
            "off_cpu_waiting_ms_in_burst": round(off_idle / 1e6, 3),
            "first_epoll_return->first_lost_ms": (round((lost_times[0] - first_turn) / 1e6, 3)
                                                  if lost_times and first_turn is not None else None),
            "client_resets_spread_ms": round((max(resets) - min(resets)) / 1e6, 3),
            "rst_in_spread_ms": round((max(firsts) - first_in) / 1e6, 3),
            "first_rst_in->last_fin_out_ms": round((last_out - first_in) / 1e6, 3),
            "first_rst_in->first_epoll_return_ms": round(((first_turn or first_in) - first_in) / 1e6, 3),
            "epoll_returns_until_last_fin": len(turns),
            "events_per_epoll_return": [n for _, n in turns][:40],
            "proxy_state_at_first_rst": before[-1] if before else "unknown",
            "first_rst_in->proxy_on_cpu_ms": (round((ran - first_in) / 1e6, 3)
                                              if ran is not None and before and before[-1] != "in" else 0.0),
            "first_rst_in->wakeup_ms": round((woke - first_in) / 1e6, 3) if woke is not None else None,
        }
    return result


def _cpu_by(switches: list[tuple[int, dict[str, str]]], start: int, end: int,
            names: dict[int, str]) -> dict[str, float]:
    """On-CPU time (ms) of each process between ``start`` and ``end``, from
    the context switches: who held the two cores while the burst was handled
    (the proxy and the upstream by role, the others by command name)."""
    since: dict[int, tuple[int, str]] = {}
    used: dict[str, float] = {}

    def count(pid: int, began: int, until: int, comm: str) -> None:
        if until > start and began < end:
            name = names.get(pid, comm)
            used[name] = used.get(name, 0.0) + (min(until, end) - max(began, start)) / 1e6

    for ns, f in switches:
        prev, nxt = int(f.get("prev_pid", "0")), int(f.get("next_pid", "0"))
        ran = since.pop(prev, None)
        if prev and ran is not None:
            count(prev, ran[0], ns, ran[1])
        if nxt:
            since[nxt] = (ns, f.get("next_comm", "?"))
    for pid, (began, comm) in since.items():  # still on a CPU when the window ended
        count(pid, began, end, comm)
    return {name: round(ms, 3) for name, ms in sorted(used.items(), key=lambda kv: -kv[1]) if ms >= 0.05}


def read_stamps(pattern: str) -> dict[str, dict[int, list[int]]]:
    stamps: dict[str, dict[int, list[int]]] = {}
    for path in Path(pattern).parent.glob(Path(pattern).name + ".*"):
        for line in path.read_text().splitlines():
            tag, key, ns, _ = line.split()
            stamps.setdefault(tag, {}).setdefault(int(key), []).append(int(ns))
    return stamps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--base", metavar="DIR", default=None, help="also this checkout as base")
    parser.add_argument("--stamps", metavar="PATH", default=None,
                        help="TW_RESET_TRACE for tokenwire (instrumented code writes PATH.<pid>)")
    parser.add_argument("--out", default=None, help="write the per-round results here (JSON)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="reset-trace-"))
    upstream_port = free_port()
    names = ["tokenwire", "nginx", *(["base"] if args.base else [])]
    ports = {name: free_port() for name in names}
    pids: dict[str, int] = {}
    windows: list[tuple[str, int, tuple[int, int], dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        upstream_pid = stack.enter_context(process([PY, LOAD, "upstream", "--port", str(upstream_port)],
                                                   "upstream")).pid
        if args.stamps:
            os.environ["TW_RESET_TRACE"] = args.stamps
        pids["tokenwire"] = stack.enter_context(sidecar(ports["tokenwire"], upstream_port)).pid
        os.environ.pop("TW_RESET_TRACE", None)
        pids["nginx"] = nginx_worker_pid(stack.enter_context(nginx(ports["nginx"], upstream_port)))
        if args.base:
            pids["base"] = stack.enter_context(sidecar(ports["base"], upstream_port, code=args.base)).pid
        perf_data = tmp / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-o", str(perf_data),
                                 *(part for event in EVENTS for part in ("-e", event))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        try:
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for name, port in ports.items():
                    started = time.monotonic_ns()
                    result = client("reset", port, upstream_port, "--streams", str(args.clients),
                                    "--concurrency", str(args.clients), "--at-once")
                    print(f"[round {round_index}] {name}: {json.dumps(result['reset_to_upstream_close'])}",
                          flush=True)
                    if round_index:
                        windows.append((name, round_index, (started, time.monotonic_ns()),
                                        result["streams_detail"]))
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
    rows = parse_perf(perf_data)
    stamps = read_stamps(args.stamps) if args.stamps else {}
    rounds = [{"target": name, "round": index,
               **analyse(rows, window, detail, pids[name], upstream_port, upstream_pid, stamps)}
              for name, index, window, detail in windows]
    summary: dict[str, Any] = {}
    for name in names:
        mine = [r for r in rounds if r["target"] == name]
        summary[name] = {key: median([r[key]["p50"] for r in mine if r[key]["n"]])
                         for key in mine[0] if isinstance(mine[0][key], dict) and "p50" in mine[0][key]}
        for key in ("preempted_ms_in_burst", "off_cpu_waiting_ms_in_burst",
                    "first_epoll_return->first_lost_ms", "first_rst_in->last_fin_out_ms",
                    "first_rst_in->first_epoll_return_ms", "epoll_returns_until_last_fin",
                    "first_rst_in->proxy_on_cpu_ms"):
            summary[name][key] = median([r["round"][key] for r in mine
                                         if "round" in r and r["round"][key] is not None])
    report = {"load_average_after": list(os.getloadavg()), "summary_medians_of_round_p50s": summary,
              "rounds": rounds}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary_medians_of_round_p50s"], indent=1))
    print("load average", report["load_average_after"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
