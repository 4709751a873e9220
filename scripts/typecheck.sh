#!/usr/bin/env bash
# mypy --strict on the middleware, the sidecar, the engine and the tools, under their import names.
# mypy cannot follow setuptools' package-dir mapping, so it is shown a tree of
# links that lays the folders out as tokenwire.middleware / .sidecar / .engine.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
tree="$root/.venv/mypy-tree"
mkdir -p "$tree/tokenwire"
ln -sfn "$root/middleware" "$tree/tokenwire/middleware"
ln -sfn "$root/sidecar" "$tree/tokenwire/sidecar"
ln -sfn "$root/engine" "$tree/tokenwire/engine"
ln -sfn "$root/tokenwire/v1" "$tree/tokenwire/v1"  # the generated gRPC messages (their .pyi)
ln -sfn "$root/tokenwire/tools" "$tree/tokenwire/tools"  # the tokenwire command and its tools
ln -sfn "$root/tokenwire/pure_python.py" "$tree/tokenwire/pure_python.py"  # TOKENWIRE_PURE_PYTHON
cd "$tree"
MYPYPATH="$tree" exec "$root/.venv/bin/python" -m mypy --strict --config-file "$root/pyproject.toml" \
    --cache-dir "$root/.mypy_cache" -p tokenwire.middleware -p tokenwire.sidecar -p tokenwire.engine -p tokenwire.tools -m tokenwire.pure_python
