#!/usr/bin/env bash
# The README's main-job command: the guided tour of tokenwire on the embedded
# defaults (engine with the tiny model + sidecar, real sockets), from a fresh
# checkout. Prints the report and writes ./tokenwire-demo/report.html.
# Usage: scripts/main.sh [tokenwire demo options, e.g. --out DIR --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh dev,engine,demo  # demo: matplotlib, for the report's plots
exec .venv/bin/tokenwire demo "$@"
