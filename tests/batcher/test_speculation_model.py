"""Speculative decoding through the real model runner: outputs with speculation equal those
without it, token for token, for greedy rows (through the greedy head and through the sampler,
with logprobs and penalties) and for seeded sampled rows, under chunked prefill, prefix hits and
preemption; unseeded sampling keeps its distribution (chi-square).

The drafts come from an oracle that knows the run without speculation and corrupts its guesses
from a random position on, so every acceptance length occurs whatever the random-weight model
emits; the n-gram proposer runs over the same requests too."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.batcher.test_e2e import BLOCK_SIZE, _loaded, mixed_prompts
from tests.batcher.test_speculation import drafting
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.batcher.request import StoppingParams
from tgq.batcher.speculation import NgramProposer, Proposer, SuffixProposer
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import AttentionStep

VARIANT = "llama3-gqa"
NUM_NEW = 24


class ReplayOracle:
    """Guesses the continuation the run without speculation produced for the same tokens, and
    corrupts it from a random position on."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.known: dict[tuple[int, ...], list[int]] = {}  # full token list -> its next tokens

    def learn(self, prompt: list[int], output: list[int]) -> None:
        tokens = [*prompt, *output]
        for end in range(len(prompt), len(tokens)):
            self.known[tuple(tokens[:end])] = tokens[end:]

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        truth = self.known.get(tuple(token_ids), [])[:max_tokens]
        cut = self.rng.randint(0, len(truth))
        return truth[:cut] + [(t + 1) % 512 for t in truth[cut:]]

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass


def make_engine(
    model_dir: Path, proposer: Proposer | None, num_blocks: int = 512, **limits: Any
) -> LLMEngine:
    config = RunnerConfig(str(model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE)
    runner = ModelRunner(config, _loaded(model_dir, None))
    speculate = {"speculate": 4, "speculative_max_batch_tokens": 4096} if proposer else {}
    engine = LLMEngine(
        runner, SchedulerConfig(**{**limits, **speculate}), model=runner.model_config,
        proposer=proposer,
    )  # fmt: skip
    return engine if proposer is None else drafting(engine)


def mixed_sampling(count: int) -> list[SamplingParams]:
    """Greedy (greedy head), greedy with logprobs, with penalties and min_tokens, seeded
    sampling with top-k/top-p and top logprobs, in turn."""
    kinds = [
        SamplingParams(),
        SamplingParams(logprobs=True, top_n_logprobs=2),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, logprobs=True),
        SamplingParams(temperature=1.0, presence_penalty=0.4, seed=11),
    ]
    return [kinds[index % len(kinds)] for index in range(count)]


def run(engine: LLMEngine, batch: list[list[int]]) -> list[RequestResult]:
    results = engine.generate(
        batch, mixed_sampling(len(batch)), StoppingParams(max_new_tokens=NUM_NEW)
    )
    engine.scheduler.check_integrity()
    return results


def assert_same(ours: list[RequestResult], reference: list[RequestResult]) -> None:
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.finish_reason == theirs.finish_reason
        assert [lp is None for lp in mine.logprobs] == [lp is None for lp in theirs.logprobs]
        got = [lp for lp in mine.logprobs if lp is not None]
        want = [lp for lp in theirs.logprobs if lp is not None]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("limits", "num_blocks", "num_requests"),
    [
        ({"max_batch_prefill_tokens": 16, "max_batch_size": 16}, 512, 64),  # chunked prefill
        ({"max_batch_prefill_tokens": 64, "max_batch_size": 32}, 40, 200),  # forced preemption
    ],
)
def test_outputs_equal_the_run_without_speculation(
    limits: dict[str, int], num_blocks: int, num_requests: int, model_dirs: dict[str, Path]
) -> None:
    """64 and 200 requests (32 mixed prompts, again and again: prefix hits), every sampling
    kind, with the oracle's drafts, then the n-gram proposer's, then the suffix proposer's."""
    model_dir = model_dirs[VARIANT]
    batch = (mixed_prompts() * 7)[:num_requests]
    reference = run(make_engine(model_dir, None, num_blocks, **limits), batch)
    oracle = ReplayOracle(seed=num_blocks)
    for prompt, result in zip(batch, reference, strict=True):
        oracle.learn(prompt, result.token_ids)
    engine = make_engine(model_dir, oracle, num_blocks, **limits)
    assert_same(run(engine, batch), reference)
    stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
    assert stats.num_accepted > 100 and stats.acceptance_counts[0] > 0
    if num_blocks < 512:
        assert engine.scheduler.num_preemptions > 0
    for proposer in (NgramProposer(1, 3), SuffixProposer()):
        assert_same(run(make_engine(model_dir, proposer, num_blocks, **limits), batch), reference)


@pytest.mark.parametrize(("draft", "num_requests"), [(VARIANT, 64), ("qwen3-qknorm", 200)])
def test_a_draft_model_leaves_the_outputs_unchanged(
    draft: str, num_requests: int, model_dirs: dict[str, Path]
) -> None:
    """`--speculative-model`: the draft model guesses in the runner, over the target's block
    tables, through chunked prefill, prefix hits and preemption. The target as its own draft
    guesses nearly every token (64 requests); another model, few (200 requests): the outputs are
    the same either way."""
    model_dir = model_dirs[VARIANT]
    limits: dict[str, Any] = {"max_batch_prefill_tokens": 64, "max_batch_size": 32}
    batch = (mixed_prompts() * 7)[:num_requests]
    reference = run(make_engine(model_dir, None, 40, **limits), batch)
    config = RunnerConfig(
        str(model_dir), num_blocks=40, block_size=BLOCK_SIZE,
        speculative_model=str(model_dirs[draft]),
    )  # fmt: skip
    runner = ModelRunner(config, _loaded(model_dir, None))
    scheduler = SchedulerConfig(
        speculate=3, speculative_method="draft", speculative_max_batch_tokens=4096, **limits
    )
    engine = drafting(LLMEngine(runner, scheduler, model=runner.model_config))
    assert_same(run(engine, batch), reference)
    stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
    assert engine.scheduler.num_preemptions > 0 and stats.num_verified > 100
    # Greedy requests alone (sampled ones and penalties keep fewer of the draft's argmaxes):
    greedy = drafting(LLMEngine(runner, scheduler, model=runner.model_config))
    greedy.generate(batch[:16], SamplingParams(), StoppingParams(max_new_tokens=NUM_NEW))
    rate = greedy.scheduler.speculation.stats.acceptance_rate  # type: ignore[union-attr]
    assert rate > 0.9 if draft == VARIANT else rate < 0.5


def test_drafts_are_verified_as_decode_rows(model_dirs: dict[str, Path]) -> None:
    """A chunk with k drafts reaches the attention backend as k + 1 single-query rows, each
    attending up to its own position (the decode kernels, not the prefill path)."""
    model_dir = model_dirs[VARIANT]
    engine = make_engine(model_dir, _Likeliest([7] * 40))
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    steps: list[AttentionStep] = []
    prepare = runner.backend.prepare

    def spy(step: AttentionStep, device: torch.device) -> object:
        steps.append(step)
        return prepare(step, device)

    runner.backend.prepare = spy  # type: ignore[method-assign]
    engine.generate([[3, 4, 5, 6]], SamplingParams(), StoppingParams(max_new_tokens=6))
    verifying = [step for step in steps if len(step.spans) > 1]
    assert verifying
    for step in verifying:
        assert step.num_single == len(step.spans)
        assert [span.kv_len for span in step.spans] == list(
            range(step.spans[0].kv_len, step.spans[0].kv_len + len(step.spans))
        )


def test_unseeded_sampling_keeps_its_distribution(model_dirs: dict[str, Path]) -> None:
    """The second and third tokens after a fixed prompt, sampled 1,500 times with and without
    drafts (the oracle always guesses the likeliest continuation, so drafts are often kept and
    often not): a chi-square test of homogeneity over their joint outcomes cannot tell the two
    apart."""
    model_dir = model_dirs[VARIANT]
    prompt = [5, 17, 99, 3]
    hot = SamplingParams(temperature=3.0, top_k=3)  # 9 joint outcomes over the two tokens
    greedy_run = make_engine(model_dir, None).generate(
        [prompt], SamplingParams(), StoppingParams(max_new_tokens=3)
    )[0]
    oracle = _Likeliest(greedy_run.token_ids)

    def outcomes(proposer: Proposer | None) -> collections.Counter[tuple[int, ...]]:
        engine = make_engine(model_dir, proposer, max_batch_size=256)
        results = engine.generate([prompt] * 1500, hot, StoppingParams(max_new_tokens=3))
        return collections.Counter(tuple(r.token_ids[1:]) for r in results)

    plain, speculative = outcomes(None), outcomes(oracle)
    assert oracle.num_proposed > 1000
    cells = sorted(set(plain) | set(speculative))
    chi2 = 0.0
    for cell in cells:
        total = plain[cell] + speculative[cell]
        for counts in (plain, speculative):
            expected = total / 2
            chi2 += (counts[cell] - expected) ** 2 / expected
    dof = len(cells) - 1
    # a false alarm once in 1,000 runs at most
    assert chi2 < chi2_quantile_999(dof), (chi2, dof, plain, speculative)


def chi2_quantile_999(dof: int) -> float:
    """The chi-square distribution's 99.9th percentile (Wilson-Hilferty; within 1% from 3
    degrees of freedom on, and above the true value below that)."""
    z, k = 3.0902, max(dof, 3)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


class _Likeliest:
    """Always guesses the greedy continuation of the prompt, wherever the request is."""

    def __init__(self, greedy: list[int]) -> None:
        self.greedy = greedy
        self.num_proposed = 0

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        done = len(token_ids) - num_prompt_tokens
        guess = self.greedy[done : done + max_tokens]
        self.num_proposed += len(guess)
        return guess

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass
