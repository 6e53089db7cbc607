"""The scheduler driving the real runner: greedy output equals transformers token for token,
whatever the chunk budget, prefix-cache state, preemption or batch composition (with
TGQ_TEST_QUANTIZE, `--quantize`d against the dequantized weights: tests/quantized_mode.py)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.gpu_worker.test_parity import LOGPROB_TOL, hf_generate, prompts
from tests.quantized_mode import QUANTIZE
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.batcher.request import StoppingParams
from tgq.batcher.warm_up import warm_up_decode
from tgq.gpu_worker.loader import LoadedModel, load_model
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

VARIANT = "llama3-gqa"
NUM_NEW = 8
BLOCK_SIZE = 8
STOPPING = StoppingParams(max_new_tokens=NUM_NEW)
GREEDY_LOGPROBS = SamplingParams(logprobs=True)


@functools.cache
def _loaded(model_dir: Path, dtype: str | None, quantize: str | None = None) -> LoadedModel:
    return load_model(str(model_dir), device=torch.device("cpu"), dtype=dtype, quantize=quantize)


@functools.cache
def _reference(model_dir: Path, prompt: tuple[int, ...]) -> RequestResult:
    """Each prompt runs once in transformers per session."""
    return hf_generate(model_dir, list(prompt), NUM_NEW)


def make_engine(
    model_dir: Path,
    num_blocks: int = 512,
    *,
    dtype: str | None = None,
    quantize: str | None = QUANTIZE,
    kv_cache_dtype: str = "auto",
    **limits: Any,
) -> LLMEngine:
    """The runner as served ("auto": the CPU kernels here), in the checkpoint's dtype or
    `dtype`, `--quantize`d or not, with the KV cache in `kv_cache_dtype`; the torch oracle itself
    is checked against transformers in tests/gpu_worker."""
    config = RunnerConfig(
        str(model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype,
        quantize=quantize, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    runner = ModelRunner(config, _loaded(model_dir, dtype, quantize))
    return LLMEngine(runner, SchedulerConfig(**limits), model=runner.model_config)


def mixed_prompts() -> list[list[int]]:
    """32 prompts of 1-90 tokens; half extend one of two shared prefixes (3 and 5 blocks)."""
    rng = random.Random(20)
    shared = prompts(2, 512, 21, (24, 24))[0], prompts(2, 512, 22, (40, 40))[1]
    extended = [
        [*shared[i % 2], *(rng.randrange(3, 512) for _ in range(rng.randint(1, 20)))]
        for i in range(16)
    ]
    mixed = [*prompts(16, 512, 23, (1, 90)), *extended]
    rng.shuffle(mixed)
    return mixed


def assert_matches_hf(
    model_dir: Path, batch: list[list[int]], results: list[RequestResult]
) -> None:
    for prompt, ours in zip(batch, results, strict=True):
        reference = _reference(model_dir, tuple(prompt))
        assert ours.token_ids == reference.token_ids
        assert ours.finish_reason == "length"
        torch.testing.assert_close(
            torch.tensor(ours.logprobs), torch.tensor(reference.logprobs), atol=LOGPROB_TOL, rtol=0
        )


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_chunk_budgets_and_prefix_cache(
    budget: int, enable_prefix_cache: bool, model_dirs: dict[str, Path]
) -> None:
    model_dir, batch = model_dirs[VARIANT], mixed_prompts()
    engine = make_engine(
        model_dir,
        max_batch_prefill_tokens=budget,
        max_batch_size=min(budget, 32),
        enable_prefix_cache=enable_prefix_cache,
    )
    first = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
    assert_matches_hf(model_dir, batch, first)
    if not enable_prefix_cache:
        assert all(r.num_cached_tokens == 0 for r in first)
        return
    # Now every full prompt block is a hit.
    again = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
    assert_matches_hf(model_dir, batch, again)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    if budget < 512:  # prompts admitted after their prefix was computed hit it the first time
        assert any(r.num_cached_tokens > 0 for r in first)
    engine.scheduler.kv.check_integrity()


@pytest.mark.parametrize("variant", [VARIANT, "qwen2-bias", "mistral-window", "qwen3-qknorm"])
def test_a_small_kv_pool_preempts_and_still_matches(
    variant: str, model_dirs: dict[str, Path]
) -> None:
    model_dir, batch = model_dirs[variant], mixed_prompts()
    engine = make_engine(model_dir, num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in results)
    assert_matches_hf(model_dir, batch, results)


NEWER_FAMILIES = [
    "gemma2-capped-window",
    "gemma3-local-rope",
    "phi3-partial-window",
    "mixtral-top2",
    "qwen2moe-shared-dense-layer",
    "qwen3moe-top3-norm",
]


@pytest.mark.parametrize("variant", NEWER_FAMILIES)
def test_every_schedule_of_the_newer_families(variant: str, model_dirs: dict[str, Path]) -> None:
    """The 32 mixed prompts at 16 tokens a step (then again, every full prompt block a prefix
    hit), at 512 a step with the prefix cache off, eight of them one at a time, and through a
    pool small enough to preempt: each run equals transformers token for token."""
    model_dir, batch = model_dirs[variant], mixed_prompts()
    chunked = make_engine(model_dir, max_batch_prefill_tokens=16, max_batch_size=16)
    assert_matches_hf(model_dir, batch, chunked.generate(batch, GREEDY_LOGPROBS, STOPPING))
    again = chunked.generate(batch, GREEDY_LOGPROBS, STOPPING)
    assert_matches_hf(model_dir, batch, again)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    uncached = make_engine(
        model_dir, max_batch_prefill_tokens=512, max_batch_size=32, enable_prefix_cache=False
    )
    assert_matches_hf(model_dir, batch, uncached.generate(batch, GREEDY_LOGPROBS, STOPPING))
    alone = make_engine(model_dir, max_batch_prefill_tokens=64, max_batch_size=1)
    few = batch[:8]
    assert_matches_hf(model_dir, few, alone.generate(few, GREEDY_LOGPROBS, STOPPING))
    tight = make_engine(model_dir, num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    assert_matches_hf(model_dir, batch, tight.generate(batch, GREEDY_LOGPROBS, STOPPING))
    assert tight.scheduler.num_preemptions > 0
    for engine in (chunked, uncached, alone, tight):
        engine.scheduler.kv.check_integrity()


def test_a_batch_of_one_matches(model_dirs: dict[str, Path]) -> None:
    model_dir, batch = model_dirs[VARIANT], mixed_prompts()
    engine = make_engine(model_dir, max_batch_prefill_tokens=64, max_batch_size=1)
    assert_matches_hf(model_dir, batch, engine.generate(batch, GREEDY_LOGPROBS, STOPPING))


def test_no_cross_talk_between_64_concurrent_prompts(model_dirs: dict[str, Path]) -> None:
    """Each prompt carries a unique nonce between a shared header and tail; run together, each
    gives exactly what it gives alone."""
    rng = random.Random(30)
    header, tail = prompts(1, 512, 31, (16, 16))[0], prompts(1, 512, 32, (8, 8))[0]
    batch = [[*header, *rng.sample(range(3, 512), 8), *tail] for _ in range(64)]
    model_dir = model_dirs[VARIANT]
    together = make_engine(model_dir, max_batch_prefill_tokens=256, max_batch_size=64)
    results = together.generate(batch, GREEDY_LOGPROBS, STOPPING)
    alone = make_engine(model_dir, enable_prefix_cache=False)
    for prompt, result in zip(batch, results, strict=True):
        [solo] = alone.generate([prompt], stopping=STOPPING)
        assert result.token_ids == solo.token_ids
    assert len({tuple(r.token_ids) for r in results}) > 16  # the nonces matter


def test_the_warm_up_records_each_batch_size_and_leaves_nothing_behind(
    model_dirs: dict[str, Path],
) -> None:
    """`warm_up_decode` steps 1..N single-token rows through the runner: where the CPU kernels
    replay decode steps, a program of each size exists afterwards; the runner keeps none of its
    sequences, and greedy output still equals transformers with the KV pool intact. With no
    rows it runs nothing."""
    model_dir, batch = model_dirs[VARIANT], mixed_prompts()
    engine = make_engine(model_dir, max_batch_prefill_tokens=64, max_batch_size=32)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    assert warm_up_decode(runner, 8) > 0
    assert not runner.sequences
    replay = runner.loaded.model.replay
    if replay is not None:
        keys = [cast(tuple[Any, ...], key) for key in replay.keys]  # (rows, backend key, n)
        assert {(rows, ("decode", rows)) for rows in range(1, 9)} <= {k[:2] for k in keys}
    assert_matches_hf(model_dir, batch, engine.generate(batch, GREEDY_LOGPROBS, STOPPING))
    engine.scheduler.kv.check_integrity()
    assert warm_up_decode(runner, 0) == 0.0
