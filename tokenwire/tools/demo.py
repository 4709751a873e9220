"""``tokenwire demo``: the guided tour, live over real sockets.

It starts ``tokenwire up`` (engine on a Unix socket, sidecar in front) on free
ports, or uses one already running (``--url`` plus ``--engine-socket``), and
shows, section by section:

1. the wire: the first and last frames of a streamed chat completion, as the
   bytes the sidecar wrote (HTTP/1.1 chunked framing around SSE events);
2. timing: TTFT and inter-token gaps (from the first token on) over a few
   parallel streams, with tokens counted from the usage block (the ``probe``
   functions);
3. a slow reader under each slow-client policy, side by side: one extra
   sidecar per policy in front of the same engine, each read by a raw socket
   with a small receive buffer that takes 512 bytes every 50 ms, plus the same
   reader straight at the engine for reference; each sidecar logs at debug, so
   the times it stopped reading the upstream (what ``block`` does) are counted,
   and the report says in words what each row's figures show;
4. a dropped connection: a long answer reset mid-stream (RST), and the
   engine's running count before and after;
5. resume: an answer cut mid-stream and resumed with ``Last-Event-ID`` on a
   resumable sidecar, the text proven identical to an uninterrupted run and the
   engine's token counter proving it generated once; then an idempotent repeat.

The same figures go to ``--out`` as ``report.html`` (with matplotlib PNGs) and
``report.json``. The exit status is 0 only if every section ran and its key
claim held; otherwise the failed checks are printed.

The tour is four modules: this one (the command, the checks), ``demo_sections``
(the five sections), ``demo_client`` (the raw-socket client) and
``demo_report`` (the terminal, HTML and JSON reports).
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import up
from .demo_client import DemoError, engine_model_name, tcp_connector
from .demo_report import write_report
from .demo_sections import (
    DemoSettings,
    section_drop,
    section_resume,
    section_slow_reader,
    section_timing,
    section_wire,
)


def _checks(report: dict[str, Any]) -> list[str]:
    """The claims each section exists to show; a failed one fails the demo."""
    failures = []
    if not report["wire"]["complete"]:
        failures.append(f"the wire section's answer was not complete: {report['wire']['answer']['error']}")
    timing = report["timing"]
    if timing["ok"] != timing["requests"]:
        failures.append(f"timing: only {timing['ok']}/{timing['requests']} streams complete")
    for row in report["slow_reader"]["rows"]:
        if row["policy"] in ("coalesce", "block") and not row["complete"]:
            failures.append(f"slow reader under {row['policy']}: answer incomplete ({row['error']})")
    if not report["drop"]["dropped"]:
        failures.append("the engine's running count did not drop after the reset")
    resume = report["resume"]
    if not (resume["text_identical"] and resume["ids_contiguous"] and resume["resumed_complete"]):
        failures.append("resume: the resumed text was not the uninterrupted text, complete and in order")
    if resume["engine_tokens_for_interrupted_run"] > resume["max_tokens"]:
        failures.append("resume: the engine generated more than one answer's tokens")
    if not resume["idempotent_same_text"] or resume["idempotent_second_engine_tokens"] > 0:
        failures.append("resume: an idempotent repeat generated again")
    return failures


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _progress(message: str) -> None:
    print(f"tokenwire demo: {message}", file=sys.stderr, flush=True)


def run_tour(api_url: str, engine_socket: str, settings: DemoSettings, workdir: Path,
             sidecar_log: Path | None, *, echo: bool) -> dict[str, Any]:
    """Run sections 1-4 against a running sidecar and engine; return the report data."""
    match = re.fullmatch(r"http://([^/:]+|\[[^]]+\]):(\d+)/?", api_url)
    if match is None:
        raise DemoError(f"--url must be http://HOST:PORT (plain HTTP), got {api_url!r}")
    api = tcp_connector(match.group(1).strip("[]"), int(match.group(2)))
    if not Path(engine_socket).exists():
        raise DemoError(f"no engine socket at {engine_socket}")
    model = engine_model_name(engine_socket)
    report: dict[str, Any] = {"api_url": api_url, "engine_socket": engine_socket, "model": model,
                              "settings": asdict(settings)}
    started = time.perf_counter()
    _progress("[1/5] the wire: one streamed answer as bytes")
    report["wire"] = section_wire(api, model)
    _progress(f"[2/5] timing: {settings.timing_requests} streams, "
              f"{settings.timing_concurrency} at a time")
    report["timing"] = section_timing(api_url, model, settings)
    _progress("[3/5] a slow reader under coalesce / block / drop, and direct")
    report["slow_reader"] = section_slow_reader(engine_socket, model, settings, workdir, echo=echo)
    _progress("[4/5] a dropped connection")
    report["drop"] = section_drop(api, engine_socket, model, settings, sidecar_log)
    _progress("[5/5] resume: a cut answer resumed with Last-Event-ID, and an idempotent repeat")
    report["resume"] = section_resume(engine_socket, model, settings, workdir, echo=echo)
    report["tour_s"] = round(time.perf_counter() - started, 1)
    report["failures"] = _checks(report)
    return report



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire demo`` flags."""
    parser.description = "The guided tour of tokenwire, live over real sockets."
    parser.add_argument("--url", help="a running sidecar (http://HOST:PORT); default: start `up`")
    parser.add_argument("--engine-socket", metavar="PATH",
                        help="the engine's Unix socket behind --url (for the slow-reader sidecars "
                             "and the engine's metrics)")
    parser.add_argument("--model", default="tiny", help="model for the started engine: tiny or a folder")
    parser.add_argument("--out", default="tokenwire-demo", help="report folder (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter streams")
    parser.add_argument("--verbose", action="store_true", help="echo the children's logs")


def main(argv: Sequence[str] | None = None) -> int:
    """``tokenwire demo``: run the tour, print the report, write the HTML; 0 if all checks held."""
    parser = argparse.ArgumentParser(prog="tokenwire demo", allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if bool(args.url) != bool(args.engine_socket):
        parser.error("--url and --engine-socket go together")
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    out_dir = Path(args.out)
    # SIGTERM unwinds like Ctrl-C, so every child started here is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="tokenwire-demo-") as tmp:
            workdir = Path(tmp)
            if args.url:
                report = run_tour(args.url, args.engine_socket, settings, workdir, None,
                                  echo=args.verbose)
            else:
                _progress("starting tokenwire up on free ports")
                sidecar_log = workdir / "sidecar.jsonl"
                with up.running(listen=_free_address(), admin_listen=_free_address(),
                                model=args.model, echo=args.verbose, announce=True,
                                sidecar_args=["--log-file", str(sidecar_log)]) as endpoints:
                    report = run_tour(endpoints.api_url, endpoints.engine_socket, settings,
                                      workdir, sidecar_log, echo=args.verbose)
    except (up.UpError, DemoError) as error:
        print(f"tokenwire demo: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"tokenwire demo: network error: {error}", file=sys.stderr)
        return 1
    except subprocess.SubprocessError as error:
        print(f"tokenwire demo: could not run a child process: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenwire demo: interrupted", file=sys.stderr)
        return 130
    report["total_s"] = round(time.perf_counter() - started, 1)
    text = write_report(report, out_dir)
    print(text, end="")
    print(f"report: {out_dir / 'report.html'} (tour {report['tour_s']} s, "
          f"total {report['total_s']} s)")
    if report["failures"]:
        print(f"tokenwire demo: {len(report['failures'])} check(s) failed", file=sys.stderr)
        return 1
    return 0

