"""FP8 E4M3 KV caches: write_kv_ quantizes as torch does, bit for bit; the AVX-512 attention
kernels read the bytes as the bf16 kernels read `cache.to(bfloat16)`, bit for bit at unit (and
power-of-two) scales, and within bf16 rounding of the exact result at any other scale."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tgq.kernels import cpu_ops

FP8 = torch.float8_e4m3fn

pytestmark = requires_kernels

_DECODES_FP8 = pytest.mark.skipif(
    not cpu_ops.has_avx512_8bit_linear(),
    reason="this CPU lacks AVX512_BF16 or AVX512_VBMI (the fp8 cache's decoding)",
)
_PREFILL_KERNELS = [
    "avx512",
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            not cpu_ops.has_amx_bf16(), reason="this CPU lacks AMX-BF16 (or Linux refuses it)"
        ),
    ),
]


def _quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the brief defines an fp8 cache byte to be."""
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def _edge_values() -> torch.Tensor:  # fp32: saturation, ties, subnormals, zeros, infinities
    sub = 2.0**-9  # the smallest E4M3 subnormal
    values = [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 479.0, 500.0, -1e6, float("inf")]
    values += [float("-inf"), 1.0625, 1.1875, -1.0625, 2.0**-6, 2.0**-6 - sub / 2, 2.0**-20]
    values += [m * sub / 2 for m in range(-17, 18)]  # every subnormal and every tie between two
    values += [1e-40, -1e-45, 3.4e38, 240.0, 232.0, 248.0, 0.5 * (2.0**-6 + 2.0**-6 * 1.125)]
    return torch.tensor(values)


def _rows(gen: torch.Generator, tokens: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Values of every magnitude E4M3 holds and more, the edge values first."""
    size = tokens * kv_heads * head_dim
    magnitude = torch.exp2(torch.randint(-14, 12, (size,), generator=gen).float())
    values = torch.randn(size, generator=gen) * magnitude
    edges = _edge_values()
    values[: min(size, len(edges))] = edges[:size]
    return values.reshape(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0, 2.0**-5])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(4, 64), (3, 7)])  # 3 x 7: a ragged row
def test_write_kv_stores_torchs_e4m3_bytes(
    dtype: torch.dtype, scale: float, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(int(scale * 100) + head_dim)
    tokens, blocks, block_size = 40, 8, 16
    # key and value as views of one fused qkv row, as the model passes them
    qkv = torch.empty(tokens, 3, kv_heads, head_dim, dtype=dtype)
    qkv[:, 1] = _rows(gen, tokens, kv_heads, head_dim).to(dtype)
    qkv[:, 2] = _rows(gen, tokens, kv_heads, head_dim).to(dtype) * 7
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    cpu_ops.write_kv_(k_cache, v_cache, key, value, slots, k_scale=scale, v_scale=scale * 2)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    expected_k.view(-1, kv_heads, head_dim)[slots] = _quantized(key, scale)
    expected_v.view(-1, kv_heads, head_dim)[slots] = _quantized(value, scale * 2)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert not k_cache.float().isnan().any()  # infinities and overflows saturate to +-448


def test_write_kv_stores_nan_as_torch_does() -> None:
    key = torch.tensor([float("nan"), -float("nan"), 1.0, float("nan")]).reshape(1, 1, 4)
    k_cache = torch.zeros(1, 1, 1, 4, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    cpu_ops.write_kv_(k_cache, v_cache, key, key, torch.tensor([0]))
    assert torch.equal(k_cache.view(torch.uint8)[0, 0], _quantized(key, 1.0).view(torch.uint8)[0])


def test_write_kv_copies_fp8_rows_into_fp8_caches_as_they_are() -> None:
    gen = torch.Generator().manual_seed(3)
    key = (torch.randn(5, 2, 32, generator=gen) * 100).to(FP8)
    k_cache = torch.zeros(4, 4, 2, 32, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, 15, 7, 8])
    cpu_ops.write_kv_(k_cache, v_cache, key, key, slots)
    assert torch.equal(k_cache.view(-1, 2, 32)[slots].view(torch.uint8), key.view(torch.uint8))


@pytest.mark.parametrize(
    ("cache_dtypes", "row_dtype", "scales", "message"),
    [
        ((FP8, torch.bfloat16), torch.bfloat16, (1.0, 1.0), "must share a dtype"),
        ((FP8, FP8), torch.float16, (1.0, 1.0), "float8_e5m2 and key and value bf16 or fp32"),
        ((FP8, FP8), torch.bfloat16, (0.0, 1.0), "finite and > 0"),
        ((FP8, FP8), torch.bfloat16, (1.0, float("nan")), "finite and > 0"),
        ((torch.bfloat16,) * 2, torch.bfloat16, (2.0, 1.0), "apply to fp8 caches"),
    ],
)
def test_write_kv_refuses_bad_dtypes_and_scales_and_writes_nothing(
    cache_dtypes: tuple[torch.dtype, torch.dtype],
    row_dtype: torch.dtype,
    scales: tuple[float, float],
    message: str,
) -> None:
    k_cache = torch.zeros(2, 4, 2, 32, dtype=cache_dtypes[0])
    v_cache = torch.zeros(2, 4, 2, 32, dtype=cache_dtypes[1])
    key = torch.ones(1, 2, 32, dtype=row_dtype)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.write_kv_(k_cache, v_cache, key, key, torch.tensor([0]), *scales)
    assert not k_cache.float().any() and not v_cache.float().any()


def _fp8_caches(
    gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of every E4M3 magnitude (a few at +-448, some subnormal)."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    magnitude = torch.exp2(torch.randint(-10, 3, shape, generator=gen).float())
    k_cache = (torch.randn(shape, generator=gen) * magnitude).to(FP8)
    v_cache = (torch.randn(shape, generator=gen) * magnitude * 40).clamp(-448, 448).to(FP8)
    return k_cache, v_cache


def _decode_inputs(
    gen: torch.Generator,
    kv_lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int = 16,
) -> tuple[torch.Tensor, ...]:  # query, k_cache, v_cache, tables, lens
    """Shuffled, non-contiguous blocks per sequence."""
    num_heads, kv_heads = heads
    needed = [(kv_len + block_size - 1) // block_size for kv_len in kv_lens]
    num_blocks = sum(needed) + 3
    k_cache, v_cache = _fp8_caches(gen, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=torch.int32)
    block_ids = torch.randperm(num_blocks, generator=gen).int()
    start = 0
    for b, count in enumerate(needed):
        tables[b, :count] = block_ids[start : start + count]
        start += count
    query = torch.randn(len(kv_lens), num_heads, head_dim, generator=gen).bfloat16()
    return query, k_cache, v_cache, tables, torch.tensor(kv_lens)


def _decode(
    inputs: tuple[torch.Tensor, ...],
    caches: tuple[torch.Tensor, torch.Tensor],
    path: str = "avx512",
    **kwargs: float,
) -> torch.Tensor:
    query, _, _, tables, lens = inputs
    window = int(kwargs.pop("window", 0))
    scale = query.shape[-1] ** -0.5
    return cpu_ops.paged_decode_attention(
        query, caches[0], caches[1], tables, lens, scale, window, path, **kwargs
    )


KV_LENS = [1, 15, 16, 17, 100, 130, 33]


@_DECODES_FP8
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("heads", [(12, 4), (8, 1), (4, 4), (14, 2), (12, 1)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (37, 0.0), (0, 2.0), (20, 2.0)])
def test_decode_reads_fp8_as_the_bf16_kernel_reads_the_converted_cache(
    head_dim: int, heads: tuple[int, int], window: int, softcap: float
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 31 + heads[0] * 7 + heads[1] + window)
    inputs = _decode_inputs(gen, KV_LENS, heads, head_dim)
    fp8 = (inputs[1], inputs[2])
    bf16 = (inputs[1].bfloat16(), inputs[2].bfloat16())
    out = _decode(inputs, fp8, window=window, softcap=softcap)
    assert torch.equal(out, _decode(inputs, bf16, window=window, softcap=softcap))
    # powers of two scale exactly, so the kernel still does the bf16 kernel's arithmetic
    scaled = (bf16[0] * 0.25, bf16[1] * 8.0)
    out = _decode(inputs, fp8, window=window, softcap=softcap, k_scale=0.25, v_scale=8.0)
    assert torch.equal(out, _decode(inputs, scaled, window=window, softcap=softcap))
    auto = cpu_ops.paged_decode_attention(
        inputs[0], *fp8, inputs[3], inputs[4], head_dim**-0.5, window, softcap=softcap
    )
    assert torch.equal(auto, _decode(inputs, fp8, window=window, softcap=softcap))


@_DECODES_FP8
@pytest.mark.parametrize("block_size", [8, 48])
def test_decode_reads_fp8_at_other_block_sizes(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    inputs = _decode_inputs(gen, [1, 47, 48, 49, 200], (8, 2), 64, block_size)
    bf16 = (inputs[1].bfloat16(), inputs[2].bfloat16())
    assert torch.equal(_decode(inputs, (inputs[1], inputs[2])), _decode(inputs, bf16))


def _exact_attention(
    inputs: tuple[torch.Tensor, ...], k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, H, D] fp64 each
    """softmax(q k^T scale) v over the caches' exact scaled values, and sum_t p_t |v_t| (what the
    fp32 sums' error is relative to)."""
    query, k_cache, v_cache, tables, lens = inputs
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    outs, magnitudes = [], []
    for b, kv_len in enumerate(lens.tolist()):
        positions = torch.arange(kv_len)
        blocks = tables[b].long()[positions // block_size]
        rows = (blocks, positions % block_size)
        keys = k_cache[rows].double().repeat_interleave(group, dim=1) * k_scale
        values = v_cache[rows].double().repeat_interleave(group, dim=1) * v_scale
        scores = torch.einsum("hd,thd->ht", query[b].double(), keys) * query.shape[-1] ** -0.5
        weights = scores.softmax(dim=-1)
        outs.append(torch.einsum("ht,thd->hd", weights, values))
        magnitudes.append(torch.einsum("ht,thd->hd", weights, values.abs()))
    return torch.stack(outs), torch.stack(magnitudes)


@_DECODES_FP8
@pytest.mark.parametrize(("k_scale", "v_scale"), [(0.037, 1.7), (3.3, 0.0021)])
def test_decode_applies_other_scales_within_bf16_rounding(k_scale: float, v_scale: float) -> None:
    """Each output within 2 bf16 ulps of the exact attention over the scaled values, plus the fp32
    sums' error (the bf16 kernel on the caches scaled and rounded to bf16 strays further: each
    value carries its own rounding)."""
    gen = torch.Generator().manual_seed(5)
    inputs = _decode_inputs(gen, KV_LENS, (12, 4), 64)
    out = _decode(inputs, (inputs[1], inputs[2]), k_scale=k_scale, v_scale=v_scale)
    exact, magnitude = _exact_attention(inputs, k_scale, v_scale)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((out.double() - exact).abs() <= 2 * ulp + 4e-5 * magnitude).all()


@pytest.mark.parametrize("head_dim", [7, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("heads", [(12, 4), (8, 1), (4, 4), (14, 2), (9, 3)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (37, 0.0), (0, 2.0), (20, 2.0)])
def test_avx2_decode_reads_fp8_as_it_reads_the_converted_cache(
    head_dim: int, heads: tuple[int, int], window: int, softcap: float
) -> None:
    """Any head size (7: no whole vector), shuffled tables, odd lengths, on every CPU."""
    gen = torch.Generator().manual_seed(head_dim * 31 + heads[0] * 7 + heads[1] + window + 1)
    inputs = _decode_inputs(gen, KV_LENS, heads, head_dim)
    fp8 = (inputs[1], inputs[2])
    bf16 = (inputs[1].bfloat16(), inputs[2].bfloat16())
    kw = {"window": window, "softcap": softcap}
    out = _decode(inputs, fp8, "avx2", **kw)
    assert torch.equal(out, _decode(inputs, bf16, "avx2", **kw))
    scaled = (bf16[0] * 0.25, bf16[1] * 8.0)
    out = _decode(inputs, fp8, "avx2", k_scale=0.25, v_scale=8.0, **kw)
    assert torch.equal(out, _decode(inputs, scaled, "avx2", **kw))


@pytest.mark.parametrize("block_size", [1, 8, 48])
def test_avx2_decode_reads_fp8_at_other_block_sizes(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    inputs = _decode_inputs(gen, [1, 47, 48, 49, 200], (8, 2), 64, block_size)
    bf16 = (inputs[1].bfloat16(), inputs[2].bfloat16())
    assert torch.equal(
        _decode(inputs, (inputs[1], inputs[2]), "avx2"), _decode(inputs, bf16, "avx2")
    )


@pytest.mark.parametrize("fp8", [FP8, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path", ["avx2", pytest.param("avx512", marks=_DECODES_FP8)])
def test_decode_decodes_every_byte_exactly(path: str, fp8: torch.dtype) -> None:
    """One token: each output is its V row, so every byte (NaNs, infinities and subnormals
    included) must come out as torch's conversion, through the vector lanes and (AVX2, head size
    264) the scalar tail, which holds bytes 0xF8-0xFF. E4M3, and E5M2 (test_kv_e5m2.py)."""
    for head_dim in (256, 264) if path == "avx2" else (256,):
        v_row = (torch.arange(head_dim) + 240).remainder(256).to(torch.uint8).view(fp8)
        v_cache = v_row.reshape(1, 1, 1, head_dim)
        k_cache = torch.zeros_like(v_cache)
        query = torch.ones(1, 2, head_dim, dtype=torch.bfloat16)
        out = cpu_ops.paged_decode_attention(
            query, k_cache, v_cache, torch.tensor([[0]]), torch.tensor([1]), 1.0, 0, path
        )
        assert torch.equal(out[0, 0].isnan(), v_row.float().isnan())
        assert torch.equal(out[0, 1].nan_to_num(), v_row.bfloat16().nan_to_num())


def test_fp8_kv_decode_path_names_the_kernel_that_reads_fp8() -> None:
    for head_dim in (7, 32, 64, 256, 288):
        expected = "avx512" if cpu_ops.fp8_kv_attention_serves(head_dim) else "avx2"
        assert cpu_ops.fp8_kv_decode_path(head_dim) == expected


def test_fp8_kv_attention_serves_whole_lines_where_the_cpu_decodes() -> None:
    served = cpu_ops.has_avx512_8bit_linear()
    assert [cpu_ops.fp8_kv_attention_serves(d) for d in (32, 64, 128, 256)] == [served] * 4
    assert not any(cpu_ops.fp8_kv_attention_serves(d) for d in (0, 48, 100, 288))


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtypes", "path", "scales", "message"),
    [
        (torch.bfloat16, (FP8, torch.bfloat16), "auto", (1.0, 1.0), "must share a dtype"),
        (FP8, (FP8, FP8), "auto", (1.0, 1.0), "fp8 caches need a bf16 query"),
        (torch.float32, (FP8, FP8), "auto", (1.0, 1.0), "fp8 caches need a bf16 query"),
        (torch.bfloat16, (FP8, FP8), "auto", (-1.0, 1.0), "finite and > 0"),
        (torch.bfloat16, (torch.bfloat16,) * 2, "auto", (1.0, 0.5), "fp8 caches only"),
    ],
)
def test_decode_refuses_bad_fp8_inputs(
    query_dtype: torch.dtype,
    cache_dtypes: tuple[torch.dtype, torch.dtype],
    path: str,
    scales: tuple[float, float],
    message: str,
) -> None:
    query = torch.ones(1, 4, 64).to(query_dtype)
    k_cache = torch.ones(2, 16, 2, 64).to(cache_dtypes[0])
    v_cache = torch.ones(2, 16, 2, 64).to(cache_dtypes[1])
    tables, lens = torch.tensor([[0]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.125, 0, path,
            k_scale=scales[0], v_scale=scales[1],
        )  # fmt: skip


def _prefill(
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    block_ids: torch.Tensor,
    kv_len: int,
    window: int,
    kernel: str,
    **scales: float,
) -> torch.Tensor:
    scale = query.shape[-1] ** -0.5
    return cpu_ops.paged_prefill_attention(
        query, caches[0], caches[1], block_ids, kv_len, scale, window, kernel, **scales
    )


@_DECODES_FP8
@pytest.mark.parametrize("kernel", _PREFILL_KERNELS)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads", [(12, 4), (4, 4)])
@pytest.mark.parametrize(
    ("num_queries", "kv_len", "window"), [(37, 37, 0), (20, 90, 0), (50, 70, 23)]
)
def test_prefill_reads_fp8_as_the_bf16_kernel_reads_the_converted_cache(
    kernel: str, head_dim: int, heads: tuple[int, int], num_queries: int, kv_len: int, window: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + kv_len + heads[1])
    used = (kv_len + 15) // 16
    fp8 = _fp8_caches(gen, used + 4, 16, heads[1], head_dim)
    bf16 = (fp8[0].bfloat16(), fp8[1].bfloat16())
    block_ids = torch.randperm(used + 4, generator=gen)[:used]
    query = torch.randn(num_queries, heads[0], head_dim, generator=gen).bfloat16()
    out = _prefill(query, fp8, block_ids, kv_len, window, kernel)
    assert torch.equal(out, _prefill(query, bf16, block_ids, kv_len, window, kernel))
    scaled = (bf16[0] * 4.0, bf16[1] * 0.125)
    out = _prefill(query, fp8, block_ids, kv_len, window, kernel, k_scale=4.0, v_scale=0.125)
    assert torch.equal(out, _prefill(query, scaled, block_ids, kv_len, window, kernel))


@_DECODES_FP8
def test_prefill_refuses_mixed_caches_and_scales_on_bf16_caches() -> None:
    query = torch.ones(2, 4, 64, dtype=torch.bfloat16)
    fp8 = torch.ones(2, 16, 2, 64).to(FP8)
    bf16 = torch.ones(2, 16, 2, 64, dtype=torch.bfloat16)
    ids = torch.tensor([0])
    with pytest.raises(RuntimeError, match="must share a dtype"):
        _prefill(query, (fp8, bf16), ids, 2, 0, "avx512")
    with pytest.raises(RuntimeError, match="fp8 caches only"):
        _prefill(query, (bf16, bf16), ids, 2, 0, "avx512", v_scale=2.0)
    with pytest.raises(RuntimeError, match="finite and > 0"):
        _prefill(query, (fp8, fp8), ids, 2, 0, "avx512", k_scale=float("inf"))
