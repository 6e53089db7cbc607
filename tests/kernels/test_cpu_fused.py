"""The fused bf16 CPU ops equal the torch expressions they replace, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.markers import requires_kernels
from tgq.gpu_worker.layers.norm import OffsetRMSNorm, RMSNorm
from tgq.gpu_worker.layers.rotary import apply_rotary
from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.plan import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import cpu_ops

EPS = 1e-6
CPU = torch.device("cpu")


def torch_norm(hidden: int) -> RMSNorm:
    norm = RMSNorm(hidden, EPS).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    return norm


@requires_kernels
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_is_bit_identical(rows: int) -> None:
    torch.manual_seed(rows)
    norm = torch_norm(768)
    x = (3 * torch.randn(rows, 768)).bfloat16()
    assert torch.equal(cpu_ops.rms_norm(x, norm.weight, EPS), norm(x))


@requires_kernels
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_offset_rms_norm_is_bit_identical(rows: int) -> None:
    """Gemma's norm (`1 + weight`, in fp32, rounded once) on the kernel equals its torch ops."""
    torch.manual_seed(rows)
    norm = OffsetRMSNorm(768, EPS).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(768))
    x = (3 * torch.randn(rows, 768)).bfloat16()
    assert torch.equal(cpu_ops.offset_rms_norm(x, norm.weight, EPS), norm(x))


@requires_kernels
def test_add_rms_norm_updates_the_residual_in_place() -> None:
    torch.manual_seed(1)
    norm = torch_norm(96)
    residual = torch.randn(7, 96).bfloat16()
    delta = torch.randn(7, 96).bfloat16()
    expected_residual = residual + delta
    expected = norm(expected_residual)
    out = cpu_ops.add_rms_norm(residual, delta, norm.weight, EPS)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(out, expected)


@requires_kernels
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(12, 12, 64), (8, 2, 32), (4, 2, 20)]
)
def test_rotary_in_place_is_bit_identical(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(2)
    tokens = 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).bfloat16()
    angles = torch.randn(tokens, head_dim // 2) * 5
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    expected_q = apply_rotary(q.reshape(tokens, num_heads, head_dim), cos, sin)
    expected_k = apply_rotary(k.reshape(tokens, num_kv_heads, head_dim), cos, sin)
    expected_v = v.clone()
    cpu_ops.rotary_qk_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    assert torch.equal(q.reshape(expected_q.shape), expected_q)
    assert torch.equal(k.reshape(expected_k.shape), expected_k)
    assert torch.equal(v, expected_v)


@requires_kernels
# 155 = 8 x 16 (the AVX-512 unrolled body) + 16 + 8 (the 8-lane loop) + 3 (scalar)
@pytest.mark.parametrize(("rows", "inter"), [(1, 2048), (3, 13), (2, 155), (70, 2048)])
def test_silu_mul_is_bit_identical(rows: int, inter: int) -> None:
    """Covers the vector body and the scalar tail, and values where exp under- or overflows."""
    torch.manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * inter)).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, float("inf")])
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert torch.equal(cpu_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@requires_kernels
@pytest.mark.parametrize(("rows", "inter"), [(1, 2048), (3, 13), (2, 155), (70, 2048)])
def test_gelu_tanh_mul_is_the_correctly_rounded_activation(rows: int, inter: int) -> None:
    """GeGLU's GELU as gate * sigmoid(2y): where |gate| < 5 each activation is the float64
    value rounded to bf16 (torch's own bf16 GELU is 1 ulp off on ~4% of them, so the kernel
    agrees with torch's to 1 ulp); past it, where the activation falls under 1e-12 of the
    float64 value, the kernel keeps tiny values (|gate| e^(-2|y|)) that torch's fp32
    1 + tanh(y) cancels to zero from gate ~ -5 on. inf and NaN as torch."""
    torch.manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * inter)).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, float("inf")])
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    out = cpu_ops.gelu_tanh_mul(gate_up)
    exact = F.gelu(gate.double(), approximate="tanh").bfloat16() * up
    middle = gate.abs() < 5
    assert torch.equal(out[middle], exact[middle])
    torch.testing.assert_close(out.float(), exact.float(), rtol=0, atol=1e-12)
    torch_bf16 = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out.float(), torch_bf16.float(), rtol=2**-7, atol=1e-5)


@requires_kernels
def test_bf16_model_on_the_kernels_matches_the_torch_path(model_dirs: dict[str, Path]) -> None:
    """Same bf16 weights and inputs: the kernel path's top logprobs stay within bf16 noise of the
    plain torch path (matmuls accumulate in another order; everything else is bit-identical)."""
    prompt = [5, 17, 300, 42, 9, 77]
    sampling = SamplingParams(top_n_logprobs=5)
    tops = []
    for cpu_kernels in (False, True):
        loaded = load_model(
            str(model_dirs["llama3-gqa"]), device=CPU, dtype="bfloat16", cpu_kernels=cpu_kernels
        )
        runner = ModelRunner(RunnerConfig("", num_blocks=8), loaded=loaded)
        plan = StepPlan(
            new_sequences=[NewSequence("a", prompt, len(prompt), sampling, [1])],
            chunks=[ScheduledChunk("a", 0, len(prompt))],
        )
        [token] = runner.execute(plan).sampled
        tops.append(token.top_logprobs)
    plain, fast = tops
    assert fast[0].token_id == plain[0].token_id
    torch.testing.assert_close(
        torch.tensor([t.logprob for t in fast]),
        torch.tensor([t.logprob for t in plain]),
        atol=2e-2,
        rtol=0,
    )
