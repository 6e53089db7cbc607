"""paged_prefill_attention (the AVX-512 and AMX bf16 prefill kernels) against the torch backend's
oracle."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tests.kernels.numerics import rel_err
from tgq.kernels import AttentionStep, SeqSpan, cpu_ops
from tgq.kernels.cpu_paged import CpuPagedAttention
from tgq.kernels.torch_paged import MultiQuery, TorchPagedAttention, attend_multi

pytestmark = [
    requires_kernels,
    pytest.mark.skipif(
        not cpu_ops.has_avx512_bf16(), reason="this CPU lacks AVX512_BF16 (the prefill kernel)"
    ),
]

# The kernels this CPU runs: AVX-512 wherever these tests run, AMX where the CPU has it.
KERNELS = [
    "avx512",
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            not cpu_ops.has_amx_bf16(), reason="this CPU lacks AMX-BF16 (or Linux refuses it)"
        ),
    ),
]


def _sequence(
    gen: torch.Generator,
    num_queries: int,
    kv_len: int,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # query, caches, block ids
    num_heads, num_kv_heads = heads
    used = (kv_len + block_size - 1) // block_size
    num_blocks = used + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()  # other blocks: noise
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    block_ids = torch.randperm(num_blocks, generator=gen)[:used]
    query = torch.randn(num_queries, num_heads, head_dim, generator=gen).bfloat16()
    return query, k_cache, v_cache, block_ids


def _check(
    gen: torch.Generator,
    num_queries: int,
    kv_len: int,
    heads: tuple[int, int],
    head_dim: int,
    window: int,
    block_size: int = 16,
    kernel: str = "avx512",
) -> None:
    query, k_cache, v_cache, block_ids = _sequence(
        gen, num_queries, kv_len, heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    out = cpu_ops.paged_prefill_attention(
        query, k_cache, v_cache, block_ids, kv_len, scale, window, kernel
    )
    seq = MultiQuery(0, num_queries, kv_len, block_ids)
    ref = attend_multi(query.float(), k_cache.float(), v_cache.float(), seq, scale, window or None)
    assert out.dtype == torch.bfloat16
    assert out.shape == query.shape
    assert rel_err(out, ref) < 1e-2


# (queries, kv_len): a whole prompt shorter than a tile, one tile, tiles with a partial last one,
# and chunks after a cached prefix (one of them a single query); 70 / 97 and 33: key counts past
# a step of 32 keys (AMX) by an odd chunk and less.
SHAPES = [(5, 5), (16, 16), (40, 40), (17, 60), (1, 33), (100, 130), (70, 97)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 7, 50])
def test_prefill_matches_the_torch_oracle(
    head_dim: int, heads: tuple[int, int], window: int, kernel: str
) -> None:
    gen = torch.Generator().manual_seed(head_dim + window)
    for num_queries, kv_len in SHAPES:
        _check(gen, num_queries, kv_len, heads, head_dim, window, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [0, 300])
def test_prefill_of_a_short_chunk_after_a_long_prefix(kernel: str, window: int) -> None:
    """The AMX kernel's two ways through (prefill_avx512.cpp): the keys streamed once for up to
    8 tiles per kv head, a copy of them per call for more; either side of that line, and a chunk
    after 2,048 cached tokens."""
    gen = torch.Generator().manual_seed(window)
    for num_queries, kv_len, heads in [
        (128, 640, (12, 12)),  # 8 tiles per kv head: streamed
        (129, 641, (12, 12)),  # 9: copied
        (32, 2080, (12, 12)),
        (32, 2080, (12, 4)),  # 6
        (48, 2096, (12, 4)),  # 9
        (20, 2068, (4, 1)),  # one kv head: copied (one thread would have all the work)
    ]:
        _check(gen, num_queries, kv_len, heads, 64, window, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [4, 8, 48])  # blocks smaller and larger than a chunk of 16
def test_prefill_reads_any_block_size(block_size: int, kernel: str) -> None:
    gen = torch.Generator().manual_seed(block_size)
    _check(gen, 37, 90, (6, 2), 64, 0, block_size, kernel)
    _check(gen, 37, 90, (6, 2), 64, 20, block_size, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_reads_query_heads_out_of_the_fused_qkv_rows(kernel: str) -> None:
    gen = torch.Generator().manual_seed(5)
    _, k_cache, v_cache, block_ids = _sequence(gen, 20, 40, (8, 2), 64)
    qkv = torch.randn(20, (8 + 2 * 2) * 64, generator=gen).bfloat16()
    query = qkv[:, : 8 * 64].reshape(20, 8, 64)
    assert not query.is_contiguous()
    out = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, block_ids, 40, 0.125, 0, kernel)
    copied = cpu_ops.paged_prefill_attention(
        query.contiguous(), k_cache, v_cache, block_ids, 40, 0.125, 0, kernel
    )
    assert torch.equal(out, copied)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_long_prompt_on_each_kernel(kernel: str) -> None:
    """A 600-token prompt with a 100-token window: many steps of keys, most tiles skipping the
    keys before their window."""
    gen = torch.Generator().manual_seed(600)
    _check(gen, 600, 600, (12, 4), 64, 0, kernel=kernel)
    _check(gen, 600, 600, (12, 4), 64, 100, kernel=kernel)


def test_the_cpu_backend_sends_bf16_prefill_chunks_to_the_kernel() -> None:
    """A mixed step (two decodes, a fresh prompt, a chunk after a cached prefix) through the CPU
    backend agrees with the torch backend on the same bf16 cache."""
    gen = torch.Generator().manual_seed(9)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    spans = [
        SeqSpan(1, 20, [1, 2]),
        SeqSpan(1, 7, [3]),
        SeqSpan(30, 30, [4, 5]),
        SeqSpan(9, 50, [6, 7, 8, 9]),
    ]
    slots = [
        s.block_ids[pos // block_size] * block_size + pos % block_size
        for s in spans
        for pos in range(s.kv_len - s.query_len, s.kv_len)
    ]
    step = AttentionStep(spans, slots, block_size)
    shape = (10, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    query = torch.randn(len(slots), 8, head_dim, generator=gen).bfloat16()
    outs = []
    for backend in (TorchPagedAttention(), CpuPagedAttention()):
        meta = backend.prepare(step, torch.device("cpu"))
        outs.append(backend.attend(query, k_cache, v_cache, meta, scale=0.125, sliding_window=None))
    assert rel_err(outs[1], outs[0].float()) < 1e-2


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_ids", "kv_len", "window", "message"),
    [
        (torch.bfloat16, 64, [2, 1], 4, 0, r"5 queries must be in \[1, kv_len = 4\]"),
        (torch.bfloat16, 64, [0], 20, 0, "block_ids must be int64 on the CPU with at least 2"),
        (torch.bfloat16, 64, [0, 9], 20, 0, r"block_ids\[1\] = 9 is outside the cache's 4 blocks"),
        (torch.float32, 64, [2, 1], 20, 0, r"query must be a \[Q, H, D\] bf16 CPU tensor"),
        (torch.bfloat16, 48, [2, 1], 20, 0, "head size must be a multiple of 32 up to 256, got 48"),
        (torch.bfloat16, 64, [2, 1], 20, -1, "sliding_window must be >= 0"),
    ],
)
def test_prefill_refuses_bad_inputs(
    dtype: torch.dtype, head_dim: int, block_ids: list[int], kv_len: int, window: int, message: str
) -> None:
    cache = torch.randn(4, 16, 1, head_dim).bfloat16()
    query = torch.randn(5, 2, head_dim).to(dtype)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.paged_prefill_attention(
            query, cache, cache, torch.tensor(block_ids), kv_len, 1.0, window
        )


def test_the_kernels_serve_bf16_with_whole_lines_of_head_size_up_to_256() -> None:
    assert cpu_ops.avx512_attention_serves(torch.bfloat16, 64)
    assert cpu_ops.avx512_attention_serves(torch.bfloat16, 256)
    assert not cpu_ops.avx512_attention_serves(torch.float32, 64)
    assert not cpu_ops.avx512_attention_serves(torch.bfloat16, 48)
    assert not cpu_ops.avx512_attention_serves(torch.bfloat16, 288)


def test_prefill_refuses_an_unknown_kernel_and_amx_where_it_cannot_run() -> None:
    cache = torch.randn(4, 16, 1, 64).bfloat16()
    query, block_ids = torch.randn(5, 2, 64).bfloat16(), torch.tensor([2, 1])
    with pytest.raises(RuntimeError, match=r"unknown kernel 'sse' \(avx512, amx\)"):
        cpu_ops.paged_prefill_attention(query, cache, cache, block_ids, 20, 1.0, 0, "sse")
    if not cpu_ops.has_amx_bf16():
        with pytest.raises(RuntimeError, match="kernel 'amx' needs a CPU with AMX-BF16"):
            cpu_ops.paged_prefill_attention(query, cache, cache, block_ids, 20, 1.0, 0, "amx")
