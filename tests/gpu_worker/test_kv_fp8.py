"""`--kv-cache-dtype fp8`: the paged KV cache holds each key and value as one FP8 E4M3 byte
(saturated to +-448, scale 1), and attention reads them back. Checked against transformers whose
attention sees every key and value rounded through E4M3 the same way: token for token with
logprobs within 1e-4 in fp32 under chunked prefill, the prefix cache and preemption, and within
the bf16 tolerance in bf16 on the CPU kernels and on the torch backend."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.batcher.test_e2e import BLOCK_SIZE, GREEDY_LOGPROBS, STOPPING, make_engine, mixed_prompts
from tests.gpu_worker.test_parity import assert_matches, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels.kv_write import to_fp8

ATTENTION, EAGER_ATTENTION = "fp8_kv_sdpa", "fp8_kv_eager"
# GQA with a sliding window, and soft caps (Gemma 2: its own attention path).
VARIANTS = ("mistral-window", "gemma2-capped-window")


def _register_reference_attention() -> None:
    """transformers' own attention over keys and values rounded through E4M3 first: SDPA with
    its masks (sliding windows included), or Gemma 2's eager attention (its soft caps), which
    SDPA cannot do."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    def rounded(forward: Any) -> Any:
        def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
            key, value = (to_fp8(t).to(t.dtype) for t in (key, value))
            return forward(module, query, key, value, *args, **kw)

        return attention

    for name, forward, mask in (
        (ATTENTION, sdpa_attention_forward, sdpa_mask),
        (EAGER_ATTENTION, eager_attention_forward, eager_mask),
    ):
        AttentionInterface.register(name, rounded(forward))
        AttentionMaskInterface.register(name, mask)


@functools.cache
def reference_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    _register_reference_attention()
    eager = "gemma2" in model_dir.name
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=EAGER_ATTENTION if eager else ATTENTION
    )
    model.generation_config.eos_token_id = None
    return model.eval()


@functools.cache
def reference_output(model_dir: Path, prompt: tuple[int, ...], num_new: int) -> Any:
    """Each prompt's reference once: the prefix-cache and preemption runs repeat them."""
    return generate_greedy(reference_model(model_dir, torch.float32), list(prompt), num_new)


def cache_dtypes(engine: Any) -> set[torch.dtype]:
    return {t.dtype for pair in engine.runner.kv_caches for t in pair}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_is_transformers_over_e4m3_keys_and_values(
    variant: str, model_dirs: dict[str, Path]
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, and through a pool
    small enough to preempt."""
    model_dir, batch = model_dirs[variant], mixed_prompts()

    def run(engine: Any) -> Any:
        assert cache_dtypes(engine) == {torch.float8_e4m3fn}
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        for ours in results:
            prompt = tuple(ours.prompt_token_ids)
            assert_matches(ours, reference_output(model_dir, prompt, len(ours.token_ids)))
        return results

    engine = make_engine(
        model_dir, kv_cache_dtype="fp8", max_batch_prefill_tokens=16, max_batch_size=16
    )
    run(engine)
    again = run(engine)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    tight = make_engine(
        model_dir, 24, kv_cache_dtype="fp8", max_batch_prefill_tokens=64, max_batch_size=32
    )
    run(tight)
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("variant", ["llama3-gqa", "gemma2-capped-window"])
@pytest.mark.parametrize("custom_kernels", [True, False], ids=["cpu", "torch"])
def test_bf16_is_within_the_bf16_tolerance(
    variant: str, custom_kernels: bool, model_dirs: dict[str, Path]
) -> None:
    """The CPU backend (its kernels where they read FP8 caches) and the torch backend."""
    model_dir = model_dirs[variant]
    config = RunnerConfig(
        str(model_dir), dtype="bfloat16", num_blocks=512, block_size=BLOCK_SIZE,
        kv_cache_dtype="fp8", custom_kernels=custom_kernels,
    )  # fmt: skip
    runner = ModelRunner(config)
    engine = LLMEngine(
        runner,
        SchedulerConfig(max_batch_prefill_tokens=16, max_batch_size=16),
        model=runner.model_config,
    )
    assert runner.backend.name == ("cpu" if custom_kernels else "torch")
    assert cache_dtypes(engine) == {torch.float8_e4m3fn}
    results = engine.generate(mixed_prompts(), GREEDY_LOGPROBS, STOPPING)
    engine.scheduler.kv.check_integrity()
    assert_within_tolerance(model_dir, results, reference_model(model_dir, torch.bfloat16))


def test_an_fp8_cache_holds_twice_the_blocks_of_bf16(model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs["llama3-gqa"])
    sizes = {}
    for kv in ("auto", "fp8"):
        config = RunnerConfig(
            model_dir, dtype="bfloat16", kv_cache_bytes=64 << 20, kv_cache_dtype=kv
        )
        sizes[kv] = ModelRunner(config).num_blocks
    assert sizes["fp8"] == 2 * sizes["auto"]
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16' is not supported"):
        ModelRunner(RunnerConfig(model_dir, num_blocks=8, kv_cache_dtype="fp16"))
