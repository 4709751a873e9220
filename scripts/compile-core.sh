#!/usr/bin/env bash
# Compiles the hot modules of the sans-IO core (middleware/) with mypyc, in place:
# an extension beside each .py, which Python imports instead of it. Without a C
# compiler or Python's headers, or with TOKENWIRE_PURE_PYTHON=1, it removes any
# compiled modules and the core runs as the plain Python it always was.
# Reruns only when a middleware/*.py (or this build) is newer than its last run.
# Usage: scripts/compile-core.sh [--force | --clean]
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
py="$root/.venv/bin/python"
out="$root/build/mypyc"
stamp="$out/stamp"

clean() {
    rm -f middleware/*.so "$stamp"
}

if [ "${1:-}" = "--clean" ]; then clean; exit 0; fi
if [ "${TOKENWIRE_PURE_PYTHON:-}" = "1" ]; then
    echo "compile-core: TOKENWIRE_PURE_PYTHON=1, the core runs as pure Python"; clean; exit 0
fi
if ! command -v "${CC:-cc}" >/dev/null 2>&1 \
    || ! "$py" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || ! "$py" -c 'import mypyc.build' 2>/dev/null; then
    echo "compile-core: no C compiler, Python headers or mypyc; the core runs as pure Python"; clean; exit 0
fi
if [ "${1:-}" != "--force" ] && [ -f "$stamp" ] && ls middleware/_core__mypyc*.so >/dev/null 2>&1 \
    && [ -z "$(find middleware scripts/compile_core.py scripts/compile-core.sh -name '*.py' -newer "$stamp" -o -name '*.sh' -newer "$stamp")" ]; then
    exit 0
fi
clean
# A tree that lays the folders out under their import names: mypyc names a module by
# its file's path (through any link), so the core is copied there; the packages it
# only reads types from are linked, as scripts/typecheck.sh does.
tree="$out/tree"
rm -rf "$tree"
mkdir -p "$tree/tokenwire/middleware"
cp tokenwire/__init__.py "$tree/tokenwire/"
cp middleware/*.py middleware/py.typed "$tree/tokenwire/middleware/"
for pkg in sidecar engine; do ln -sfn "$root/$pkg" "$tree/tokenwire/$pkg"; done
ln -sfn "$root/tokenwire/v1" "$tree/tokenwire/v1"
touch "$stamp.new"
echo "compile-core: compiling the core with mypyc (a minute or two)"
start=$(date +%s)
(cd "$tree" && "$py" "$root/scripts/compile_core.py" "$root/pyproject.toml" "$out/c" \
    build_ext --inplace --parallel "$(nproc)" --build-temp "$out/temp" >"$out/log" 2>&1) || {
    echo "compile-core: mypyc failed (see $out/log); the core runs as pure Python" >&2
    tail -20 "$out/log" >&2; clean; exit 1
}
cp "$tree"/tokenwire/middleware/*.so middleware/
mv "$stamp.new" "$stamp"
echo "compile-core: done in $(( $(date +%s) - start )) s: $(ls middleware/*.so | wc -l) extensions"
