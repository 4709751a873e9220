#!/usr/bin/env bash
# The engine benchmark on a lent GPU machine, in one go (bench/README.md, "Engine on a GPU").
# Needs, in .whl/: the tokenwire wheel, starlette and uvicorn (the image has torch,
# transformers, tokenizers, safetensors, h11, httpcore, uvloop, prometheus-client).
set -uo pipefail
out=${OUT:-bench/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TOKENWIRE_CACHE_DIR=/tmp/tokenwire-cache PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$out/gpu.txt"
cd /tmp  # run from outside the checkout, so the installed wheel is what gets imported
bench=$OLDPWD/bench
# 1. the embedded tiny model (3 layers, hidden 128): Python overhead dominates a step
timeout 200 python3 "$bench/engine_bench.py" --device cuda --threads 8 --abort-trials 5 \
    --chunk-tokens 64 256 --out "$out/engine_gpu_tiny" 2>&1 | grep -v Warning
# 2. a ~1 B-parameter Llama shape with random weights (tiny's tokenizer), bfloat16
timeout 60 python3 "$bench/widen_model.py" --out /tmp/wide --hidden 2048 --layers 16 --heads 16 \
    --kv-heads 8 --intermediate 5632
timeout 240 python3 "$bench/engine_bench.py" --device cuda --model /tmp/wide --threads 8 \
    --abort-trials 5 --chunk-tokens 64 256 --out "$out/engine_gpu_1b" 2>&1 | grep -v Warning
