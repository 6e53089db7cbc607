"""`cpu_ops.linear_w8a8_vnni`, an INT8 W8A8 linear as integers on AVX512_VNNI: its input codes
and scales are the ones `quantize_inputs` rounds (so the same values the format's forward sees),
and its outputs equal, bit for bit, the sums of the codes times the weights made exactly in
int64 by torch, times the weights' scales, times the rows' scales (plus the bias), rounded once."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_vnni_w8a8
from tgq.kernels import cpu_ops

pytestmark = requires_vnni_w8a8

# (M, N, K): one row to prefill-sized, N and K past the 16-column tiles and 4-value quads.
SHAPES = [(1, 33, 37), (3, 16, 4), (8, 100, 768), (9, 48, 5), (16, 1280, 768), (70, 31, 2050)]
MODES = {  # per_token, static scale
    "token": (True, None),
    "tensor": (False, None),
    "static": (False, torch.tensor([0.021])),
}


def reference(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    per_token: bool,
    static_scale: torch.Tensor | None,
) -> torch.Tensor:
    codes, scales = cpu_ops.int8_codes(x, per_token, static_scale)
    sums = codes.to(torch.int64) @ w.to(torch.int64).T  # exact
    out = (sums.float() * w_scale) * scales[:, None]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_codes_are_what_quantize_inputs_rounds(mode: str, dtype: torch.dtype) -> None:
    per_token, static_scale = MODES[mode]
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(13, 301, generator=gen) * 3).to(dtype)
    x[4] = 0  # an all-zero row: the dtype's epsilon as its scale
    codes, scales = cpu_ops.int8_codes(x, per_token, static_scale)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert int(codes.min()) >= -128 and int(codes.max()) <= 127
    dequantized = cpu_ops.quantize_inputs(
        x, fp8=False, per_token=per_token, static_scale=static_scale
    )
    assert torch.equal((codes.float() * scales[:, None]).to(dtype), dequantized)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_outputs_are_the_exact_integer_sums_times_the_scales(
    shape: tuple[int, int, int], mode: str, dtype: torch.dtype
) -> None:
    """The weights span all of int8, -128 included (compressed-tensors stores it)."""
    m, n, k = shape
    per_token, static_scale = MODES[mode]
    gen = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    if m > 2:  # an all-zero row (the dtype's epsilon as its scale) and one of tiny values
        x[1], x[2] = 0, x[2] * 1e-30
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    packed, offset = cpu_ops.pack_weight_vnni(w), cpu_ops.vnni_offset(w)
    for bias in (None, torch.randn(n, generator=gen).to(dtype)):
        ours = cpu_ops.linear_w8a8_vnni(
            x, packed, offset, w_scale, n, bias, per_token=per_token, static_scale=static_scale
        )
        assert ours.dtype == dtype and ours.shape == (m, n)
        assert torch.equal(ours, reference(x, w, w_scale, bias, per_token, static_scale))


def test_rows_quantized_per_token_do_not_depend_on_their_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 200, generator=gen).bfloat16()
    w = torch.randint(-128, 128, (40, 200), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(40, generator=gen)
    packed, offset = cpu_ops.pack_weight_vnni(w), cpu_ops.vnni_offset(w)
    whole = cpu_ops.linear_w8a8_vnni(x, packed, offset, w_scale, 40)
    for row in range(12):
        alone = cpu_ops.linear_w8a8_vnni(x[row : row + 1], packed, offset, w_scale, 40)
        assert torch.equal(alone[0], whole[row])


def test_bad_inputs_are_refused() -> None:
    w = torch.zeros(20, 8, dtype=torch.int8)
    packed, offset, scale = cpu_ops.pack_weight_vnni(w), cpu_ops.vnni_offset(w), torch.ones(20)
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"w must be \[N, K\] int8 on CPU"):
        cpu_ops.pack_weight_vnni(w.float())
    with pytest.raises(RuntimeError, match="K must be 1 to 65536, got 65537"):
        cpu_ops.pack_weight_vnni(torch.zeros(1, 65537, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"packed must be pack_weight_vnni of an \[20, 12\]"):
        cpu_ops.linear_w8a8_vnni(
            torch.zeros(2, 12, dtype=torch.bfloat16), packed, offset, scale, 20
        )
    with pytest.raises(RuntimeError, match=r"w_offset must be \[N\] int32 and w_scale \[N\] fp32"):
        cpu_ops.linear_w8a8_vnni(x, packed, offset, scale.double(), 20)
    with pytest.raises(RuntimeError, match="the static scale must be one fp32 value"):
        cpu_ops.linear_w8a8_vnni(
            x, packed, offset, scale, 20, per_token=False, static_scale=torch.ones(2)
        )
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\] bf16 or fp32"):
        cpu_ops.linear_w8a8_vnni(x.half(), packed, offset, scale, 20)
