"""Run every benchmark of the project, one after the other, and say where the results are.

Usage: ``.venv/bin/python bench/run_all.py [--quick]``. Each benchmark writes
its own ``bench/results/*.json`` (and PNG where it has one); bench/README.md
holds the method and the latest figures. They run one at a time on purpose:
on a small machine two benchmarks at once would measure each other.
``--quick`` is a smoke run: it overwrites the results with smaller runs, so
don't copy its figures into bench/README.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs where a benchmark has them")
    args = parser.parse_args()
    runs: list[list[str]] = [
        ["core_bench.py"] + (["--runs", "3", "--streams", "40"] if args.quick else []),
        ["middleware_bench.py"] + (["--repeats", "2", "--resets", "50"] if args.quick else []),
        ["sidecar_bench.py"] + (["--quick"] if args.quick else []),
        ["engine_bench.py"] + (["--chunk-tokens", "16", "--abort-trials", "3"] if args.quick else []),
        ["resume_bench.py"] + (["--quick"] if args.quick else []),
    ]
    failed: list[str] = []
    for script, *flags in runs:
        print(f"== {script} {' '.join(flags)}", flush=True)
        started = time.monotonic()
        result = subprocess.run([sys.executable, str(BENCH / script), *flags], check=False)
        print(f"== {script}: exit {result.returncode} after {time.monotonic() - started:.0f} s", flush=True)
        if result.returncode != 0:
            failed.append(script)
    print("results:", ", ".join(sorted(p.name for p in (BENCH / "results").glob("*.*"))))
    if failed:
        print("failed:", ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
