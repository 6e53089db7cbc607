"""Issue 28's quality bounds, enforced (`devtools.quant_quality.BOUNDS`, documented in the README):
a small Llama trained here on the bundled corpus (~25 s on two cores, so that its next-token
distributions are peaked as a real model's are, not a random model's near-flat ones), against
itself quantized, over 1,024 teacher-forced positions of corpus text:

- weights: `--quantize int8` and `fp8`, GPTQ and AWQ int4 (groups of 128): mean KL and top-1
  agreement of transformers' model of the dequantized weights (which tgq's quantized layers
  compute exactly: test_quantize.py, test_grouped.py) against bf16's;
- the FP8 KV cache: tgq itself, its prompt positions' argmax with the cache in FP8 E4M3 against
  the bf16 cache, prefilled in chunks of 16 so that every chunk attends to the ones before it
  through the cache.

A failed bound names the variant and its numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tgq.batcher.offline import OfflineEngine
from tgq.devtools.quant_quality import (
    BOUNDS,
    KV_FP8_MIN_TOP1,
    WINDOW,
    corpus_ids,
    teacher_forced,
    variants,
)
from tgq.devtools.train_demo import TrainConfig, build
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

POSITIONS = 1024
# Trains in ~25 s: validation loss ~4.6 (from 6.2), hidden 128 (one group of 128 per row in
# the attention's inputs, three in the MLP's down projection).
SMALL = TrainConfig(
    steps=400,
    batch_size=16,
    context=64,
    lr=1e-2,
    warmup_steps=10,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    val_fraction=0.003,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quality") / "small"
    result = build(out, SMALL)
    assert result.val_loss < result.first_loss - 1.0, result  # it learned something
    return out


@pytest.fixture(scope="module")
def measured(
    trained: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, float]]:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    return {
        label: teacher_forced(trained, variant.reference(), POSITIONS)
        for label, variant in variants(trained, checkpoints, set(BOUNDS)).items()
    }


@pytest.mark.parametrize("label", sorted(BOUNDS))
def test_quantized_weights_stay_within_their_bounds(
    label: str, measured: dict[str, dict[str, float]]
) -> None:
    largest_kl, smallest_top1 = BOUNDS[label]
    found = measured[label]
    print(f"\n{label}: {found}")
    assert found["positions"] == POSITIONS
    assert found["mean_kl"] <= largest_kl, (label, found)
    assert found["top1_agreement"] >= smallest_top1, (label, found)


def prompt_scores(model_dir: Path, kv_cache_dtype: str) -> tuple[list[int], list[float]]:
    """tgq's argmax and the actual next token's logprob at every prompt position of the corpus
    windows, the prompts prefilled 16 tokens a step."""
    ids = corpus_ids(model_dir, POSITIONS + 1)
    windows = [ids[start : start + WINDOW] for start in range(0, POSITIONS, WINDOW)]
    config = RunnerConfig(str(model_dir), num_blocks=96, kv_cache_dtype=kv_cache_dtype)
    results = OfflineEngine(ModelRunner(config)).generate(
        windows, SamplingParams(prompt_logprobs=1), max_new_tokens=1, chunk_size=16
    )
    argmaxes, logprobs = [], []
    for result in results:
        for top, logprob in zip(
            result.prompt_top_logprobs[1:], result.prompt_logprobs[1:], strict=True
        ):
            argmaxes.append(top[0].token_id)
            assert logprob is not None
            logprobs.append(logprob)
    return argmaxes, logprobs


def test_the_fp8_kv_cache_stays_within_its_bound(trained: Path) -> None:
    bf16_top, bf16_logprobs = prompt_scores(trained, "auto")
    fp8_top, fp8_logprobs = prompt_scores(trained, "fp8")
    agreement = sum(a == b for a, b in zip(bf16_top, fp8_top, strict=True)) / len(bf16_top)
    drift = (torch.tensor(fp8_logprobs) - torch.tensor(bf16_logprobs)).abs()
    print(f"\nfp8 KV: top-1 agreement {agreement:.4f}, mean |logprob drift| {drift.mean():.5f}")
    assert drift.max() > 0  # the cache was read in FP8: the scores moved
    assert agreement >= KV_FP8_MIN_TOP1, agreement
