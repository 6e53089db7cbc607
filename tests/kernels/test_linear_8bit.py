"""The 8-bit-weight linear kernels (`cpu_ops.linear_8bit_packed`, `--quantize int8|fp8`), on
each layout `pack_weight_8bit` makes: "avx512" makes the sums the bf16 kernel makes over the
weights' values as bf16, bit for bit; "avx2" and "avx512f" (one layout) sum each column in K
order, bit for bit against that sum written out here; all times each column's scale, rounded
once, and the same for every row whatever else is in the call. FP8 E4M3 codes decode to the
values the OCP FP8 specification gives them."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.markers import (
    EIGHT_BIT_KERNELS,
    requires_avx512_8bit,
    requires_avx512f_8bit,
    requires_kernels,
)
from tgq.kernels import cpu_ops

# A CPU flag, not the build: on a CPU that has them, a failed build fails these tests.
pytestmark = requires_kernels
# Each kernel; "avx512f" reads the "avx2" layout.
KERNELS = [*EIGHT_BIT_KERNELS[:2], pytest.param("avx512f", marks=requires_avx512f_8bit)]
BYTE_ROW_KERNELS = KERNELS[1:]


def pack(w: torch.Tensor, kernel: str) -> torch.Tensor:
    return cpu_ops.pack_weight_8bit(w, "avx2" if kernel == "avx512f" else kernel)


# Rows of x on each side of the kernels' forms (avx512: 1-2, 3-4 and 5-16 rows in one pass, 17
# and more tile by tile in groups of 16; avx2: 1-4 rows a pass; avx512f: 1-8), and N, K past
# whole tiles and blocks.
ROWS = (0, 1, 2, 3, 5, 8, 9, 16, 17, 40)
SHAPES = ((1, 1), (40, 3), (33, 130), (77, 64), (16, 4))  # (N, K)
FORMATS = ("int8", "int8-128", "fp8")  # int8-128: int8 weights that contain -128
E4M3_NAN = (0x7F, 0xFF)


def weights(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random int8 in [-127, 127] or [-128, 127], or random finite E4M3 codes (every exponent,
    subnormals and both zeros among them)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt.startswith("int8"):
        low = -128 if fmt == "int8-128" else -127
        q = torch.randint(low, 128, (n, k), generator=gen, dtype=torch.int8)
        if fmt == "int8-128":
            q[0, 0] = -128  # at least one, whatever the draw
        return q
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def e4m3_from_the_specification(code: int) -> float:
    """OCP 8-bit floating point, E4M3: sign bit, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m / 8 * 2^-6); S.1111.111 is NaN; no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_e4m3_code_decodes_to_its_specified_value(kernel: str) -> None:
    """Each of the 256 codes as a one-input column, times x = 1: the kernel's value of it. The
    avx2 layout refuses the NaN codes (its decoding has none): weights holding NaN are broken
    weights."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = codes.view(torch.float8_e4m3fn)[:, None]  # [256, 1]
    if kernel != "avx512":
        with pytest.raises(RuntimeError, match="pack_weight_8bit: FP8 weights hold NaN"):
            pack(w, kernel)
        w = torch.where(w.float().isnan(), 0, w.float()).to(torch.float8_e4m3fn)
    packed = pack(w, kernel)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    out = cpu_ops.linear_8bit_packed(x, packed, torch.ones(256), 256, out_fp32=True, kernel=kernel)
    out = out[0]
    for code in range(256):
        expected = e4m3_from_the_specification(code)
        if math.isnan(expected):
            assert code in E4M3_NAN
            assert math.isnan(out[code].item()) if kernel == "avx512" else out[code].item() == 0
            continue
        assert out[code].item() == expected, hex(code)  # (-0 sums to +0 from a zero start)
    finite = torch.tensor([c not in E4M3_NAN for c in range(256)])
    assert torch.equal(out[finite], w[finite, 0].float())  # torch's own conversion agrees


@requires_avx512_8bit
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_with_unit_scales_it_is_the_bf16_kernel_over_the_values(
    fmt: str, n: int, k: int, out_fp32: bool
) -> None:
    w = weights(fmt, n, k, n * k)
    bias = torch.randn(n).bfloat16()
    packed, as_bf16 = cpu_ops.pack_weight_8bit(w), cpu_ops.pack_weight_bf16(w.bfloat16())
    assert packed.dtype == (torch.uint8 if fmt == "int8-128" else w.dtype)
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        ours = cpu_ops.linear_8bit_packed(x, packed, torch.ones(n), n, bias, out_fp32=out_fp32)
        bf16 = cpu_ops.linear_bf16_packed(x, as_bf16, n, bias, out_fp32=out_fp32)
        assert ours.dtype == (torch.float32 if out_fp32 else torch.bfloat16)
        assert torch.equal(ours, bf16), (m, n, k)


def k_order_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] fp32: each row and column's sum of x * w, one input column after another from
    zero (each product exact in fp32, so each step is one rounding, as an FMA's)."""
    xf, wf = x.float(), w.float()
    sums = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        sums = sums + xf[:, k : k + 1] * wf[:, k]
    return sums


@pytest.mark.parametrize("kernel", BYTE_ROW_KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_the_byte_row_kernels_sum_each_column_in_k_order(
    kernel: str, fmt: str, n: int, k: int, out_fp32: bool
) -> None:
    w = weights(fmt, n, k, n + k)
    scale = torch.rand(n) * 0.02 + 1e-4
    bias = torch.randn(n).bfloat16()
    packed = pack(w, kernel)
    assert packed.dtype == w.dtype  # -128 is int8's own
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        sums = k_order_sums(x, w)
        for b in (None, bias):
            ours = cpu_ops.linear_8bit_packed(
                x, packed, scale, n, b, out_fp32=out_fp32, kernel=kernel
            )
            # sums * scale, or fma(sums, scale, bias): the float64 product is exact.
            exact = sums.double() * scale.double() + (0 if b is None else b.double())
            expected = exact.float() if out_fp32 else exact.float().bfloat16()
            assert torch.equal(ours, expected), (m, n, k, b is None)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_scaled_sums_are_the_fp32_product_rounded_once(
    kernel: str, fmt: str, n: int, k: int
) -> None:
    w = weights(fmt, n, k, 7)
    scale = torch.rand(n) * 0.02 + 1e-4
    bias = torch.randn(n).bfloat16()
    packed = pack(w, kernel)
    x = torch.randn(40, k).bfloat16()
    ours = cpu_ops.linear_8bit_packed(x, packed, scale, n, bias, kernel=kernel).float()
    exact = (x.double() @ w.double().T) * scale.double() + bias.double()
    # One rounding to bf16 (half a unit in the last place: at most 2^-8 relative) of fp32 sums of
    # exact products, which differ from the float64 ones by far less.
    bound = exact.abs() * 2.0**-8 + 1e-6
    assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_is_the_same_alone_as_in_any_batch(kernel: str, fmt: str) -> None:
    n, k = 70, 200
    w, scale = weights(fmt, n, k, 3), torch.rand(n) * 0.01
    packed = pack(w, kernel)
    x = torch.randn(40, k).bfloat16()

    def rows(m0: int, m1: int) -> torch.Tensor:
        return cpu_ops.linear_8bit_packed(x[m0:m1], packed, scale, n, kernel=kernel)

    alone = torch.cat([rows(i, i + 1) for i in range(40)])
    for m in ROWS[1:]:
        assert torch.equal(rows(0, m), alone[:m])


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_inputs_are_refused(kernel: str) -> None:
    q = weights("int8", 20, 8, 1)
    packed = pack(q, kernel)
    with pytest.raises(RuntimeError, match="unknown kernel 'amx' \\(avx2, avx512\\)"):
        cpu_ops.pack_weight_8bit(q, "amx")
    other = "avx2" if kernel == "avx512" else "avx512"
    with pytest.raises(RuntimeError, match=f"kernel '{other}' does not read the"):
        cpu_ops.linear_8bit_packed(
            torch.randn(2, 8).bfloat16(), packed, torch.ones(20), 20, kernel=other
        )
    x, scale = torch.randn(2, 8).bfloat16(), torch.ones(20)
    with pytest.raises(RuntimeError, match="weight must be int8 or float8_e4m3fn"):
        cpu_ops.pack_weight_8bit(q.float())
    with pytest.raises(RuntimeError, match="weight must be int8 or float8_e4m3fn"):
        cpu_ops.pack_weight_8bit(q.float().to(torch.float8_e5m2))
    with pytest.raises(RuntimeError, match="is not"):
        cpu_ops.linear_8bit_packed(x, packed, torch.ones(40), 40)
    with pytest.raises(RuntimeError, match="packed weight must be contiguous int8, uint8 or"):
        cpu_ops.linear_8bit_packed(x, packed.float(), scale, 20)
    with pytest.raises(RuntimeError, match=r"scale must be \[20\] fp32"):
        cpu_ops.linear_8bit_packed(x, packed, scale.double(), 20)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.linear_8bit_packed(x.float(), packed, scale, 20)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        cpu_ops.linear_8bit_packed(x, packed, scale, 20, torch.ones(3))
