#!/usr/bin/env bash
# The engine benchmark on a lent GPU machine, in one call (docs/perf/engine.md, "Engine on a GPU").
#
#   here, once:     bash bench/gpu_wheels.sh          # fills .whl/ (git-ignored)
#   device tool:    run(command="OUT=$OUT bash bench/gpu_engine.sh", carry=[".whl"], timeout_s=600)
#
# About 6-8 minutes on one H200: the embedded tiny model, then a ~1 B-parameter Llama shape with
# random weights (bfloat16); each part under its own timeout, so one that hangs costs only its
# share. Writes engine_gpu_{tiny,1b}.{json,png}, engine_gpu_{tiny,1b}.log and gpu.txt to $OUT.
# SMOKE=1 runs the same steps on the CPU at toy sizes (a check of this script, anywhere).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
repo=$(pwd)
site=/tmp/tokenwire-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
    || { echo "no wheels: run bash bench/gpu_wheels.sh first" >&2; exit 1; }
export PYTHONPATH=$site HF_HUB_OFFLINE=1 TOKENWIRE_CACHE_DIR=/tmp/tokenwire-cache PYTHONUNBUFFERED=1
mkdir -p "$TOKENWIRE_CACHE_DIR"
[ -d .whl/tokenwire-cache ] && cp -r .whl/tokenwire-cache/. "$TOKENWIRE_CACHE_DIR"/
cd /tmp  # run from outside the checkout, so the installed wheel is what gets imported
python3 -c "import tokenwire.engine.server, starlette, uvicorn, httpx" \
    || { echo "a package is missing (see bench/gpu_wheels.sh)" >&2; exit 1; }
if [ "${SMOKE:-0}" = 1 ]; then
    device=(--device cpu --threads 2) sizes=(--streams 1 4 --output-tokens 8 --served-output-tokens 8
        --served-repeats 1 --long-prompt-tokens 300 --chunk-tokens 64 --abort-trials 2)
    widen=(--hidden 256 --layers 2 --heads 4 --kv-heads 2 --intermediate 512)
else
    device=(--device cuda --threads 8) sizes=(--streams 1 16 64 256 --served-repeats 2
        --chunk-tokens 64 256 --abort-trials 5)
    widen=(--hidden 2048 --layers 16 --heads 16 --kv-heads 8 --intermediate 5632)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
    'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"
status=0
# 1. the embedded tiny model (3 layers, hidden 128): Python overhead dominates a step
timeout 240 python3 "$repo/bench/engine_bench.py" "${device[@]}" "${sizes[@]}" \
    --out "$out/engine_gpu_tiny" > "$out/engine_gpu_tiny.log" 2>&1 || status=1
grep -v Warning "$out/engine_gpu_tiny.log" | tail -n 20
# 2. a ~1 B-parameter Llama shape with random weights (tiny's tokenizer), bfloat16
timeout 60 python3 "$repo/bench/widen_model.py" --out /tmp/wide "${widen[@]}" || status=1
timeout 270 python3 "$repo/bench/engine_bench.py" "${device[@]}" "${sizes[@]}" --model /tmp/wide \
    --out "$out/engine_gpu_1b" > "$out/engine_gpu_1b.log" 2>&1 || status=1
grep -v Warning "$out/engine_gpu_1b.log" | tail -n 20
exit $status
