"""Per-request sampling parameters and the batched next-token sampler.

Every row of a decode step carries its own parameters. Greedy rows take an
argmax over the whole group at once; sampled rows are filtered (temperature,
top-k, top-p) as one tensor and then drawn one by one, because each request
owns its ``torch.Generator``: a seeded request then gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What one request asked for. Validated here, so a bad value names its field."""

    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1 on the wire) means no top-k filter."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the output; the matched string is not returned."""
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    min_tokens: int = 0
    """EOS and stop tokens are masked, and stop strings unchecked, until this many tokens."""
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature: must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k: must be >= 0 (0 disables it)")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must be between 0 and max_tokens")
        if any(not s for s in self.stop):
            raise ValueError("stop: empty strings are not allowed")

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax, no randomness."""
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A generator for one request: seeded when asked, else from fresh entropy."""
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def mask_early_stops(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generated_counts: Sequence[int],
    eos_token_ids: frozenset[int],
) -> None:
    """Forbid EOS and stop tokens, in place, for rows still short of ``min_tokens``.

    ``ignore_eos`` rows never see EOS chosen: their EOS logits are always masked,
    which is what benchmark clients mean by it (a fixed output length).
    """
    vocab_size = logits.shape[-1]
    eos_rows: list[int] = []
    for row, (row_params, count) in enumerate(zip(params, generated_counts, strict=True)):
        early = count < row_params.min_tokens
        if row_params.ignore_eos or early:
            eos_rows.append(row)
        if early and row_params.stop_token_ids:
            stops = [token for token in row_params.stop_token_ids if 0 <= token < vocab_size]
            if stops:
                logits[row, stops] = float("-inf")
    eos_in_vocab = [token for token in eos_token_ids if 0 <= token < vocab_size]
    if eos_rows and eos_in_vocab:
        # One indexing op for all rows, not one per row: at 64 ``ignore_eos``
        # streams that was a millisecond of Python per step.
        rows = torch.tensor(eos_rows, dtype=torch.long, device=logits.device)
        columns = torch.tensor(eos_in_vocab, dtype=torch.long, device=logits.device)
        logits[rows.unsqueeze(1), columns.unsqueeze(0)] = float("-inf")


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """Pick one token per row of ``logits`` (shape ``[rows, vocab]``)."""
    rows = logits.shape[0]
    chosen = [0] * rows
    greedy_rows = [row for row in range(rows) if params[row].greedy]
    sampled_rows = [row for row in range(rows) if not params[row].greedy]
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, token in zip(greedy_rows, picks, strict=True):
            chosen[row] = int(token)
    if not sampled_rows:
        return chosen
    group = logits[sampled_rows].float()
    temperatures = torch.tensor(
        [params[row].temperature for row in sampled_rows], device=group.device
    ).unsqueeze(1)
    group = group / temperatures
    group = _apply_top_k(group, [params[row].top_k for row in sampled_rows])
    group = _apply_top_p(group, [params[row].top_p for row in sampled_rows])
    probabilities = torch.softmax(group, dim=-1)
    for index, row in enumerate(sampled_rows):
        token = torch.multinomial(probabilities[index], 1, generator=generators[row])
        chosen[row] = int(token.item())
    return chosen


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    if all(k == 0 or k >= vocab_size for k in top_ks):
        return logits
    ks = torch.tensor(
        [k if 0 < k < vocab_size else vocab_size for k in top_ks], device=logits.device
    )
    sorted_logits = logits.sort(dim=-1, descending=True).values
    thresholds = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < thresholds, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    limits = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    # Drop a token once the tokens ranked above it already reach top_p;
    # the first token always survives.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= limits
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
