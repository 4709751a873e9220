"""One forward pass for a whole scheduler step: decode rows and prefill chunks packed together.

A step's tokens (one per decoding row, a chunk of prompt per prefilling
request) are packed into a single ``[1, tokens]`` sequence, each token with its
own position id, and run through the model once: embeddings, projections,
MLPs and the LM head see every token of the step in one batch. Only attention
is per segment, because each segment reads its own KV cache:

- a **lane** (decoding rows of similar width, ``batch.py``) appends one column
  to its left-padded cache and attends with its padding mask;
- a **prefill chunk** appends to its request's own cache and attends causally,
  the chunk's queries sitting at the end of the cached context.

That is done by an attention function registered with transformers under
:data:`ATTENTION_NAME`: when a forward carries a :class:`StepPlan` (the
``tokenwire_plan`` keyword, which transformers hands to every attention call)
it writes each layer's new keys and values into the plan's caches and runs one
``scaled_dot_product_attention`` per segment; without a plan (``generate``,
training) it is plain SDPA. The packed forward passes a 4-D placeholder as
``attention_mask``, which transformers takes as "already prepared" and so
builds no mask of its own: the per-segment masks are built once per step, not
per layer.

This works for decoder-only models whose attention goes through transformers'
attention interface with full causal attention (Llama, Qwen2/3 without sliding
windows, Mistral without sliding windows, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tokenwire.engine.batch import BatchCache

ATTENTION_NAME = "tokenwire_ragged"
"""The name the attention function is registered under (``config._attn_implementation``)."""

PLAN_KEYWORD = "tokenwire_plan"
"""The forward keyword carrying the :class:`StepPlan`."""


@dataclass(frozen=True, slots=True)
class LaneSegment:
    """Rows ``start .. stop`` of the packed sequence: one new token per row of ``cache``."""

    start: int
    stop: int
    cache: BatchCache
    mask: torch.Tensor
    """``[rows, 1, 1, columns]`` bool, True where a row may attend (after this step's append)."""


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """Tokens ``start .. stop`` of the packed sequence: the next chunk of one prompt."""

    start: int
    stop: int
    cache: BatchCache
    mask: torch.Tensor | None
    """``[1, 1, chunk, context]`` bool (chunk after cached tokens), or None when the chunk is
    the whole context so far (plain causal attention)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Where each packed token's keys go and what it attends to, for one forward."""

    lanes: tuple[LaneSegment, ...]
    prefills: tuple[PrefillSegment, ...]

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Append this layer's keys/values to the caches; attention output ``[1, tokens, heads, dim]``.

        ``query``/``key``/``value`` are ``[1, heads, tokens, dim]`` (key/value
        heads may be fewer: grouped-query attention).
        """
        gqa = query.shape[1] != key.shape[1]
        output = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
        for lane in self.lanes:
            a, b = lane.start, lane.stop
            # [heads, rows, dim] -> [rows, heads, 1, dim]: one query per row.
            rows_query = query[0, :, a:b].transpose(0, 1).unsqueeze(2)
            keys, values = lane.cache.layer(layer_index).update(
                key[0, :, a:b].transpose(0, 1).unsqueeze(2),
                value[0, :, a:b].transpose(0, 1).unsqueeze(2),
            )
            attended = F.scaled_dot_product_attention(
                rows_query, keys, values, attn_mask=lane.mask, scale=scaling, enable_gqa=gqa)
            output[0, a:b] = attended[:, :, 0]
        for prefill in self.prefills:
            a, b = prefill.start, prefill.stop
            keys, values = prefill.cache.layer(layer_index).update(
                key[:, :, a:b], value[:, :, a:b])
            attended = F.scaled_dot_product_attention(
                query[:, :, a:b], keys, values, attn_mask=prefill.mask,
                is_causal=prefill.mask is None, scale=scaling, enable_gqa=gqa)
            output[0, a:b] = attended[0].transpose(0, 1)
        return output


def chunk_mask(cached_tokens: int, chunk_tokens: int, device: torch.device) -> torch.Tensor | None:
    """The causal mask of a chunk that follows ``cached_tokens`` cached ones (None: none cached)."""
    if cached_tokens == 0:
        return None
    columns = torch.arange(cached_tokens + chunk_tokens, device=device).unsqueeze(0)
    last_visible = torch.arange(cached_tokens, cached_tokens + chunk_tokens, device=device).unsqueeze(1)
    return (columns <= last_visible)[None, None]


def _ragged_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plan = kwargs.pop(PLAN_KEYWORD, None)
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    assert isinstance(plan, StepPlan)
    layer_index = int(module.layer_idx)  # type: ignore[arg-type]
    return plan.attend(layer_index, query, key, value, scaling), None


def install(model: Any) -> None:
    """Register the ragged attention function and switch ``model`` to it (idempotent).

    Masks for unplanned forwards (``generate``) are built as for SDPA.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _ragged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)

