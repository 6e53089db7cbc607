"""`cpu_ops.quantize_inputs`, a W8A8 linear's input quantized and dequantized in one pass: the
values of the torch ops it replaces (`ActivationQuant.with_torch`, which equal compressed-tensors'
own, tests/gpu_worker/test_compressed.py), bit for bit; its branch-free FP8 E4M3 rounding is
torch's conversion for every bf16 value in range and for random fp32 ones."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tgq.gpu_worker.layers.activation_quant import ActivationQuant
from tgq.kernels import cpu_ops

pytestmark = requires_kernels  # a CPU that can run them must build them: no skip for that
ONE = torch.tensor([1.0])


def test_fp8_rounding_is_torchs_conversion() -> None:
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = every_bf16.float()
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(100_000, generator=gen) * torch.rand(100_000, generator=gen) * 300
    x = torch.cat([values[torch.isfinite(values) & (values.abs() <= 500)], spread])[None]
    ours = cpu_ops.quantize_inputs(x, fp8=True, per_token=False, static_scale=ONE)
    assert torch.equal(ours, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    ours = cpu_ops.quantize_inputs(x, fp8=False, per_token=False, static_scale=ONE)
    assert torch.equal(ours, torch.round(x).clamp(-128, 127))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["token", "tensor", "static"])
def test_the_op_is_the_torch_ops_bit_for_bit(
    dtype: torch.dtype, qdtype: torch.dtype, mode: str
) -> None:
    quant = ActivationQuant(
        qdtype,
        per_token=mode == "token",
        static_scale=torch.tensor([0.0173]) if mode == "static" else None,
    )
    gen = torch.Generator().manual_seed(1)
    for m, k in ((1, 1), (3, 7), (16, 768), (17, 130), (40, 3)):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 50
        x[0] = 0  # an all-zero row: the dtype's epsilon as its scale
        x = x.to(dtype)
        assert torch.equal(quant(x), quant.with_torch(x)), (m, k)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\] on CPU"):
        cpu_ops.quantize_inputs(torch.zeros(3), fp8=True, per_token=True)
    with pytest.raises(RuntimeError, match="x must be fp32 or bf16"):
        cpu_ops.quantize_inputs(torch.zeros(2, 2, dtype=torch.float16), fp8=True, per_token=True)
    with pytest.raises(RuntimeError, match="the static scale must be one fp32 value"):
        cpu_ops.quantize_inputs(
            torch.zeros(2, 2), fp8=True, per_token=False, static_scale=torch.ones(2)
        )
