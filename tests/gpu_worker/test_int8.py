"""`--quantize int8`: the decoder layers' linears as int8 weights with one scale per output row,
checked against transformers running the same model with those weights dequantized (q * scale):
token for token with logprobs within 1e-4 in fp32 (torch's path), within the bf16 tolerance in
bf16 (the AVX-512 int8 kernel where this CPU has it, and torch's path where it has not)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.batcher.test_e2e import (
    BLOCK_SIZE,
    GREEDY_LOGPROBS,
    STOPPING,
    _loaded,
    make_engine,
    mixed_prompts,
)
from tests.gpu_worker.test_parity import LOGPROB_TOL, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_bf16_tolerance
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.devtools.quantized_reference import dequantize_in_place
from tgq.gpu_worker.layers.linear import Linear, quantize_int8_rows
from tgq.gpu_worker.loader import load_model, weight_bytes
from tgq.kernels import cpu_ops

# Dense, fused-checkpoint, soft-capped and mixture-of-experts families (routers stay float).
VARIANTS = (
    "llama3-gqa",
    "qwen2-bias",
    "gemma2-capped-window",
    "phi3-partial-window",
    "mixtral-top2",
    "qwen2moe-shared-dense-layer",
    "qwen3moe-top3-norm",
)


def reference_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 from its description, in numpy float32: scale = max |w| / 127
    (1 for an all-zero row), q = w / scale rounded half to even, clamped to [-127, 127]."""
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    return q, scale


def test_quantize_int8_rows_is_the_formula_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (7, 13), (33, 130), (5, 1001)):
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10
        w[0, : k // 2] = 0
        if n > 2:
            w[1] = 0  # an all-zero row
            w[2, :3] = torch.tensor([127.0, 0.5, -2.5])[:k]  # exact halves: ties to even
        q, scale = quantize_int8_rows(w)
        ref_q, ref_scale = reference_quantize(w.numpy())
        assert q.dtype == torch.int8 and scale.dtype == torch.float32
        assert np.array_equal(q.numpy(), ref_q) and np.array_equal(scale.numpy(), ref_scale)
    q, _ = quantize_int8_rows(torch.tensor([[-1.0, 0.5, 1.0]]))
    assert q.tolist() == [[-127, 64, 127]]  # 63.5 rounds to the even 64


def reference_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = reference_quantize(w.numpy())
    return torch.from_numpy(q), torch.from_numpy(scale)


@functools.cache
def dequantized_transformers(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' model of `model_dir` whose quantized weights are q * scale by the numpy
    formula above (from the weights as `dtype` holds them, as tgq quantizes what it loaded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return dequantize_in_place(model, reference_rows, dtype).eval()


def assert_matches_dequantized(model_dir: Path, results: list[RequestResult]) -> None:
    reference = dequantized_transformers(model_dir, torch.float32)
    for ours in results:
        theirs = generate_greedy(reference, ours.prompt_token_ids, len(ours.token_ids))
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(
            torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=LOGPROB_TOL, rtol=0
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_int8_is_transformers_on_the_dequantized_weights(
    variant: str, model_dirs: dict[str, Path]
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, at 512 a step without
    it, and through a pool small enough to preempt."""
    model_dir, batch = model_dirs[variant], mixed_prompts()
    int8_engine = functools.partial(make_engine, model_dir, quantize="int8")

    def run(engine: LLMEngine) -> list[RequestResult]:
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        assert_matches_dequantized(model_dir, results)
        return results

    chunked = int8_engine(max_batch_prefill_tokens=16, max_batch_size=16)
    run(chunked)
    again = run(chunked)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    run(int8_engine(max_batch_prefill_tokens=512, enable_prefix_cache=False))
    tight = int8_engine(num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    run(tight)
    assert tight.scheduler.num_preemptions > 0


def quantized_linears(engine: LLMEngine) -> list[Linear]:
    model = engine.runner.loaded.model  # type: ignore[attr-defined]
    return [m for m in model.modules() if isinstance(m, Linear) and m.is_quantized]


@pytest.mark.parametrize("variant", ["llama3-gqa", "phi3-partial-window", "mixtral-top2"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_bf16_int8_is_within_the_bf16_tolerance_on_the_kernel_and_on_torch(
    variant: str, kernel: bool, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel where this CPU has AVX512_BF16 and VBMI; torch's path (any CPU) when the
    kernel is reported missing."""
    if kernel and not cpu_ops.has_avx512_int8_linear():
        pytest.skip("the int8 linear kernel needs AVX512_BF16 and AVX512_VBMI")
    if not kernel:
        monkeypatch.setattr(cpu_ops, "has_avx512_int8_linear", lambda: False)
    model_dir, batch = model_dirs[variant], mixed_prompts()
    _loaded.cache_clear()  # the monkeypatch must reach the load
    engine = make_engine(
        model_dir, dtype="bfloat16", quantize="int8", max_batch_prefill_tokens=16, max_batch_size=16
    )
    _loaded.cache_clear()
    linears = quantized_linears(engine)
    assert linears and all(m.weight.dtype == torch.int8 for m in linears)
    assert all(m.matmul.packed == kernel for m in linears)  # type: ignore[attr-defined]
    results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
    reference = dequantized_transformers(model_dir, torch.bfloat16)
    assert_within_bf16_tolerance(model_dir, results, reference)


def test_the_lm_head_and_routers_keep_their_dtype_and_the_weights_shrink(
    model_dirs: dict[str, Path],
) -> None:
    model_dir = model_dirs["qwen2moe-shared-dense-layer"]
    cpu = torch.device("cpu")
    plain = load_model(str(model_dir), device=cpu, dtype="bfloat16")
    int8 = load_model(str(model_dir), device=cpu, dtype="bfloat16", quantize="int8")
    assert int8.quantize == "int8" and plain.quantize is None
    routers = [
        m for n, m in int8.model.named_modules() if n.endswith(("mlp.gate", "shared_expert_gate"))
    ]
    assert routers and not any(isinstance(m, Linear) and m.is_quantized for m in routers)
    assert not int8.model.lm_head.is_quantized
    assert weight_bytes(int8.model) < weight_bytes(plain.model)


def test_quantize_is_refused_on_more_than_one_rank_and_for_unknown_methods(
    model_dirs: dict[str, Path],
) -> None:
    model_dir = str(model_dirs["llama3-gqa"])
    with pytest.raises(ValueError, match=r"--quantize 'int4' is not supported \(supported: int8\)"):
        load_model(model_dir, device=torch.device("cpu"), quantize="int4")
