"""The engine thread's hand-off to asyncio."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenwire.engine.backend import BackendStats, GenerationRequest, RequestOutput
from tokenwire.engine.config import EngineConfig
from tokenwire.engine.loader import LoadedModel
from tokenwire.engine.runner import EngineRunner
from tokenwire.engine.sampling import SamplingParams
from tokenwire.engine.scheduler import ContinuousBatchingScheduler


def test_each_step_is_delivered_with_exactly_one_call_soon_threadsafe(
    tiny_f32: LoadedModel,
) -> None:
    async def scenario() -> tuple[int, int, dict[str, list[RequestOutput]]]:
        loop = asyncio.get_running_loop()
        hand_offs = 0
        original = loop.call_soon_threadsafe

        def counting_call_soon_threadsafe(callback: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal hand_offs
            hand_offs += 1
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting_call_soon_threadsafe  # type: ignore[method-assign]
        queues: dict[str, asyncio.Queue[RequestOutput]] = {f"r{i}": asyncio.Queue() for i in range(4)}
        steps_with_outputs = 0

        def deliver(outputs: list[RequestOutput]) -> None:
            for output in outputs:
                queues[output.request_id].put_nowait(output)

        def on_step(step_s: float, stats: BackendStats) -> None:
            nonlocal steps_with_outputs
            steps_with_outputs += 1  # every step here produces outputs

        runner = EngineRunner(ContinuousBatchingScheduler(tiny_f32, EngineConfig()), deliver,
                              on_step=on_step)
        runner.start(loop)
        try:
            for request_id in queues:
                runner.submit(GenerationRequest(
                    request_id, (5, 6, 7), SamplingParams(max_tokens=10, ignore_eos=True)))
            collected: dict[str, list[RequestOutput]] = {}
            for request_id, queue in queues.items():
                while True:
                    output = await asyncio.wait_for(queue.get(), 30)
                    collected.setdefault(request_id, []).append(output)
                    if output.finished:
                        break
        finally:
            runner.stop()
            loop.call_soon_threadsafe = original  # type: ignore[method-assign]
        return hand_offs, steps_with_outputs, collected

    hand_offs, steps, collected = asyncio.run(scenario())
    assert hand_offs == steps
    assert steps < sum(len(outputs) for outputs in collected.values())  # outputs were batched
    assert all(outputs[-1].completion_tokens == 10 for outputs in collected.values())
