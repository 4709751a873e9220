"""Continuous batching over plain forward passes.

Theory of operation
-------------------
A request moves through these states, and nowhere else::

    WAITING --admitted--> PREFILLING --last chunk--> READY --joins batch--> RUNNING
       |                      |                        |                       |
       +------cancel / error / finish at the first token / stop / length -----> FINISHED

One call to :meth:`ContinuousBatchingScheduler.step` is one scheduling round:

1. **Cancellations** queued since the last step are applied: the request is
   FINISHED with reason ``abort`` whatever its state.
2. **Membership**: FINISHED rows leave the running batch and READY ones join
   it, in one rebuild of the left-padded cache (see ``batch.py``). The batch
   is split into a few *lanes* of similar width (``_choose_lane``), so one
   long prompt does not pad every short row to its length. This is
   before any forward pass, so a cancelled row costs no more compute and its
   KV memory is released now, not when the batch drains. (The same rebuild
   also ends every step, for rows that finished or became READY during it.)
3. **Admission**: WAITING requests are admitted first-come first-served while
   fewer than ``max_running`` are admitted and their reservations
   (``prompt + max_tokens`` each) fit in ``kv_budget_tokens``. Reserving the
   worst case up front means an admitted request never has to be pre-empted.
   A request that could never fit was refused by :meth:`check` already.
4. **One forward pass** (``ragged.py``) runs the step's tokens together:
   every RUNNING row's last sampled token (rows of every lane) and a chunk of
   each PREFILLING prompt, in arrival order, while the chunks fit
   ``max_prefill_tokens_per_step``, a budget in token-equivalents that counts a
   chunk's attention over the prompt cached so far (``_plan_chunks``). So a
   long prompt costs the running streams one bounded slice of a step, not its
   whole prefill, and not a second forward pass either: on a small model a
   forward's fixed cost is most of a decode step.
5. **Sampling**: every decoding row, and every request whose prompt completed
   in this forward, samples its next token from the same logits batch. A
   request that got its first token becomes READY and joins a lane at the
   membership update that ends the step.

Failures are contained where they can be pinned: an exception while handling
one request's sampled token finishes that request with reason ``error``, and
a prompt with token ids outside the vocabulary is refused at admission. A
failing forward pass (or sampling) cannot be pinned on one row, so it ends
every row that took part in that step with an error; the loop goes on.

The scheduler is single-threaded; ``engine/runner.py`` owns the thread.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenwire.engine.backend import (
    BackendStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
)
from tokenwire.engine.batch import BatchCache, RunningBatch
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.detok import Decode, OutputTextStream
from tokenwire.engine.loader import LoadedModel
from tokenwire.engine.ragged import (
    PLAN_KEYWORD,
    LaneSegment,
    PrefillSegment,
    StepPlan,
    chunk_mask,
    install,
)
from tokenwire.engine.sampling import make_generator, mask_early_stops, sample_next_tokens

_MAX_LANES = 4
_LANE_WIDTH_RATIO = 2.0
_LANE_SLACK_TOKENS = 64

logger = logging.getLogger("tokenwire.engine")


class SequenceState(enum.Enum):
    """Where a request is; see the theory of operation above."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    READY = "ready"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class _Sequence:
    request: GenerationRequest
    text: OutputTextStream
    generator: torch.Generator
    reserved_tokens: int
    state: SequenceState = SequenceState.WAITING
    prefilled_tokens: int = 0
    prefill_cache: Any = None
    next_token_id: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    admitted_s: float | None = None
    """``time.monotonic()`` when it left the waiting queue (engine metrics, traces)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id


class ContinuousBatchingScheduler:
    """The default :class:`~tokenwire.engine.backend.EngineBackend`."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self._model = loaded.model
        self._tokenizer = loaded.tokenizer
        self._device = loaded.device
        self._eos_token_ids = loaded.eos_token_ids
        self._config = config
        self.max_model_len = min(loaded.max_model_len, config.max_model_len or loaded.max_model_len)
        text_config = self._model.config.get_text_config(decoder=True)
        self.vocab_size = int(text_config.vocab_size)
        self._num_layers = int(text_config.num_hidden_layers)
        self._lanes: list[RunningBatch] = []
        self._sequences: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: list[_Sequence] = []
        self._ready: list[_Sequence] = []
        self._cancelled: list[str] = []
        self._reserved_tokens = 0
        self._pair_cost = attention_pair_cost(text_config)
        install(self._model)
        # Passed as the attention mask of the packed forward: a 4-D mask is taken
        # as prepared, so transformers builds none (the plan carries the real ones).
        self._prepared_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self._device)
        backend_tokenizer = self._tokenizer.backend_tokenizer
        self._decode_skipping: Decode = lambda ids: backend_tokenizer.decode(
            list(ids), skip_special_tokens=True
        )
        self._decode_keeping: Decode = lambda ids: backend_tokenizer.decode(
            list(ids), skip_special_tokens=False
        )

    # -- the backend interface ---------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request that can never be admitted (400) or cannot be queued (503)."""
        check_request(request, self._config, max_model_len=self.max_model_len,
                      vocab_size=self.vocab_size, waiting=len(self._waiting))

    def add(self, request: GenerationRequest) -> None:
        """Queue ``request`` (call :meth:`check` first); duplicate ids are refused."""
        if request.request_id in self._sequences:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        params = request.params
        decode = self._decode_skipping if params.skip_special_tokens else self._decode_keeping
        sequence = _Sequence(
            request=request,
            text=OutputTextStream(decode, request.prompt_token_ids, params.stop),
            generator=make_generator(params, self._device),
            reserved_tokens=len(request.prompt_token_ids) + params.max_tokens,
        )
        self._sequences[request.request_id] = sequence
        self._waiting.append(sequence)

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` at the start of the next step; unknown ids are ignored."""
        if request_id in self._sequences:
            self._cancelled.append(request_id)

    def has_work(self) -> bool:
        """Anything to admit, prefill, decode or cancel."""
        return bool(self._sequences or self._cancelled)

    def stats(self) -> BackendStats:
        """Load snapshot for metrics."""
        prefill_tokens = sum(s.prefilled_tokens for s in (*self._prefilling, *self._ready))
        return BackendStats(
            running=self._rows() + len(self._prefilling) + len(self._ready),
            waiting=len(self._waiting),
            kv_tokens_in_use=sum(lane.cached_tokens for lane in self._lanes) + prefill_tokens,
            kv_cells_allocated=sum(lane.allocated_cells for lane in self._lanes) + prefill_tokens,
            kv_tokens_reserved=self._reserved_tokens,
        )

    def state_of(self, request_id: str) -> SequenceState | None:
        """The request's state, or ``None`` once it has finished and been forgotten."""
        sequence = self._sequences.get(request_id)
        return sequence.state if sequence else None

    @property
    def batch_row_ids(self) -> list[str]:
        """Request ids of the rows the next decode forward will run, in row order."""
        return [row_id for lane in self._lanes for row_id in lane.row_ids]

    @property
    def lane_widths(self) -> list[int]:
        """Cache width of each lane (see ``_choose_lane``)."""
        return [lane.columns for lane in self._lanes]

    def _rows(self) -> int:
        return sum(lane.rows for lane in self._lanes)

    def step(self) -> list[RequestOutput]:
        """One scheduling round; see the theory of operation."""
        outputs: list[RequestOutput] = []
        self._apply_cancellations(outputs)
        self._update_membership()
        self._admit(outputs)
        with torch.inference_mode():
            self._forward(outputs)
        # Rows that finished in this step leave now rather than at the start of
        # the next one: their memory is freed even if no step follows.
        self._update_membership()
        return outputs

    # -- the steps ----------------------------------------------------------------

    def _apply_cancellations(self, outputs: list[RequestOutput]) -> None:
        cancelled, self._cancelled = self._cancelled, []
        for request_id in cancelled:
            sequence = self._sequences.get(request_id)
            if sequence is None or sequence.state is SequenceState.FINISHED:
                continue
            if sequence.state is SequenceState.WAITING:
                self._waiting.remove(sequence)
            elif sequence.state is SequenceState.PREFILLING:
                self._prefilling.remove(sequence)
            elif sequence.state is SequenceState.READY:
                self._ready.remove(sequence)
            outputs.append(self._finish(sequence, "abort"))

    def _update_membership(self) -> None:
        joining: dict[int, list[tuple[str, Any]]] = {}
        for sequence in self._ready:
            lane_index = self._choose_lane(sequence.prefilled_tokens)
            if lane_index == len(self._lanes):
                self._lanes.append(RunningBatch(self._num_layers, self._device))
            joining.setdefault(lane_index, []).append(
                (sequence.request_id, sequence.prefill_cache))
            sequence.state = SequenceState.RUNNING
            sequence.prefill_cache = None
        self._ready = []
        for lane_index, lane in enumerate(self._lanes):
            keep = {
                row_id for row_id in lane.row_ids
                if (row := self._sequences.get(row_id)) is not None
                and row.state is SequenceState.RUNNING
            }
            lane.rebuild(keep, joining.get(lane_index, []))
        self._lanes = [lane for lane in self._lanes if lane.rows]

    def _choose_lane(self, tokens: int) -> int:
        """Pick the lane a row of ``tokens`` joins; ``len(self._lanes)`` means a new one.

        Rows of one lane share a width, so a 4,000-token row in a lane of
        100-token rows would make every row in it pay for 4,000 columns of
        attention and memory, and its join would copy all of them. Rows join a
        lane whose width is within a factor of two (or 64 tokens) of theirs;
        otherwise they open a new lane, up to ``_MAX_LANES``, each lane costing
        one more attention call per layer in the step's forward pass.
        """
        best_index, best_ratio = len(self._lanes), float("inf")
        for index, lane in enumerate(self._lanes):
            width = max(lane.columns, 1)
            ratio = max(width, tokens) / max(min(width, tokens), 1)
            if ratio < best_ratio:
                best_index, best_ratio = index, ratio
            if abs(width - tokens) <= _LANE_SLACK_TOKENS:
                return index
        if best_ratio <= _LANE_WIDTH_RATIO or len(self._lanes) >= _MAX_LANES:
            return best_index
        return len(self._lanes)

    def _admit(self, outputs: list[RequestOutput]) -> None:
        budget_tokens = self._config.kv_budget_tokens
        while self._waiting:
            admitted = self._rows() + len(self._prefilling) + len(self._ready)
            head = self._waiting[0]
            if admitted >= self._config.max_running:
                return
            if self._reserved_tokens + head.reserved_tokens > budget_tokens:
                return
            self._waiting.popleft()
            self._reserved_tokens += head.reserved_tokens
            head.state = SequenceState.PREFILLING
            head.admitted_s = time.monotonic()
            prompt = head.request.prompt_token_ids
            if not prompt or not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
                # Caught here, not by the forward: that forward is every row's.
                outputs.append(self._finish(head, "error", error=(
                    "prefill failed: the prompt is empty or has token ids outside "
                    f"[0, {self.vocab_size})")))
                continue
            # Append-only layers sized for the whole prompt: a chunk does not
            # re-copy the prompt cached so far.
            head.prefill_cache = BatchCache(self._num_layers, len(prompt) + 1)
            self._prefilling.append(head)

    def _plan_chunks(self) -> list[tuple[_Sequence, int]]:
        """Prompt chunks for this step, in arrival order, within the per-step budget.

        The budget is in token-equivalents of compute, attention included: a
        chunk's tokens also attend to everything already cached, so a chunk at
        context 3,900 costs more than one at context 0 (for the tiny model about
        six times as much per token; for a 1 B model a quarter more). Counting
        it keeps the step, and so every decoding stream's inter-token gap, about
        as long at the end of a long prompt as at its start.
        """
        chunk_limit = self._config.max_prefill_tokens_per_step or None
        budget = float(chunk_limit) if chunk_limit is not None else float("inf")
        chunks: list[tuple[_Sequence, int]] = []
        for sequence in self._prefilling:
            if budget <= 0:
                break
            done = sequence.prefilled_tokens
            remaining = len(sequence.request.prompt_token_ids) - done
            tokens = min(remaining, self._affordable_tokens(done, budget))
            chunks.append((sequence, tokens))
            budget -= self._chunk_cost(done, tokens)
        return chunks

    def _chunk_cost(self, cached_tokens: int, tokens: int) -> float:
        """``tokens`` prompt tokens after ``cached_tokens``, in token-equivalents of compute."""
        return tokens * (1.0 + self._pair_cost * (cached_tokens + tokens / 2))

    def _affordable_tokens(self, cached_tokens: int, budget: float) -> int:
        """The most tokens whose :meth:`_chunk_cost` fits ``budget`` (at least one)."""
        if budget == float("inf"):
            return 1 << 62
        ratio = self._pair_cost
        if ratio == 0:
            return max(1, int(budget))
        # Solve (ratio/2) t^2 + (1 + ratio * cached) t = budget for t.
        linear = 1.0 + ratio * cached_tokens
        tokens = (-linear + math.sqrt(linear * linear + 2.0 * ratio * budget)) / ratio
        return max(1, int(tokens + 1e-9))

    def _forward(self, outputs: list[RequestOutput]) -> None:
        """Decode every running row and prefill this step's chunks in one forward pass."""
        lanes = list(self._lanes)
        lane_rows = [[self._sequences[row_id] for row_id in lane.row_ids] for lane in lanes]
        chunks = self._plan_chunks()
        if not lanes and not chunks:
            return
        token_ids: list[int] = []
        positions: list[int] = []
        sampled_at: list[int] = []  # packed index of each token whose successor is sampled now
        lane_segments: list[LaneSegment] = []
        for lane, rows in zip(lanes, lane_rows, strict=True):
            start = len(token_ids)
            token_ids.extend(sequence.next_token_id for sequence in rows)
            positions.extend(lane.token_counts)
            sampled_at.extend(range(start, len(token_ids)))
            lane_segments.append(LaneSegment(start, len(token_ids), lane.cache, lane.step_mask()))
        prefill_segments: list[PrefillSegment] = []
        completing: list[_Sequence] = []
        for sequence, tokens in chunks:
            start, done = len(token_ids), sequence.prefilled_tokens
            prompt = sequence.request.prompt_token_ids
            token_ids.extend(prompt[done : done + tokens])
            positions.extend(range(done, done + tokens))
            prefill_segments.append(PrefillSegment(start, len(token_ids), sequence.prefill_cache,
                                                   chunk_mask(done, tokens, self._device)))
            if done + tokens == len(prompt):
                sampled_at.append(len(token_ids) - 1)
                completing.append(sequence)
        decoding = [sequence for rows in lane_rows for sequence in rows]
        sampled = decoding + completing
        plan = StepPlan(tuple(lane_segments), tuple(prefill_segments))
        try:
            logits = self._run_forward(token_ids, positions, sampled_at, plan)
            params = [sequence.request.params for sequence in sampled]
            mask_early_stops(logits, params, [len(s.output_token_ids) for s in sampled],
                             self._eos_token_ids)
            next_tokens = sample_next_tokens(logits, params, [s.generator for s in sampled])
        except Exception:
            # The callers read which stage failed; the log keeps what failed.
            logger.exception("a step of %d decoding and %d prefilling requests failed",
                             len(decoding), len(chunks))
            self._fail_step(lanes, decoding, chunks, outputs)
            return
        for lane in lanes:
            lane.advance()
        for sequence, tokens in chunks:
            sequence.prefilled_tokens += tokens
        for sequence, token_id in zip(sampled, next_tokens, strict=True):
            if sequence.state is SequenceState.PREFILLING:
                self._prefilling.remove(sequence)
                output = self._accept_token_safely(sequence, token_id)
                if not output.finished:
                    sequence.state = SequenceState.READY
                    self._ready.append(sequence)
            else:
                output = self._accept_token_safely(sequence, token_id)
            outputs.append(output)

    def _run_forward(self, token_ids: list[int], positions: list[int], sampled_at: list[int],
                     plan: StepPlan) -> torch.Tensor:
        """The packed forward; logits ``[len(sampled_at), vocab]`` in float32 or wider."""
        device = self._device
        keep: int | torch.Tensor = (torch.tensor(sampled_at, dtype=torch.long, device=device)
                                    if sampled_at else 1)
        result = self._model(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            attention_mask=self._prepared_mask,
            use_cache=False,
            logits_to_keep=keep,
            **{PLAN_KEYWORD: plan},
        )
        logits: torch.Tensor = result.logits[0]
        if not sampled_at:
            return logits[:0]
        return logits if logits.dtype == torch.float64 else logits.float()

    def _fail_step(self, lanes: list[RunningBatch], decoding: list[_Sequence],
                   chunks: list[tuple[_Sequence, int]], outputs: list[RequestOutput]) -> None:
        """A forward or sampling error cannot be pinned on one row: end every row in the step.

        Their caches may hold this step's keys for some layers and not others,
        so they are dropped, not reused. Requests that could make a forward
        fail on their own (token ids outside the vocabulary) are refused at
        admission instead (``_admit``).
        """
        for sequence in decoding:
            outputs.append(self._finish(sequence, "error", error="the engine failed during a decode step"))
        for lane in lanes:
            lane.rebuild(set(), [])
        for sequence, _tokens in chunks:
            self._prefilling.remove(sequence)
            outputs.append(self._finish(sequence, "error", error="the engine failed during the prefill"))

    # -- one token, one finish ----------------------------------------------------

    def _accept_token_safely(self, sequence: _Sequence, token_id: int) -> RequestOutput:
        try:
            return self._accept_token(sequence, token_id)
        except Exception:
            logger.exception("detokenising token %d failed", token_id)
            return self._finish(sequence, "error", error="the engine failed to detokenise a token")

    def _accept_token(self, sequence: _Sequence, token_id: int) -> RequestOutput:
        params = sequence.request.params
        sequence.output_token_ids.append(token_id)
        sequence.next_token_id = token_id
        generated = len(sequence.output_token_ids)
        reason: FinishReason | None = None
        stop_reason: int | str | None = None
        text = ""
        if token_id in self._eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token_id
        else:
            text = sequence.text.push(token_id, check_stops=generated >= params.min_tokens)
            if sequence.text.stopped:
                reason, stop_reason = "stop", sequence.text.matched_stop
            elif generated >= params.max_tokens or self._at_context_end(sequence):
                reason = "length"
        if reason is None:
            return RequestOutput(
                request_id=sequence.request_id,
                text=text,
                token_ids=(token_id,),
                prompt_tokens=len(sequence.request.prompt_token_ids),
                completion_tokens=generated,
                admitted_s=sequence.admitted_s if generated == 1 else None,
            )
        return self._finish(
            sequence, reason, text=text + sequence.text.finish(), token_ids=(token_id,),
            stop_reason=stop_reason,
        )

    def _at_context_end(self, sequence: _Sequence) -> bool:
        used = len(sequence.request.prompt_token_ids) + len(sequence.output_token_ids)
        return used >= self.max_model_len

    def _finish(
        self,
        sequence: _Sequence,
        reason: FinishReason,
        *,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """Mark finished, release its reservation, forget it; the batch row leaves next step."""
        if sequence.state is not SequenceState.WAITING:
            self._reserved_tokens -= sequence.reserved_tokens
        sequence.state = SequenceState.FINISHED
        sequence.prefill_cache = None
        self._sequences.pop(sequence.request_id, None)
        return RequestOutput(
            request_id=sequence.request_id,
            text=text,
            token_ids=token_ids,
            prompt_tokens=len(sequence.request.prompt_token_ids),
            completion_tokens=len(sequence.output_token_ids),
            finished=True,
            finish_reason=reason,
            stop_reason=stop_reason,
            error=error,
            # Its first output (one token, or none): the admission time goes with it.
            admitted_s=sequence.admitted_s if len(sequence.output_token_ids) <= 1 else None,
        )


def check_request(request: GenerationRequest, config: EngineConfig, *, max_model_len: int,
                  vocab_size: int, waiting: int) -> None:
    """Refuse a request that can never be admitted (400) or cannot be queued now (503).

    Reads no scheduler state but ``waiting`` (requests queued for admission), so
    the front of a scheduler process runs it too, with the count of the last step.
    """
    prompt_tokens = len(request.prompt_token_ids)
    max_tokens = request.params.max_tokens
    if prompt_tokens == 0:
        raise RequestRejected("the prompt is empty", param="prompt")
    if prompt_tokens + max_tokens > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens",
        )
    if prompt_tokens + max_tokens > config.kv_budget_tokens:
        raise RequestRejected(
            f"This request needs {prompt_tokens + max_tokens} KV-cache tokens "
            f"({prompt_tokens} prompt + {max_tokens} max_tokens) but the engine's "
            f"KV budget is {config.kv_budget_tokens} tokens.",
            param="max_tokens",
        )
    if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab_size:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})",
                              param="prompt")
    if waiting >= config.max_waiting:
        raise RequestRejected(
            f"the engine already has {waiting} requests waiting; retry later",
            http_status=503, overloaded=True,
        )


def attention_pair_cost(text_config: Any) -> float:
    """Compute of one query attending to one cached key, in tokens through the layers' projections.

    Per layer, a token costs its multiply-adds in the q/k/v/o projections and
    the MLP; one query-key pair costs ``2 * heads * head_dim`` (scores and the
    weighted sum). Only the ratio matters: it converts context into tokens.
    """
    hidden = int(text_config.hidden_size)
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(text_config, "intermediate_size", None) or 4 * hidden)
    per_token = (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                 + 3 * hidden * intermediate)
    return 2.0 * heads * head_dim / per_token

