"""Build a bigger, randomly initialised Llama-shaped model folder from the tiny one.

Not a test. For benchmarks on a GPU, where the embedded ``tiny`` model (3 layers,
hidden 128) is too small to show what batching does to a real forward pass: the
weights are random (nothing is downloaded), the tokenizer is tiny's, and with
``ignore_eos`` the speed of a forward pass does not depend on what the weights say::

    python bench/widen_model.py --out /tmp/wide --hidden 2048 --layers 16 --heads 16
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from tokenwire.engine.tiny import ensure_tiny_model
from transformers import LlamaConfig, LlamaForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    tiny = ensure_tiny_model()
    config = LlamaConfig.from_pretrained(tiny)
    config.hidden_size = args.hidden
    config.num_hidden_layers = args.layers
    config.num_attention_heads = args.heads
    config.num_key_value_heads = args.kv_heads
    config.intermediate_size = args.intermediate
    config.head_dim = args.hidden // args.heads
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for item in tiny.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy2(item, args.out / item.name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.0f} M parameters, {args.dtype}, random weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
