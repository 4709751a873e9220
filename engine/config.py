"""Engine configuration: one frozen dataclass, built from flags, passed in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine decides with. Units are in the names."""

    model: str = "tiny"
    """``tiny`` (built locally on first use) or a path to a Hugging Face model folder."""
    served_model_name: str | None = None
    """Name reported by ``/v1/models`` and checked against requests; default: derived."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    dtype: str = "auto"
    """``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``, ``float16``, ``bfloat16``..."""
    max_running: int = 64
    """Most sequences in the running batch (prefilling ones included)."""
    kv_budget_tokens: int = 262_144
    """Admission budget: sum over admitted requests of prompt + max_tokens."""
    max_prefill_tokens_per_step: int = 256
    """Prompt tokens processed per scheduler step; 0 = whole prompts at once (no chunking)."""
    max_model_len: int | None = None
    """Context cap; default: the model's ``max_position_embeddings``."""
    max_waiting: int = 1024
    """Queued requests beyond this are refused with 503 instead of queued."""

    def __post_init__(self) -> None:
        for name in ("max_running", "kv_budget_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens_per_step < 0:
            raise ValueError("max_prefill_tokens_per_step: must be >= 0 (0 = no chunking)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len: must be >= 2")
