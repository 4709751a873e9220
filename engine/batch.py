"""The running batch: one left-padded KV cache whose rows join and leave.

Every row is right-aligned: its newest token sits in the last column, and a
row shorter than the widest one has padding columns on its left, masked out by
the attention mask. A decode step then appends one column for all rows, and
each row gets its own position ids (its own token count), so padding never
shifts a row's rotary positions.

Rows are rebuilt (copied) only when the membership changes, at most once per
step; columns that have become padding for every row are dropped at the same
time, so a long prompt that has left no longer widens everyone else's
attention. Between rebuilds, :class:`AppendOnlyLayer` writes new keys into
spare capacity instead of concatenating, so a decode step does not copy the
whole cache the way ``DynamicLayer`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_SPARE_COLUMNS = 64


class AppendOnlyLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # (untyped base)
    """A ``DynamicLayer`` backed by a buffer with spare columns.

    ``keys``/``values`` stay views of the filled part, so everything in
    transformers that reads them (sequence length, mask sizes) keeps working.
    """

    def __init__(self, min_capacity_columns: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._filled_columns = 0
        self._min_capacity_columns = min_capacity_columns

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take ``keys``/``values`` (``[rows, heads, columns, head_dim]``) as the whole cache."""
        columns = keys.shape[-2]
        capacity = max(columns + max(_MIN_SPARE_COLUMNS, columns // 4), self._min_capacity_columns)
        self._min_capacity_columns = 0  # a first-allocation hint only
        self._key_buffer = keys.new_empty((*keys.shape[:2], capacity, keys.shape[-1]))
        self._value_buffer = values.new_empty((*values.shape[:2], capacity, values.shape[-1]))
        self._key_buffer[:, :, :columns] = keys
        self._value_buffer[:, :, :columns] = values
        self._filled_columns = columns
        self.device = keys.device
        self.is_initialized = True
        self._refresh_views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new columns in place, growing the buffer by a quarter when full."""
        if self._key_buffer is None or self._value_buffer is None:
            self.replace(key_states, value_states)
            assert self.keys is not None and self.values is not None
            return self.keys, self.values
        new_columns = key_states.shape[-2]
        needed = self._filled_columns + new_columns
        if needed > self._key_buffer.shape[-2]:
            self.replace(
                torch.cat([self._key_buffer[:, :, : self._filled_columns], key_states], dim=-2),
                torch.cat([self._value_buffer[:, :, : self._filled_columns], value_states], dim=-2),
            )
        else:
            self._key_buffer[:, :, self._filled_columns : needed] = key_states
            self._value_buffer[:, :, self._filled_columns : needed] = value_states
            self._filled_columns = needed
            self._refresh_views()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Filled columns (padding included: it is what the mask must cover)."""
        return self._filled_columns

    def _refresh_views(self) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys = self._key_buffer[:, :, : self._filled_columns]
        self.values = self._value_buffer[:, :, : self._filled_columns]


class BatchCache(Cache):
    """A transformers ``Cache`` made of :class:`AppendOnlyLayer`, one per decoder layer.

    ``min_capacity_columns`` sizes the first allocation (a prompt's length, so
    its chunks never regrow the buffer).
    """

    def __init__(self, num_layers: int, min_capacity_columns: int = 0) -> None:
        super().__init__(layers=[AppendOnlyLayer(min_capacity_columns)
                                 for _ in range(num_layers)])

    def layer(self, index: int) -> AppendOnlyLayer:
        """Layer ``index``, typed as what this cache holds."""
        layer = self.layers[index]
        assert isinstance(layer, AppendOnlyLayer)
        return layer


class RunningBatch:
    """Rows of the decode batch: their KV, attention mask and next positions.

    Row ``i`` belongs to ``row_ids[i]``. ``token_counts[i]`` is how many real
    tokens row ``i`` has in the cache, which is also the position id of the
    token it feeds next.
    """

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self._num_layers = num_layers
        self._device = device
        self.cache = BatchCache(num_layers)
        self.row_ids: list[str] = []
        self.token_counts: list[int] = []
        self.attention_mask = torch.zeros((0, 0), dtype=torch.bool, device=device)

    @property
    def rows(self) -> int:
        """Number of sequences in the batch."""
        return len(self.row_ids)

    @property
    def columns(self) -> int:
        """Cache width: the longest row; shorter rows are left-padded to it."""
        return int(self.attention_mask.shape[1])

    @property
    def cached_tokens(self) -> int:
        """Real (unpadded) tokens held for all rows."""
        return sum(self.token_counts)

    @property
    def allocated_cells(self) -> int:
        """Rows times columns: what the padded cache actually occupies, per layer."""
        return self.rows * self.columns

    def rebuild(
        self,
        keep_row_ids: set[str],
        joining: Sequence[tuple[str, BatchCache]],
    ) -> None:
        """Drop rows not in ``keep_row_ids`` and append ``joining`` rows, in one copy.

        ``joining`` pairs a row id with the single-row cache its prefill built.
        """
        keep_rows = [row for row, row_id in enumerate(self.row_ids) if row_id in keep_row_ids]
        if len(keep_rows) == self.rows and not joining:
            return
        kept_counts = [self.token_counts[row] for row in keep_rows]
        joining_counts = [cache.get_seq_length() for _, cache in joining]
        width = max([*kept_counts, *joining_counts], default=0)
        new_row_ids = [self.row_ids[row] for row in keep_rows] + [rid for rid, _ in joining]
        if not new_row_ids:
            self._reset()
            return
        if not keep_rows and len(joining) == 1:
            # A lane of one new row (a long prompt opening its own lane): take
            # its prefill cache as it is instead of copying every column.
            self._adopt(*joining[0])
            return
        old_width = self.columns
        index = torch.tensor(keep_rows, dtype=torch.long, device=self._device)
        for layer_index in range(self._num_layers):
            parts_k: list[torch.Tensor] = []
            parts_v: list[torch.Tensor] = []
            if keep_rows:
                layer = self.cache.layer(layer_index)
                assert layer.keys is not None and layer.values is not None
                # Kept rows are right-aligned at old_width; keep the last `width` columns.
                start = old_width - width
                kept_k = layer.keys.index_select(0, index)
                kept_v = layer.values.index_select(0, index)
                parts_k.append(_fit_columns(kept_k, start, width))
                parts_v.append(_fit_columns(kept_v, start, width))
            for _, cache in joining:
                joined = cache.layer(layer_index)
                assert joined.keys is not None and joined.values is not None
                pad = width - joined.keys.shape[-2]
                parts_k.append(_fit_columns(joined.keys, -pad, width))
                parts_v.append(_fit_columns(joined.values, -pad, width))
            new_layer = self.cache.layer(layer_index)
            new_layer.replace(torch.cat(parts_k, dim=0), torch.cat(parts_v, dim=0))
        counts = kept_counts + joining_counts
        columns = torch.arange(width, device=self._device).unsqueeze(0)
        first_real = torch.tensor([width - c for c in counts], device=self._device).unsqueeze(1)
        self.attention_mask = columns >= first_real
        self.row_ids = new_row_ids
        self.token_counts = counts

    def _adopt(self, row_id: str, cache: BatchCache) -> None:
        self.cache = cache
        count = cache.get_seq_length()
        self.attention_mask = torch.ones((1, count), dtype=torch.bool, device=self._device)
        self.row_ids = [row_id]
        self.token_counts = [count]

    def step_mask(self) -> torch.Tensor:
        """Add this step's column (every row's new token) and return the ``[rows, 1, 1, columns]``
        bool mask the step's attention uses: True where a row may attend."""
        ones = torch.ones((self.rows, 1), dtype=torch.bool, device=self._device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        return self.attention_mask[:, None, None, :]

    def advance(self) -> None:
        """Record that every row gained one token (after a successful forward)."""
        self.token_counts = [count + 1 for count in self.token_counts]

    def _reset(self) -> None:
        self.cache = BatchCache(self._num_layers)
        self.row_ids = []
        self.token_counts = []
        self.attention_mask = torch.zeros((0, 0), dtype=torch.bool, device=self._device)


def _fit_columns(tensor: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Columns ``start .. start+width`` of ``tensor``; negative ``start`` pads zeros on the left."""
    if start >= 0:
        return tensor[:, :, start : start + width]
    padding = tensor.new_zeros((*tensor.shape[:2], -start, tensor.shape[-1]))
    return torch.cat([padding, tensor], dim=2)
