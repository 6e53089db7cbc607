"""paged_decode_attention, each kernel (AVX2 fp32, AVX-512 bf16) against an fp32 torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tests.kernels.numerics import rel_err
from tgq.kernels import cpu_ops

_AVX512 = pytest.mark.skipif(
    not cpu_ops.has_avx512_bf16(), reason="this CPU lacks AVX512_BF16 (the avx512 decode kernel)"
)
# "auto" is "avx512" for bf16 on an AVX512_BF16 CPU (head sizes it serves), else "avx2".
PATHS = ["auto", "avx2", pytest.param("avx512", marks=_AVX512)]


def _reference_decode(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    outs = []
    for b, kv_len in enumerate(kv_lens.tolist()):
        positions = torch.arange(kv_len)
        blocks = block_tables[b].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", query[b].float(), keys) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if sliding_window > 0:
            scores[:, positions <= kv_len - 1 - sliding_window] = float("-inf")
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values))
    return torch.stack(outs)


def _random_block_tables(
    gen: torch.Generator, kv_lens: list[int], block_size: int, num_blocks: int, dtype: torch.dtype
) -> torch.Tensor:  # [B, max_blocks]
    """Distinct, shuffled (non-contiguous) blocks per sequence; unused entries hold -1."""
    needed = [(kv_len + block_size - 1) // block_size for kv_len in kv_lens]
    tables = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=dtype)
    block_ids = torch.randperm(num_blocks, generator=gen).to(dtype)
    start = 0
    for b, count in enumerate(needed):
        tables[b, :count] = block_ids[start : start + count]
        start += count
    return tables


def _decode_inputs(
    gen: torch.Generator,
    kv_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    *,
    head_dim: int = 64,
    block_size: int = 16,
    table_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, ...]:  # query, k_cache, v_cache, tables, lens
    num_blocks = sum(kv_lens) // block_size + len(kv_lens) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = _random_block_tables(gen, kv_lens, block_size, num_blocks, table_dtype)
    query = torch.randn(len(kv_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(kv_lens)


def _check_decode(
    inputs: tuple[torch.Tensor, ...],
    sliding_window: int,
    path: str,
    tolerance: float,
    softcap: float = 0.0,
) -> None:
    query, k_cache, v_cache, tables, lens = inputs
    scale = query.shape[-1] ** -0.5
    out = cpu_ops.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, scale, sliding_window, path, softcap=softcap
    )
    ref = _reference_decode(query, k_cache, v_cache, tables, lens, scale, sliding_window, softcap)
    assert out.dtype == query.dtype
    assert out.shape == query.shape
    assert rel_err(out, ref) < tolerance


@requires_kernels
@pytest.mark.parametrize(
    ("dtype", "path"),
    [
        (torch.bfloat16, "auto"),
        (torch.bfloat16, "avx2"),
        pytest.param(torch.bfloat16, "avx512", marks=_AVX512),
        (torch.float32, "auto"),  # the avx2 kernel: avx512 is bf16 only (refusal tested below)
        (torch.float32, "avx2"),
    ],
)
@pytest.mark.parametrize("sliding_window", [0, 5, 37])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(12, 4), (4, 4)])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_paged_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int,
    dtype: torch.dtype,
    table_dtype: torch.dtype,
    path: str,
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + sliding_window)
    kv_lens = [1, 16, 17, 5, 100, 128, 33]
    inputs = _decode_inputs(gen, kv_lens, num_heads, num_kv_heads, dtype, table_dtype=table_dtype)
    _check_decode(inputs, sliding_window, path, 1e-2 if dtype == torch.bfloat16 else 1e-5)


@requires_kernels
@pytest.mark.parametrize(
    ("dtype", "path"),
    [
        (torch.bfloat16, "avx2"),
        pytest.param(torch.bfloat16, "avx512", marks=_AVX512),
        (torch.float32, "avx2"),
    ],
)
@pytest.mark.parametrize("sliding_window", [0, 37])
def test_paged_decode_soft_caps_the_scores(
    dtype: torch.dtype, path: str, sliding_window: int
) -> None:
    """Gemma 2's cap * tanh(score / cap) on the scaled scores, before the window's mask: with
    scores of several times the cap (queries scaled up), the capped output matches the capped
    reference and is far from the uncapped one."""
    gen = torch.Generator().manual_seed(13)
    query, k, v, tables, lens = _decode_inputs(gen, [1, 16, 17, 5, 100, 128, 33], 12, 4, dtype)
    query = query * 4
    inputs = (query, k, v, tables, lens)
    _check_decode(inputs, sliding_window, path, 1e-2 if dtype == torch.bfloat16 else 1e-5, 2.0)
    scale = query.shape[-1] ** -0.5
    capped = cpu_ops.paged_decode_attention(
        query, k, v, tables, lens, scale, sliding_window, path, softcap=2.0
    )
    uncapped = _reference_decode(query, k, v, tables, lens, scale, sliding_window)
    assert rel_err(capped, uncapped) > 0.1
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        cpu_ops.paged_decode_attention(query, k, v, tables, lens, scale, 0, path, softcap=-1.0)


@requires_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sliding_window", [0, 50])
def test_paged_decode_large_batch_matches_reference(sliding_window: int, path: str) -> None:
    gen = torch.Generator().manual_seed(7)
    kv_lens = torch.randint(1, 200, (40,), generator=gen).tolist()
    inputs = _decode_inputs(gen, kv_lens, 12, 4, torch.bfloat16)
    _check_decode(inputs, sliding_window, path, 1e-2)


@requires_kernels
@pytest.mark.parametrize("path", ["avx2", pytest.param("avx512", marks=_AVX512)])
@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 48])  # 48: three chunks of 16 per block
# groups of 8, 1, 4, 2, 3, 7 (the AVX-512 p * v is shared by groups of 2 to 8) and 12 (head by head)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(8, 1), (6, 6), (8, 2), (4, 2), (6, 2), (14, 2), (12, 1)]
)
def test_paged_decode_every_served_head_size_and_block_size(
    head_dim: int, block_size: int, num_heads: int, num_kv_heads: int, path: str
) -> None:
    gen = torch.Generator().manual_seed(head_dim + block_size)
    kv_lens = [1, 15, 16, 47, 48, 49, 130]
    inputs = _decode_inputs(
        gen,
        kv_lens,
        num_heads,
        num_kv_heads,
        torch.bfloat16,
        head_dim=head_dim,
        block_size=block_size,
    )
    _check_decode(inputs, 0, path, 1e-2)
    _check_decode(inputs, 20, path, 1e-2)


@requires_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", [3, 4])
def test_paged_decode_rows_do_not_depend_on_the_batch(path: str, group: int) -> None:
    """A sequence's output is bit-identical alone and among others (which change how the work is
    split into tasks): seeded sampling must not depend on what else is in the step."""
    gen = torch.Generator().manual_seed(11)
    kv_lens = [37, 1, 200, 64, 5, 90, 16, 130, 77, 3, 150, 48, 20, 99, 31, 60, 8]
    query, k_cache, v_cache, tables, lens = _decode_inputs(
        gen, kv_lens, 4 * group, 4, torch.bfloat16
    )
    batch = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, 0, path)
    for b in (0, 2, 7):
        alone = cpu_ops.paged_decode_attention(
            query[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], 0.125, 0, path
        )
        assert torch.equal(alone[0], batch[b])


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [12, 48])  # not whole lines: "auto" takes the avx2 kernel
def test_paged_decode_handles_head_dim_tail(head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    inputs = _decode_inputs(gen, [7, 33], 4, 2, dtype, head_dim=head_dim, block_size=4)
    _check_decode(inputs, 0, "auto", 1e-2 if dtype == torch.bfloat16 else 1e-5)


@requires_kernels
@pytest.mark.parametrize(
    ("dtype", "head_dim", "path", "message"),
    [
        (
            torch.float32,
            64,
            "avx512",
            "path 'avx512' needs bf16, a CPU with AVX512_BF16 and a "
            "head size that is a multiple of 32 up to 256, got Float and 64",
        ),
        (torch.bfloat16, 48, "avx512", "got BFloat16 and 48"),
        (torch.bfloat16, 64, "sse", r"unknown path 'sse' \(auto, avx2, avx512\)"),
    ],
)
def test_paged_decode_refuses_a_path_it_cannot_take(
    dtype: torch.dtype, head_dim: int, path: str, message: str
) -> None:
    cache = torch.randn(2, 4, 1, head_dim).to(dtype)
    query = torch.randn(1, 1, head_dim).to(dtype)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.paged_decode_attention(
            query, cache, cache, torch.tensor([[1]]), torch.tensor([3]), 1.0, 0, path
        )


@requires_kernels
def test_paged_decode_rejects_block_ids_outside_the_cache() -> None:
    cache = torch.randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.paged_decode_attention(
            torch.randn(1, 1, 8), cache, cache, torch.tensor([[0, 2]]), torch.tensor([6]), 1.0, 0
        )


@requires_kernels
def test_paged_decode_rejects_kv_len_beyond_the_table() -> None:
    cache = torch.randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="kv_lens"):
        cpu_ops.paged_decode_attention(
            torch.randn(1, 1, 8), cache, cache, torch.tensor([[0]]), torch.tensor([5]), 1.0, 0
        )


@requires_kernels
@pytest.mark.parametrize("path", PATHS)
def test_paged_decode_reads_query_heads_out_of_the_fused_qkv_rows(path: str) -> None:
    """The model passes q as a view of its qkv activation (rows 2304 apart): same result as a
    contiguous copy, and a contiguous output."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(9, 16, 4, 64, generator=gen).bfloat16()
    v_cache = torch.randn(9, 16, 4, 64, generator=gen).bfloat16()
    qkv = torch.randn(3, (12 + 2 * 4) * 64, generator=gen).bfloat16()
    query = qkv[:, : 12 * 64].reshape(3, 12, 64)
    assert not query.is_contiguous()
    tables, lens = torch.tensor([[1, 2], [3, 0], [8, 5]]), torch.tensor([20, 7, 32])
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, 0, path)
    copied = cpu_ops.paged_decode_attention(
        query.contiguous(), k_cache, v_cache, tables, lens, 0.125, 0, path
    )
    assert out.is_contiguous()
    assert torch.equal(out, copied)
    strided_heads = query.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        cpu_ops.paged_decode_attention(strided_heads, k_cache, v_cache, tables, lens, 0.125, 0)
