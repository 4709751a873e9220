#!/usr/bin/env bash
# Compiles the hot modules of the sans-IO core (middleware/) and the sidecar's
# chunked-body reader with mypyc (the list: scripts/compile_core.py), in place:
# an extension beside each .py, which Python imports instead of it. Without a C
# compiler or Python's headers, or with TOKENWIRE_PURE_PYTHON=1, it removes any
# compiled modules and the core runs as the plain Python it always was.
# Reruns only when a .py under middleware/ or sidecar/ (or this build) is newer than its last run.
# Usage: scripts/compile-core.sh [--force | --clean | --out DIR]
#   --out DIR: leave middleware/ alone; build a compiled copy of the package as
#              DIR/tokenwire/{middleware,sidecar} (the tests run the core on it).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
py="$root/.venv/bin/python"
out="$root/build/mypyc"
stamp="$out/stamp"
mode="${1:-}"

clean() {
    find middleware sidecar -name '*.so' -delete
    rm -f "$stamp"
}

if [ "$mode" = "--clean" ]; then clean; exit 0; fi
if [ "$mode" != "--out" ] && [ "${TOKENWIRE_PURE_PYTHON:-}" = "1" ]; then
    echo "compile-core: TOKENWIRE_PURE_PYTHON=1, the core runs as pure Python"; clean; exit 0
fi
if ! command -v "${CC:-cc}" >/dev/null 2>&1 \
    || ! "$py" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || ! "$py" -c 'import mypyc.build' 2>/dev/null; then
    echo "compile-core: no C compiler, Python headers or mypyc; the core runs as pure Python"
    if [ "$mode" = "--out" ]; then exit 3; fi
    clean; exit 0
fi
if [ "$mode" = "--out" ]; then
    tree="$(realpath "$2")"; work="$tree/.build"
else
    if [ "$mode" != "--force" ] && [ -f "$stamp" ] && ls middleware/_core__mypyc*.so >/dev/null 2>&1 \
        && [ -z "$(find middleware sidecar scripts/compile_core.py scripts/compile-core.sh \
                   -newer "$stamp" \( -name '*.py' -o -name '*.sh' \))" ]; then
        exit 0
    fi
    clean
    tree="$out/tree"; work="$out"
fi
# A tree that lays the folders out under their import names: mypyc names a module by
# its file's path (through any link), so the packages it compiles from are copied
# there; those it only reads types from are linked, as scripts/typecheck.sh does.
rm -rf "$tree/tokenwire"
mkdir -p "$tree/tokenwire" "$work"
cp tokenwire/*.py "$tree/tokenwire/"
for pkg in middleware sidecar; do
    cp -r "$pkg" "$tree/tokenwire/$pkg"
    find "$tree/tokenwire/$pkg" \( -name '*.so' -o -name __pycache__ -prune \) -exec rm -rf {} +
done
ln -sfn "$root/engine" "$tree/tokenwire/engine"
ln -sfn "$root/tokenwire/v1" "$tree/tokenwire/v1"
touch "$work/stamp.new"
echo "compile-core: compiling the core with mypyc (a minute or two)"
start=$(date +%s)
(cd "$tree" && "$py" "$root/scripts/compile_core.py" "$root/pyproject.toml" "$work/c" \
    build_ext --inplace --parallel "$(nproc)" --build-temp "$work/temp" >"$work/log" 2>&1) || {
    echo "compile-core: mypyc failed (see $work/log); the core runs as pure Python" >&2
    tail -20 "$work/log" >&2
    if [ "$mode" != "--out" ]; then clean; fi
    exit 1
}
echo "compile-core: done in $(( $(date +%s) - start )) s: $(find "$tree/tokenwire" -name '*.so' | wc -l) extensions"
if [ "$mode" = "--out" ]; then
    # The engine and the gRPC messages resolve from the checkout.
    rm -f "$tree/tokenwire/engine" "$tree/tokenwire/v1"
    exit 0
fi
# New files, not overwritten ones: a running process keeps the old ones mapped.
(cd "$tree/tokenwire" && find middleware sidecar -name '*.so') | while read -r built; do
    cp "$tree/tokenwire/$built" "$built"
done
mv "$work/stamp.new" "$stamp"
