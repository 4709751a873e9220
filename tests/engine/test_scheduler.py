"""The continuous-batching scheduler, driven step by step on the real tiny model."""

from __future__ import annotations

import pytest
import torch
from tokenwire.engine.backend import GenerationRequest, RequestOutput, RequestRejected
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel
from tokenwire.engine.ragged import chunk_mask
from tokenwire.engine.sampling import SamplingParams
from tokenwire.engine.scheduler import (
    ContinuousBatchingScheduler,
    SequenceState,
    attention_pair_cost,
)

PROMPTS = (
    "The kitchen is",
    "In the morning the sun rises over the hills and the river runs",
    "Trees",
    "A good meeting has a reason to exist, a short list of things to decide, and an end time "
    "that everyone respects. Many meetings could be replaced by",
    "Bees visit flowers to collect",
)


def _ids(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer(text).input_ids)


def _run_to_end(
    scheduler: ContinuousBatchingScheduler, collected: dict[str, list[RequestOutput]]
) -> None:
    for _ in range(10_000):
        if not scheduler.has_work():
            return
        for output in scheduler.step():
            collected.setdefault(output.request_id, []).append(output)
    raise AssertionError("scheduler did not drain")


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def test_greedy_batched_output_equals_model_generate_token_for_token(
    tiny_f64: LoadedModel,
) -> None:
    # Small prefill chunks and staggered arrivals: rows join a batch that is
    # already decoding, prompts are split across steps, rows have different widths.
    scheduler = ContinuousBatchingScheduler(tiny_f64, EngineConfig(max_prefill_tokens_per_step=7))
    max_new_tokens = 24
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    collected: dict[str, list[RequestOutput]] = {}
    for index, prompt in enumerate(PROMPTS):
        request = GenerationRequest(f"r{index}", _ids(tiny_f64, prompt), params)
        scheduler.check(request)
        scheduler.add(request)
        for output in scheduler.step():
            collected.setdefault(output.request_id, []).append(output)
    _run_to_end(scheduler, collected)

    for index, prompt in enumerate(PROMPTS):
        input_ids = torch.tensor([_ids(tiny_f64, prompt)])
        reference = tiny_f64.model.generate(
            input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False,
        )[0, input_ids.shape[1]:].tolist()
        assert _tokens(collected[f"r{index}"]) == reference, prompt


def test_abort_removes_the_row_at_the_next_step(tiny_f32: LoadedModel) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for index in range(3):
        scheduler.add(GenerationRequest(f"r{index}", _ids(tiny_f32, PROMPTS[index]), params))
    while len(scheduler.batch_row_ids) < 3:
        scheduler.step()
    cells_before = scheduler.stats().kv_cells_allocated

    scheduler.cancel("r1")
    outputs = scheduler.step()

    assert scheduler.batch_row_ids == ["r0", "r2"]
    assert scheduler.state_of("r1") is None
    aborted = [o for o in outputs if o.request_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert aborted[0].token_ids == ()  # no forward pass ran for it after the cancel
    assert aborted[0].completion_tokens > 0  # but what it generated is still counted
    assert scheduler.stats().kv_cells_allocated < cells_before
    assert {o.request_id for o in outputs} == {"r0", "r1", "r2"}


def test_cancel_of_a_waiting_request_never_admits_it(tiny_f32: LoadedModel) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig(max_running=1))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest("first", _ids(tiny_f32, PROMPTS[0]), params))
    scheduler.add(GenerationRequest("second", _ids(tiny_f32, PROMPTS[1]), params))
    scheduler.step()
    assert scheduler.state_of("second") is SequenceState.WAITING

    scheduler.cancel("second")
    outputs = scheduler.step()

    assert [o.finish_reason for o in outputs if o.request_id == "second"] == ["abort"]
    assert scheduler.stats().kv_tokens_reserved == len(_ids(tiny_f32, PROMPTS[0])) + 50


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "budget_tokens", "phrase"),
    [
        (8000, 500, 1_000_000, "maximum context length is 8192 tokens"),
        (100, 200, 256, "KV budget is 256 tokens"),
        (0, 10, 1000, "prompt is empty"),
    ],
)
def test_a_request_that_can_never_fit_is_rejected_with_400(
    tiny_f32: LoadedModel, prompt_tokens: int, max_tokens: int, budget_tokens: int, phrase: str
) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig(kv_budget_tokens=budget_tokens))
    request = GenerationRequest("big", (5,) * prompt_tokens, SamplingParams(max_tokens=max_tokens))
    with pytest.raises(RequestRejected) as raised:
        scheduler.check(request)
    assert raised.value.http_status == 400
    assert phrase in raised.value.message


def test_admission_respects_max_running_and_the_kv_budget(tiny_f32: LoadedModel) -> None:
    prompt = _ids(tiny_f32, PROMPTS[1])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    per_request = len(prompt) + 20
    # Budget for exactly two requests, max_running for three: the budget binds.
    config = EngineConfig(max_running=3, kv_budget_tokens=2 * per_request + per_request // 2)
    scheduler = ContinuousBatchingScheduler(tiny_f32, config)
    for index in range(5):
        scheduler.add(GenerationRequest(f"r{index}", prompt, params))
    peak_running = 0
    finished: list[str] = []
    while scheduler.has_work():
        outputs = scheduler.step()
        stats = scheduler.stats()
        peak_running = max(peak_running, stats.running)
        assert stats.kv_tokens_reserved <= config.kv_budget_tokens
        finished += [o.request_id for o in outputs if o.finished]
    assert peak_running == 2
    assert finished == [f"r{index}" for index in range(5)]  # first come, first served


def test_one_failing_request_ends_with_an_error_and_the_others_finish(
    tiny_f32: LoadedModel,
) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest("good-1", _ids(tiny_f32, PROMPTS[0]), params))
    # A token id past the vocabulary makes the embedding lookup raise in prefill.
    scheduler.add(GenerationRequest("broken", (1, 2, 10**6), params))
    scheduler.add(GenerationRequest("good-2", _ids(tiny_f32, PROMPTS[2]), params))
    collected: dict[str, list[RequestOutput]] = {}
    _run_to_end(scheduler, collected)

    broken = collected["broken"][-1]
    assert broken.finish_reason == "error" and broken.error and "prefill failed" in broken.error
    for good in ("good-1", "good-2"):
        assert collected[good][-1].finish_reason == "length"
        assert len(_tokens(collected[good])) == 10


def test_chunked_prefill_caps_prompt_tokens_per_step_while_others_decode(
    tiny_f32: LoadedModel,
) -> None:
    chunk_tokens = 16
    scheduler = ContinuousBatchingScheduler(
        tiny_f32, EngineConfig(max_prefill_tokens_per_step=chunk_tokens)
    )
    decode_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest("decoding", _ids(tiny_f32, PROMPTS[0]), decode_params))
    while scheduler.batch_row_ids != ["decoding"]:
        scheduler.step()
    long_prompt = (7,) * 100
    scheduler.add(GenerationRequest("long", long_prompt, SamplingParams(max_tokens=5)))
    chunks: list[int] = []
    pair_cost = attention_pair_cost(tiny_f32.model.config)
    while True:
        cached = scheduler.stats().kv_tokens_in_use
        outputs = scheduler.step()
        chunks.append(scheduler.stats().kv_tokens_in_use - cached - 1)  # minus the decoded token
        # The decoding stream gets a token in every step of the long prefill.
        assert [o.request_id for o in outputs if o.request_id == "decoding"] == ["decoding"]
        if any(o.request_id == "long" for o in outputs):
            break
    assert sum(chunks) == len(long_prompt)
    # Each chunk fits the budget once its attention over the cached prompt is counted:
    # the first is (nearly) the full 16 tokens, later ones shrink as the context grows.
    assert chunk_tokens - 1 <= chunks[0] <= chunk_tokens
    done = 0
    for tokens in chunks[:-1]:
        assert tokens * (1 + pair_cost * (done + tokens / 2)) <= chunk_tokens
        assert (tokens + 1) * (1 + pair_cost * (done + (tokens + 1) / 2)) > chunk_tokens
        done += tokens
    assert chunks == sorted(chunks, reverse=True)


def test_stop_string_cuts_the_text_and_reports_it(tiny_f32: LoadedModel) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest("free", _ids(tiny_f32, PROMPTS[0]), greedy))
    free: dict[str, list[RequestOutput]] = {}
    _run_to_end(scheduler, free)
    full_text = "".join(o.text for o in free["free"])
    stop = full_text.strip()[4:7]
    assert stop

    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    scheduler.add(GenerationRequest("stopped", _ids(tiny_f32, PROMPTS[0]), stopped))
    collected: dict[str, list[RequestOutput]] = {}
    _run_to_end(scheduler, collected)

    final = collected["stopped"][-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(o.text for o in collected["stopped"]) == full_text[: full_text.index(stop)]


def test_seeded_sampling_does_not_depend_on_batch_companions(tiny_f32: LoadedModel) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)

    def run(companions: int) -> list[int]:
        scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
        scheduler.add(GenerationRequest("seeded", _ids(tiny_f32, PROMPTS[1]), params))
        for index in range(companions):
            scheduler.add(GenerationRequest(
                f"other{index}", _ids(tiny_f32, PROMPTS[index % len(PROMPTS)]),
                SamplingParams(max_tokens=30, temperature=1.0)))
        collected: dict[str, list[RequestOutput]] = {}
        _run_to_end(scheduler, collected)
        return _tokens(collected["seeded"])

    alone = run(0)
    assert run(4) == alone
    assert len(alone) == 20


def test_min_tokens_and_stop_token_ids(tiny_f32: LoadedModel) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest("free", _ids(tiny_f32, PROMPTS[2]), free))
    collected: dict[str, list[RequestOutput]] = {}
    _run_to_end(scheduler, collected)
    tokens = _tokens(collected["free"])
    stop_token = tokens[3]
    first_stop_at = tokens.index(stop_token)

    by_token = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                              stop_token_ids=frozenset({stop_token}))
    scheduler.add(GenerationRequest("by-token", _ids(tiny_f32, PROMPTS[2]), by_token))
    _run_to_end(scheduler, collected)
    final = collected["by-token"][-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop_token
    assert final.completion_tokens == first_stop_at + 1

    # min_tokens masks the stop token until enough tokens were generated.
    held = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                          stop_token_ids=frozenset({stop_token}), min_tokens=first_stop_at + 2)
    scheduler.add(GenerationRequest("held", _ids(tiny_f32, PROMPTS[2]), held))
    _run_to_end(scheduler, collected)
    assert collected["held"][-1].completion_tokens >= first_stop_at + 2


def _generate(loaded: LoadedModel, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    output = loaded.model.generate(input_ids, max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in output[0, input_ids.shape[1]:]]


def _mixed_run(loaded: LoadedModel, max_new_tokens: int) -> tuple[dict[str, list[int]], int, int]:
    """Three rows decoding when two prompts arrive together, one of them long enough
    to open its own lane: steps mix decode rows of two lanes with two prompts' chunks.
    Returns (tokens by request, steps with work, forward passes)."""
    forwards = [0]
    hook = loaded.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        scheduler = ContinuousBatchingScheduler(loaded, EngineConfig(max_prefill_tokens_per_step=12))
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        prompts = {f"r{i}": _ids(loaded, PROMPTS[i]) for i in range(3)}
        prompts["long"] = _ids(loaded, " ".join(PROMPTS) * 2)
        prompts["late"] = _ids(loaded, PROMPTS[4])
        collected: dict[str, list[RequestOutput]] = {}
        steps = 0
        for request_id in ("r0", "r1", "r2"):
            scheduler.add(GenerationRequest(request_id, prompts[request_id], params))
        while len(scheduler.batch_row_ids) < 3:
            for output in scheduler.step():
                collected.setdefault(output.request_id, []).append(output)
            steps += 1
        scheduler.add(GenerationRequest("long", prompts["long"], params))
        scheduler.add(GenerationRequest("late", prompts["late"], params))
        most_lanes = 0
        for _ in range(10_000):
            if not scheduler.has_work():
                break
            for output in scheduler.step():
                collected.setdefault(output.request_id, []).append(output)
            steps += 1
            most_lanes = max(most_lanes, len(scheduler.lane_widths))
        assert not scheduler.lane_widths
        assert most_lanes == 2  # the long prompt decoded in a lane of its own
    finally:
        hook.remove()
    return ({rid: _tokens(outs) for rid, outs in collected.items()}
            | {f"prompt:{rid}": list(p) for rid, p in prompts.items()}, steps, forwards[0])


def test_mixed_steps_run_one_forward_and_equal_model_generate(tiny_f64: LoadedModel) -> None:
    tokens, steps, forwards = _mixed_run(tiny_f64, 20)
    assert forwards == steps  # one forward per step: decode rows and chunks together
    for request_id in ("r0", "r1", "r2", "long", "late"):
        prompt = tuple(tokens[f"prompt:{request_id}"])
        assert tokens[request_id] == _generate(tiny_f64, prompt, 20), request_id


def test_grouped_query_attention_model_equals_model_generate(tiny_f64: LoadedModel) -> None:
    """Fewer key/value heads than query heads (Llama 3, Qwen): the ragged attention's GQA path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tiny_f64.model.config.vocab_size, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    loaded = LoadedModel(model=model, tokenizer=tiny_f64.tokenizer, name="gqa", path=tiny_f64.path,
                         device=torch.device("cpu"), dtype=torch.float64, max_model_len=1024,
                         eos_token_ids=frozenset())
    tokens, steps, forwards = _mixed_run(loaded, 12)
    assert forwards == steps
    for request_id in ("r0", "r1", "r2", "long", "late"):
        prompt = tuple(tokens[f"prompt:{request_id}"])
        assert tokens[request_id] == _generate(loaded, prompt, 12), request_id


def test_a_prompt_outside_the_vocabulary_is_refused_with_400(tiny_f32: LoadedModel) -> None:
    scheduler = ContinuousBatchingScheduler(tiny_f32, EngineConfig())
    for prompt in ((1, 2, scheduler.vocab_size), (-1, 5)):
        with pytest.raises(RequestRejected) as raised:
            scheduler.check(GenerationRequest("bad", prompt, SamplingParams(max_tokens=4)))
        assert raised.value.http_status == 400 and raised.value.param == "prompt"


def test_chunk_mask_lets_each_chunk_token_see_the_cache_and_its_predecessors() -> None:
    mask = chunk_mask(3, 2, torch.device("cpu"))
    assert mask is not None and mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, True, False],
                                   [True, True, True, True, True]]
    assert chunk_mask(0, 4, torch.device("cpu")) is None  # plain causal: SDPA's is_causal
