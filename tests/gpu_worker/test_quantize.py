"""`--quantize int8` and `--quantize fp8`: the decoder layers' linears as int8 or FP8 E4M3 weights
with one scale per output row, checked against transformers running the same model with those
weights dequantized (q * scale): token for token with logprobs within 1e-4 in fp32 (torch's path),
within the bf16 tolerance in bf16 (the AVX-512 8-bit kernel where this CPU has it, and torch's
path where it has not). The quantizers equal numpy references written from the formats'
descriptions, bit for bit."""

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
from tests.gpu_worker.test_parity import assert_matches, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tests.kernels.markers import EIGHT_BIT_KERNELS, use_eight_bit_kernel
from tests.quantized_mode import METHODS, REFERENCES, as_torch, reference_rows
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.devtools.quantized_reference import dequantize_in_place
from tgq.gpu_worker.layers.linear import Linear, quantize_rows
from tgq.gpu_worker.loader import load_model, weight_bytes


@pytest.mark.parametrize("method", METHODS)
def test_quantize_rows_is_the_formula_bit_for_bit(method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (7, 13), (33, 130), (5, 1001)):
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10
        w[0, : k // 2] = 0
        if n > 2:
            w[1] = 0  # an all-zero row
            w[2, :3] = torch.tensor([127.0, 0.5, -2.5])[:k]  # exact halves: ties to even
            w[3, :k] *= 1e-4  # subnormal E4M3 values beside normal ones
            w[3, 0] = 1.0
        q, scale = quantize_rows(w, method)
        ref_q, ref_scale = REFERENCES[method](w.numpy())
        assert q.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn)
        assert scale.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), as_torch(method, ref_q).view(torch.uint8))
        assert np.array_equal(scale.numpy(), ref_scale)
    q, _ = quantize_rows(torch.tensor([[-1.0, 0.5, 1.0]]), "int8")
    assert q.tolist() == [[-127, 64, 127]]  # 63.5 rounds to the even 64
    # Scale 1: 232 lies halfway between 224 (mantissa 110) and 240 (111), 216 between 208 and
    # 224: both go to the even mantissa, 224.
    q, scale = quantize_rows(torch.tensor([[448.0, 232.0, 216.0, -232.0]]), "fp8")
    assert scale.tolist() == [1.0] and q.float().tolist() == [[448.0, 224.0, 224.0, -224.0]]


@functools.cache
def dequantized_transformers(model_dir: Path, dtype: torch.dtype, method: str) -> Any:
    """transformers' model of `model_dir` whose quantized weights are q * scale by the numpy
    formulas above (from the weights as `dtype` holds them, as tgq quantizes what it loaded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return dequantize_in_place(model, reference_rows(method), dtype).eval()


def assert_matches_dequantized(model_dir: Path, method: str, results: list[RequestResult]) -> None:
    reference = dequantized_transformers(model_dir, torch.float32, method)
    for ours in results:
        assert_matches(ours, generate_greedy(reference, ours.prompt_token_ids, len(ours.token_ids)))


# int8 on a dense, a capped sliding-window, a partial-rotary and a many-expert family (routers
# stay float); fp8 (the same layers and path, another quantizer) on a dense and an MoE one. Every
# family, both methods: `make test-quantized [QUANTIZE=fp8]` (the parity, scheduling and
# tensor-parallel tests).
FP32_CASES = [
    *(("int8", v) for v in ("llama3-gqa", "gemma2-capped-window", "phi3-partial-window")),
    ("int8", "qwen3moe-top3-norm"),
    *(("fp8", v) for v in ("llama3-gqa", "mixtral-top2")),
]


@pytest.mark.parametrize(("method", "variant"), FP32_CASES)
def test_fp32_quantized_is_transformers_on_the_dequantized_weights(
    method: str, variant: str, model_dirs: dict[str, Path]
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, at 512 a step without
    it, and through a pool small enough to preempt."""
    model_dir, batch = model_dirs[variant], mixed_prompts()
    quantized_engine = functools.partial(make_engine, model_dir, quantize=method)

    def run(engine: LLMEngine) -> list[RequestResult]:
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        assert_matches_dequantized(model_dir, method, results)
        return results

    chunked = quantized_engine(max_batch_prefill_tokens=16, max_batch_size=16)
    run(chunked)
    again = run(chunked)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    run(quantized_engine(max_batch_prefill_tokens=512, enable_prefix_cache=False))
    tight = quantized_engine(num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    run(tight)
    assert tight.scheduler.num_preemptions > 0


def quantized_linears(engine: LLMEngine) -> list[Linear]:
    model = engine.runner.loaded.model  # type: ignore[attr-defined]
    return [m for m in model.modules() if isinstance(m, Linear) and m.is_quantized]


@pytest.mark.parametrize("variant", ["llama3-gqa", "phi3-partial-window", "mixtral-top2"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kernel", EIGHT_BIT_KERNELS)
def test_bf16_quantized_is_within_the_bf16_tolerance_on_the_kernel_and_on_torch(
    method: str,
    variant: str,
    kernel: str,
    model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each 8-bit kernel this CPU runs, and torch's path (any CPU)."""
    use_eight_bit_kernel(kernel, monkeypatch)
    model_dir, batch = model_dirs[variant], mixed_prompts()
    _loaded.cache_clear()  # the monkeypatch must reach the load
    engine = make_engine(
        model_dir, dtype="bfloat16", quantize=method, max_batch_prefill_tokens=16, max_batch_size=16
    )
    _loaded.cache_clear()
    linears = quantized_linears(engine)
    held = torch.int8 if method == "int8" else torch.float8_e4m3fn
    assert linears and all(m.weight.dtype == held for m in linears)
    assert all(m.matmul.packed == (kernel != "torch") for m in linears)  # type: ignore[attr-defined]
    results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
    reference = dequantized_transformers(model_dir, torch.bfloat16, method)
    assert_within_tolerance(model_dir, results, reference)


@pytest.mark.parametrize("method", METHODS)
def test_the_lm_head_and_routers_keep_their_dtype_and_the_weights_shrink(
    method: str, model_dirs: dict[str, Path]
) -> None:
    model_dir = model_dirs["qwen2moe-shared-dense-layer"]
    cpu = torch.device("cpu")
    plain = load_model(str(model_dir), device=cpu, dtype="bfloat16")
    quantized = load_model(str(model_dir), device=cpu, dtype="bfloat16", quantize=method)
    assert quantized.quantize == method and plain.quantize is None
    routers = [
        m
        for n, m in quantized.model.named_modules()
        if n.endswith(("mlp.gate", "shared_expert_gate"))
    ]
    assert routers and not any(isinstance(m, Linear) and m.is_quantized for m in routers)
    assert not quantized.model.lm_head.is_quantized
    assert weight_bytes(quantized.model) < weight_bytes(plain.model)


@pytest.mark.parametrize("method", METHODS)
def test_slices_quantized_with_their_rows_maxima_are_the_whole_rows_slices(method: str) -> None:
    """A row-parallel rank holds a slice of K of each row: given the whole rows' max |w| (what
    the ranks all-reduce), its values and scales are those of the whole weight, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(37, 96, generator=gen) * torch.rand(37, 1, generator=gen)
    w[5] = 0.0  # an all-zero row keeps scale 1
    q, scale = quantize_rows(w, method)
    amax = w.abs().amax(dim=1)
    for start, stop in ((0, 48), (48, 96), (0, 32), (32, 64), (64, 96)):
        part_q, part_scale = quantize_rows(w[:, start:stop], method, amax.clone())
        assert torch.equal(part_scale, scale)
        assert torch.equal(part_q.view(torch.uint8), q[:, start:stop].view(torch.uint8))


def test_quantize_refuses_unknown_methods(model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs["llama3-gqa"])
    refused = r"--quantize 'int4' is not supported \(supported: int8, fp8\)"
    with pytest.raises(ValueError, match=refused):
        load_model(model_dir, device=torch.device("cpu"), quantize="int4")
