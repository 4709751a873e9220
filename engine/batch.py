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
_MAX_ROW_RUNS = 8
"""Kept rows in more runs than this are gathered (``index_select``) before the copy."""


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
        self.assemble([(keys, values)], keys.shape[-2])

    def assemble(self, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], columns: int) -> None:
        """Stack ``blocks`` of rows (``[rows, heads, their columns, head_dim]`` key and value
        views, each at most ``columns`` wide) into a new buffer, each block right-aligned
        at ``columns`` with zeros on its left: one copy of every block, where stacking
        them first and then filling the buffer would copy everything twice."""
        keys0, values0 = blocks[0]
        rows = sum(block_keys.shape[0] for block_keys, _ in blocks)
        capacity = max(columns + max(_MIN_SPARE_COLUMNS, columns // 4), self._min_capacity_columns)
        self._min_capacity_columns = 0  # a first-allocation hint only
        self._key_buffer = keys0.new_empty((rows, keys0.shape[1], capacity, keys0.shape[-1]))
        self._value_buffer = values0.new_empty((rows, values0.shape[1], capacity, values0.shape[-1]))
        row = 0
        for block_keys, block_values in blocks:
            count, width = block_keys.shape[0], block_keys.shape[-2]
            pad = columns - width
            if pad:
                # Padding is masked out, but it must be zeros, not whatever the
                # allocation held: a NaN there would survive a zero attention weight.
                self._key_buffer[row : row + count, :, :pad] = 0
                self._value_buffer[row : row + count, :, :pad] = 0
            self._key_buffer[row : row + count, :, pad:columns] = block_keys
            self._value_buffer[row : row + count, :, pad:columns] = block_values
            row += count
        self._filled_columns = columns
        self.device = keys0.device
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
        # Kept rows are right-aligned at old_width; keep their last `width` columns.
        start = max(old_width - width, 0)
        runs = _runs(keep_rows)
        index = (torch.tensor(keep_rows, dtype=torch.long, device=self._device)
                 if len(runs) > _MAX_ROW_RUNS else None)
        for layer_index in range(self._num_layers):
            blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
            layer = self.cache.layer(layer_index)
            if keep_rows:
                assert layer.keys is not None and layer.values is not None
                kept_k, kept_v = layer.keys[:, :, start:], layer.values[:, :, start:]
                if index is not None:
                    blocks.append((kept_k.index_select(0, index), kept_v.index_select(0, index)))
                else:
                    # A few rows left: copy the runs between them, no gather first.
                    blocks.extend((kept_k[first:end], kept_v[first:end]) for first, end in runs)
            for _, cache in joining:
                joined = cache.layer(layer_index)
                assert joined.keys is not None and joined.values is not None
                blocks.append((joined.keys, joined.values))
            layer.assemble(blocks, width)
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


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending row numbers as ``[first, end)`` runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
