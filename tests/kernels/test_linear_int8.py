"""The int8-weight linear kernel (`cpu_ops.linear_int8_packed`, `--quantize int8`): the sums the
bf16 kernel makes over the int8 values as bf16 weights, bit for bit, times each column's scale,
rounded once; the same for every row whatever else is in the call."""

from __future__ import annotations

import pytest
import torch

from tgq.kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.has_avx512_int8_linear() or not cpu_ops.is_available(),
    reason="the int8 linear kernel needs AVX512_BF16 and AVX512_VBMI",
)

# Rows of x on each side of the kernel's forms (1-2, 3-4 and 5-16 rows in one pass; 17 and more
# tile by tile in groups of 16), and N, K past whole tiles and blocks.
ROWS = (0, 1, 2, 3, 5, 8, 9, 16, 17, 40)
SHAPES = ((1, 1), (40, 3), (33, 130), (77, 64), (16, 4))  # (N, K)


def int8_weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_with_unit_scales_it_is_the_bf16_kernel_over_the_int8_values(
    n: int, k: int, out_fp32: bool
) -> None:
    q = int8_weights(n, k, n * k)
    bias = torch.randn(n).bfloat16()
    packed, as_bf16 = cpu_ops.pack_weight_int8(q), cpu_ops.pack_weight_bf16(q.bfloat16())
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        ours = cpu_ops.linear_int8_packed(x, packed, torch.ones(n), n, bias, out_fp32=out_fp32)
        bf16 = cpu_ops.linear_bf16_packed(x, as_bf16, n, bias, out_fp32=out_fp32)
        assert ours.dtype == (torch.float32 if out_fp32 else torch.bfloat16)
        assert torch.equal(ours, bf16), (m, n, k)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_scaled_sums_are_the_fp32_product_rounded_once(n: int, k: int) -> None:
    q = int8_weights(n, k, 7)
    scale = torch.rand(n) * 0.02 + 1e-4
    bias = torch.randn(n).bfloat16()
    packed = cpu_ops.pack_weight_int8(q)
    x = torch.randn(40, k).bfloat16()
    ours = cpu_ops.linear_int8_packed(x, packed, scale, n, bias).float()
    exact = (x.double() @ q.double().T) * scale.double() + bias.double()
    # One rounding to bf16 (half a unit in the last place: at most 2^-8 relative) of fp32 sums of
    # exact products, which differ from the float64 ones by far less.
    bound = exact.abs() * 2.0**-8 + 1e-6
    assert ((ours.double() - exact).abs() <= bound).all()


def test_each_row_is_the_same_alone_as_in_any_batch() -> None:
    n, k = 70, 200
    q, scale = int8_weights(n, k, 3), torch.rand(n) * 0.01
    packed = cpu_ops.pack_weight_int8(q)
    x = torch.randn(40, k).bfloat16()
    alone = torch.cat(
        [cpu_ops.linear_int8_packed(x[i : i + 1], packed, scale, n) for i in range(40)]
    )
    for m in ROWS[1:]:
        assert torch.equal(cpu_ops.linear_int8_packed(x[:m], packed, scale, n), alone[:m])


def test_bad_inputs_are_refused() -> None:
    q = int8_weights(20, 8, 1)
    packed = cpu_ops.pack_weight_int8(q)
    x, scale = torch.randn(2, 8).bfloat16(), torch.ones(20)
    with pytest.raises(RuntimeError, match=r"weights must be in \[-127, 127\]"):
        cpu_ops.pack_weight_int8(torch.full((3, 3), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="weight must be int8"):
        cpu_ops.pack_weight_int8(q.float())
    with pytest.raises(RuntimeError, match="is not"):
        cpu_ops.linear_int8_packed(x, packed, torch.ones(40), 40)
    with pytest.raises(RuntimeError, match=r"scale must be \[20\] fp32"):
        cpu_ops.linear_int8_packed(x, packed, scale.double(), 20)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.linear_int8_packed(x.float(), packed, scale, 20)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        cpu_ops.linear_int8_packed(x, packed, scale, 20, torch.ones(3))
