"""The grouped 4-bit-weight linear kernels (`cpu_ops.linear_int4_packed`: GPTQ, AWQ and
compressed-tensors int4 checkpoints), AVX2 everywhere and AVX-512 where the CPU has AVX512_BF16:
fp32 sums of x * (q - zero) * scale within fp32 rounding of the exact value, rounded once to
bf16; the same for every row whatever else is in the call."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tgq.kernels import cpu_ops

pytestmark = requires_kernels

# Every kernel this CPU runs (a CPU flag, not the build: a failed build fails these tests).
# In "auto"'s order of preference, last: the one it takes.
KERNELS = (
    "avx2",
    *(("avx512f",) if cpu_ops.has_avx512f_kernels() else ()),
    *(("avx512",) if cpu_ops.has_avx512_int4_linear() else ()),
)

# Rows of x on each side of the kernels' forms (AVX-512: 1, 2, 3-8 and 9-16 rows in one pass, 8,
# 4, 2 and 1 tiles side by side, 17 and more tile by tile in groups of 16; AVX2: groups of 1-4
# rows against 2 or 1 tiles side by side; avx512f: groups of 1-8 rows against 4, 2 or 1), and N,
# K past whole tiles, sets of tiles and blocks of 8: groups of 8, of 32 with a partial last
# group, whole-K groups of K not a multiple of 8 or 32.
ROWS = (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 40)
SHAPES = ((1, 8, 8), (40, 24, 8), (33, 136, 32), (140, 256, 128), (16, 40, 40), (5, 13, 13))


def quantized(
    n: int, k: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q in 0..15 [N, K] uint8, scales of either sign and zeros 0..15, [N, G] fp32."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sign = torch.randint(0, 2, (n, groups), generator=gen) * 2 - 1
    scale = (torch.rand(n, groups, generator=gen) + 0.05) * 0.02 * sign
    zero = torch.randint(0, 16, (n, groups), generator=gen).float()
    return q, scale, zero


def dequantized(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:  # [N, K] float64
    g = torch.arange(q.shape[1]) // group_size
    return (q.double() - zero.double()[:, g]) * scale.double()[:, g]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_sums_are_the_exact_value_within_fp32_rounding(
    n: int, k: int, group_size: int, with_bias: bool, kernel: str
) -> None:
    q, scale, zero = quantized(n, k, group_size, n * k)
    w = dequantized(q, scale, zero, group_size)
    bias = torch.randn(n).bfloat16() if with_bias else None
    packed = cpu_ops.pack_weight_int4(q, group_size)
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        ours = cpu_ops.linear_int4_packed(
            x, packed, scale, zero, group_size, n, bias, out_fp32=True, kernel=kernel
        )
        assert ours.dtype == torch.float32 and ours.shape == (m, n)
        exact = x.double() @ w.T + (bias.double() if bias is not None else 0.0)
        # The sums of exact products and their folding with each group's scale and zero, all in
        # fp32: a few units of fp32 rounding of the sum of the terms' magnitudes.
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
        assert ((ours.double() - exact).abs() <= bound).all(), (m, n, k, group_size)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_bf16_output_is_the_fp32_output_rounded_to_nearest_even(
    n: int, k: int, group_size: int, kernel: str
) -> None:
    q, scale, zero = quantized(n, k, group_size, 5)
    bias = torch.randn(n).bfloat16()
    packed = cpu_ops.pack_weight_int4(q, group_size)
    x = torch.randn(40, k).bfloat16()
    wide = cpu_ops.linear_int4_packed(
        x, packed, scale, zero, group_size, n, bias, out_fp32=True, kernel=kernel
    )
    ours = cpu_ops.linear_int4_packed(x, packed, scale, zero, group_size, n, bias, kernel=kernel)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, wide.bfloat16())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_each_row_is_the_same_alone_as_in_any_batch(out_fp32: bool, kernel: str) -> None:
    n, k, group_size = 140, 200, 64  # 8 tiles and a partial one; a partial last group of 8
    q, scale, zero = quantized(n, k, group_size, 3)
    packed = cpu_ops.pack_weight_int4(q, group_size)
    x = torch.randn(40, k).bfloat16()

    def linear(rows: torch.Tensor) -> torch.Tensor:
        return cpu_ops.linear_int4_packed(
            rows, packed, scale, zero, group_size, n, out_fp32=out_fp32, kernel=kernel
        )

    alone = torch.cat([linear(x[i : i + 1]) for i in range(40)])
    for m in ROWS[1:]:
        assert torch.equal(linear(x[:m]), alone[:m]), m


def test_bad_inputs_are_refused() -> None:
    q, scale, zero = quantized(20, 16, 8, 1)
    packed = cpu_ops.pack_weight_int4(q, 8)
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match=r"q values must be in 0\.\.15 \(4 bits\), got 16"):
        cpu_ops.pack_weight_int4(torch.where(q == 3, 16, q), 8)
    with pytest.raises(RuntimeError, match="q must be"):
        cpu_ops.pack_weight_int4(q.to(torch.int8), 8)
    for bad in (12, 0, -8):
        with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 8 or K"):
            cpu_ops.pack_weight_int4(q, bad)
        with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 8 or K"):
            cpu_ops.linear_int4_packed(x, packed, scale, zero, bad, 20)
    with pytest.raises(RuntimeError, match=r"scale must be \[20, 1\] fp32"):
        cpu_ops.linear_int4_packed(x, packed, scale, zero, 16, 20)  # G = 2 is group 8's
    with pytest.raises(RuntimeError, match=r"scale must be \[20, 2\] fp32"):
        cpu_ops.linear_int4_packed(x, packed, scale.double(), zero, 8, 20)
    with pytest.raises(RuntimeError, match=r"zero must be \[20, 2\] fp32"):
        cpu_ops.linear_int4_packed(x, packed, scale, zero.T, 8, 20)
    with pytest.raises(RuntimeError, match="is not"):
        cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 40)
    with pytest.raises(RuntimeError, match="packed weight must be contiguous uint8"):
        cpu_ops.linear_int4_packed(x, packed.to(torch.int8), scale, zero, 8, 20)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.linear_int4_packed(x.float(), packed, scale, zero, 8, 20)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 20, torch.ones(3))


@pytest.mark.skipif(
    not cpu_ops.has_avx512f_kernels(), reason="this CPU lacks AVX512F/BW/VL (avx512f kernel)"
)
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_the_16_lane_kernel_makes_the_avx2_kernels_sums_bit_for_bit(
    n: int, k: int, group_size: int
) -> None:
    q, scale, zero = quantized(n, k, group_size, n + k)
    packed = cpu_ops.pack_weight_int4(q, group_size)
    bias = torch.randn(n).bfloat16()
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        for out_fp32 in (False, True):
            wide, narrow = (
                cpu_ops.linear_int4_packed(
                    x, packed, scale, zero, group_size, n, bias, out_fp32=out_fp32, kernel=kernel
                )
                for kernel in ("avx512f", "avx2")
            )
            assert torch.equal(wide, narrow), (m, out_fp32)


def test_kernels_are_named_and_auto_takes_the_cpus() -> None:
    q, scale, zero = quantized(20, 16, 8, 1)
    packed = cpu_ops.pack_weight_int4(q, 8)
    x = torch.randn(3, 16).bfloat16()
    auto = cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 20, out_fp32=True)
    named = cpu_ops.linear_int4_packed(
        x, packed, scale, zero, 8, 20, out_fp32=True, kernel=KERNELS[-1]
    )
    assert torch.equal(auto, named)
    assert cpu_ops.has_int4_linear()
    with pytest.raises(RuntimeError, match=r"unknown kernel 'amx' \(auto, avx2, avx512, avx512f\)"):
        cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 20, kernel="amx")
    if not cpu_ops.has_avx512_int4_linear():
        with pytest.raises(RuntimeError, match="kernel 'avx512' needs a CPU with AVX512_BF16"):
            cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 20, kernel="avx512")
    if not cpu_ops.has_avx512f_kernels():
        with pytest.raises(RuntimeError, match="kernel 'avx512f' needs a CPU with AVX512F"):
            cpu_ops.linear_int4_packed(x, packed, scale, zero, 8, 20, kernel="avx512f")
