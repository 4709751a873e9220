"""Load a local Hugging Face causal-LM folder onto a device, without the network."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the scheduler: weights, tokenizer and the facts it needs."""

    model: Any
    """A ``transformers`` causal LM in eval mode (``PreTrainedModel``); ``None`` in the
    front of a scheduler process, whose weights live in that process (:func:`load_front`)."""
    tokenizer: Any
    """A ``PreTrainedTokenizerFast`` (chat template, special tokens)."""
    name: str
    path: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    default_temperature: float = 1.0
    """For requests that give none: the folder's ``generation_config.json`` (its
    ``temperature``, or 0 = greedy where it says ``do_sample: false``), else 1.0."""


def resolve_device(device: str) -> torch.device:
    """``auto`` means CUDA when torch sees one, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` means bfloat16 on CUDA and float32 on CPU (CPU half math is slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"--dtype {dtype}: expected auto or one of {sorted(_DTYPES)}") from None


def load_model(
    path: str | Path, *, device: str = "auto", dtype: str = "auto", name: str | None = None
) -> LoadedModel:
    """Load the causal LM in ``path`` (safetensors + tokenizer.json), never downloading."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a model folder (no config.json)")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa"
    )
    model.to(torch_device)
    model.eval()
    config = model.config.get_text_config(decoder=True)
    max_model_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or folder.name,
        path=folder,
        device=torch_device,
        dtype=torch_dtype,
        max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        default_temperature=_default_temperature(folder),
    )


def load_front(
    path: str | Path, *, name: str, device: str, dtype: str, max_model_len: int,
    eos_token_ids: frozenset[int],
) -> LoadedModel:
    """The tokenizer side of a model loaded in another process: no weights (``model`` is None).

    ``device``, ``dtype`` (``str()`` of the torch objects), ``max_model_len`` and
    ``eos_token_ids`` are what that process reported of the model it loaded.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return LoadedModel(
        model=None, tokenizer=tokenizer, name=name, path=folder, device=torch.device(device),
        dtype=torch_dtype, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
        default_temperature=_default_temperature(folder),
    )


def _default_temperature(folder: Path) -> float:
    """What the model's authors chose, read from the file as written (transformers'
    loaded config cannot tell a value they set from its own default)."""
    try:
        written = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return 1.0
    if not isinstance(written, dict):
        return 1.0
    if written.get("do_sample") is False:
        return 0.0
    temperature = written.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) \
            and 0.0 <= temperature <= 2.0:
        return float(temperature)
    return 1.0


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Union of the generation config's, the model config's and the tokenizer's EOS ids."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return frozenset(found)
