#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what bench/gpu_engine.sh needs on a GPU machine that has no
# network: the tokenwire wheel, the two web packages that machine's image lacks (starlette,
# uvicorn; it has anyio, click, h11, httpx, prometheus-client, uvloop, torch, transformers,
# matplotlib), and the built tiny model, so that machine spends no device time training it.
# Run here, in the repository root, with the network:  bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
rm -rf .whl && mkdir -p .whl
# Pure-Python wheels, so the GPU image's Python 3.12 takes them; the versions this venv tests.
versions=$("$python" -c "import starlette, uvicorn; print(f'starlette=={starlette.__version__} uvicorn=={uvicorn.__version__}')")
# shellcheck disable=SC2086  # two requirement words
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl $versions
"$python" -m pip wheel -q --no-deps -w .whl .
# The default tiny model, built here once (about 1.5 CPU-minutes), copied as built.
tiny=$("$python" -c "from tokenwire.engine.tiny import ensure_tiny_model; print(ensure_tiny_model())")
mkdir -p .whl/tokenwire-cache
cp -r "$tiny" .whl/tokenwire-cache/
du -sh .whl
ls .whl
