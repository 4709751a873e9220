#!/usr/bin/env bash
# The checkout's compiled modules: setup.py's own build (the module list and the
# rules: setup.py), run in place, so an extension lands beside each .py and Python
# imports it instead. Where setup.py cannot compile (no C compiler, Python headers or
# mypyc), or with TOKENWIRE_PURE_PYTHON=1, it removes any compiled modules and the
# code runs as the plain Python it always was.
# Reruns only when a .py under middleware/ or sidecar/ (or the build) is newer than its last run.
# Usage: scripts/compile-core.sh [--force | --clean | --out DIR]
#   --out DIR: leave the checkout alone; build a compiled copy of the package as
#              DIR/tokenwire (the tests run the other path on it).
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
    echo "compile-core: TOKENWIRE_PURE_PYTHON=1, the code runs as pure Python"; clean; exit 0
fi
if why="$(env -u TOKENWIRE_PURE_PYTHON "$py" -c 'import setup, sys; why = setup._why_pure(); print(why or ""); sys.exit(why is None)')"; then
    echo "compile-core: $why; the code runs as pure Python"
    if [ "$mode" = "--out" ]; then exit 3; fi
    clean; exit 0
fi
if [ "$mode" = "--out" ]; then
    tree="$(realpath "$2")"; work="$tree/.build"
    rm -rf "$tree/tokenwire"
    build=(build_py --build-lib "$tree" build_ext --build-lib "$tree")
else
    if [ "$mode" != "--force" ] && [ -f "$stamp" ] && ls middleware/_core__mypyc*.so >/dev/null 2>&1 \
        && [ -z "$(find middleware sidecar setup.py scripts/compile-core.sh -newer "$stamp" \
                   \( -name '*.py' -o -name '*.sh' \))" ]; then
        exit 0
    fi
    # New files, not overwritten ones: a running process keeps the old ones mapped.
    clean
    work="$out"
    build=(build_ext --inplace)
fi
mkdir -p "$work"
touch "$work/stamp.new"
echo "compile-core: compiling with mypyc (a minute or two)"
start=$(date +%s)
TOKENWIRE_MYPYC_DIR="$work" TOKENWIRE_REQUIRE_COMPILED=1 "$py" setup.py -q "${build[@]}" \
    --parallel "$(nproc)" --build-temp "$work/temp" >"$work/log" 2>&1 || {
    echo "compile-core: mypyc failed (see $work/log); the code runs as pure Python" >&2
    tail -20 "$work/log" >&2
    if [ "$mode" != "--out" ]; then clean; fi
    exit 1
}
if [ "$mode" = "--out" ]; then
    echo "compile-core: done in $(( $(date +%s) - start )) s: $(find "$tree/tokenwire" -name '*.so' | wc -l) extensions"
    exit 0
fi
# setuptools copies an extension it did not need to relink with its old time; the
# set is this build's (tests/conftest.py compares each with its .py).
find middleware sidecar -name '*.so' -exec touch {} +
echo "compile-core: done in $(( $(date +%s) - start )) s: $(find middleware sidecar -name '*.so' | wc -l) extensions"
mv "$work/stamp.new" "$stamp"
