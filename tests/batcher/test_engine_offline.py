"""`OfflineEngine`, the one-call wrapper of `LLMEngine`, with the strict fake runner: chunk sizes
per call, one sampling per prompt, the prefix cache across calls, refusal of what never fits."""

from __future__ import annotations

import pytest

from tests.batcher.fake_runner import FakeRunner, solo_output
from tgq.batcher.offline import OfflineEngine
from tgq.gpu_worker.plan import SamplingParams

PROMPTS = [list(range(start, start + n)) for start, n in ((3, 9), (20, 4), (30, 11))]


def step_sizes(runner: FakeRunner) -> list[int]:
    return [plan.num_tokens for plan in runner.plans if plan.num_tokens]


def test_no_chunk_size_runs_every_prompt_in_the_first_step() -> None:
    runner = FakeRunner(num_blocks=64, block_size=4)
    results = OfflineEngine(runner).generate(PROMPTS, max_new_tokens=5)
    assert step_sizes(runner) == [24, 3, 3, 3, 3]  # all prompts, then one decode each
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == solo_output(prompt, 5)
        assert (result.finish_reason, result.num_cached_tokens) == ("length", 0)


def test_each_call_takes_its_own_chunk_size_and_keeps_the_prefix_cache() -> None:
    runner = FakeRunner(num_blocks=64, block_size=4)
    engine = OfflineEngine(runner)
    first = engine.generate(PROMPTS, max_new_tokens=5, chunk_size=5)
    assert max(step_sizes(runner)) == 5 and len(step_sizes(runner)) > 5
    runner.plans.clear()
    again = engine.generate(PROMPTS, max_new_tokens=5)
    # Full blocks before each prompt's last token are hits: 8, 0 and 8 of 9, 4 and 11 tokens.
    assert [r.num_cached_tokens for r in again] == [8, 0, 8]
    assert step_sizes(runner)[0] == 1 + 4 + 3
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    engine.engine.scheduler.check_integrity()


def test_one_sampling_per_prompt_reaches_the_runner() -> None:
    runner = FakeRunner(num_blocks=64, block_size=4)
    engine = OfflineEngine(runner)
    params = [SamplingParams(seed=index) for index in range(len(PROMPTS))]
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, params[:2])
    assert not engine.engine.has_unfinished and not runner.plans  # nothing was added
    engine.generate(PROMPTS, params, max_new_tokens=2)
    assert [new.sampling for new in runner.plans[0].new_sequences] == params


def test_a_prompt_the_pool_never_holds_is_refused_and_the_engine_goes_on() -> None:
    runner = FakeRunner(num_blocks=4, block_size=4)  # 12 tokens
    engine = OfflineEngine(runner)
    with pytest.raises(ValueError, match=r"exceeds max_batch_total_tokens \(12\)"):
        engine.generate([PROMPTS[2]], max_new_tokens=2)
    [result] = engine.generate([PROMPTS[1]], max_new_tokens=2)
    assert result.token_ids == solo_output(PROMPTS[1], 2)
