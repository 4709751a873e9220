#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv from the project's own files.
# Usage: scripts/setup-venv.sh EXTRAS   (e.g. "dev,engine")
# torch is pinned to its CPU build before the engine extra is resolved, so pip
# never reaches for a multi-GB CUDA build: from what pip's configuration offers
# without an index (a local wheel folder), else from PyTorch's CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev,engine}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=".venv/.tokenwire-installed-$(echo "$extras" | tr ',' '-')"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    case "$extras" in *engine*)
        # torch itself without an index (its dependencies come from the usual one, next).
        if .venv/bin/python -m pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
            .venv/bin/python -m pip install -q "torch==2.13.0"
        else
            .venv/bin/python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
        fi ;;
    esac
    .venv/bin/python -m pip install -q -e ".[${extras}]"
    touch "$stamp"
fi
# The hot modules of the wire core, compiled with mypyc where a C compiler and
# Python's headers are present (skipped with TOKENWIRE_PURE_PYTHON=1; reruns
# only when their sources change). A failed build leaves the pure-Python core,
# which behaves the same.
scripts/compile-core.sh || echo "setup-venv: the core stays pure Python" >&2
