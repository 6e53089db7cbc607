"""Benchmark the CPU kernels against torch in the same process, on 2 threads.

    python3 bench/bench_cpu_ops.py [--quick]

Linear: F.linear in bf16 (the baseline), F.linear in fp32 (weights pre-widened, not timed) and
each path of `linear_bf16` this CPU runs, for the model's projection shapes. GB/s is the bf16
weight bytes over the baseline's time; `read` is a plain fp32 sum over as many bytes, the
machine's streaming roofline right now. Weights that fit the L3 show cache, not DRAM, bandwidth at
M = 1. Decode attention: each `paged_decode_attention` kernel this CPU runs against gathering the
blocks and calling F.scaled_dot_product_attention, all bf16. Prefill attention: the torch
backend's gather + SDPA against the AVX-512 prefill kernel, one 512-token prompt. Greedy head:
the medium model's 32000 x 768 lm_head, full logits (packed kernel) + argmax against the int8
screen (`kernels.greedy_head`), at the decode batch sizes.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tgq.kernels import cpu_ops

LINEAR_SHAPES = [(2304, 768), (4096, 768), (768, 2048), (32000, 768)]  # (N, K)
BATCH_ROWS = [1, 16, 64, 512]
NUM_THREADS = 2


def time_ms(fn: Callable[[], object], budget_s: float) -> float:
    """Best of repeated calls after one warm-up; a call slower than the budget runs once.

    The minimum, not the median: on a shared 2-core machine a thread that loses its core stalls
    the whole parallel region for a scheduler tick, and that noise only ever adds time.
    """
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > budget_s:
        return first * 1e3
    best = first
    calls = 0
    deadline = time.perf_counter() + budget_s
    while calls < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        calls += 1
    return best * 1e3


def read_roofline_gbs(num_bytes: int) -> float:
    data = torch.ones(num_bytes // 4)
    return num_bytes / time_ms(data.sum, 0.5) / 1e6


def bench_linear(rows: list[int], budget_s: float) -> None:
    """Each path of linear_bf16 this CPU runs, as a speed-up over F.linear in bf16; "auto" is
    what the model uses (see kernels/csrc/linear_bf16.cpp for how it picks)."""
    gen = torch.Generator().manual_seed(0)
    paths = ["auto", "avx2", *(["avx512"] if cpu_ops.has_avx512_bf16() else [])]
    header = f"{'N':>6} {'K':>5} {'M':>4} | {'bf16 ms':>9} {'GB/s':>5} | {'fp32 x':>7}"
    print(header + "".join(f" | {path + ' ms':>10} {'x':>5}" for path in paths))
    for n, k in LINEAR_SHAPES:
        weight = torch.randn(n, k, generator=gen).bfloat16()
        weight32 = weight.float()
        gb = weight.numel() * weight.element_size() / 1e6  # per ms -> GB/s
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            x32 = x.float()
            base = time_ms(lambda: F.linear(x, weight), budget_s)  # noqa: B023
            fp32 = time_ms(lambda: F.linear(x32, weight32), budget_s)  # noqa: B023
            line = f"{n:>6} {k:>5} {m:>4} | {base:>9.3f} {gb / base:>5.1f} | {base / fp32:>7.1f}"
            for path in paths:
                ours = time_ms(
                    functools.partial(cpu_ops.linear_bf16, x, weight, None, path), budget_s
                )
                line += f" | {ours:>10.3f} {base / ours:>5.1f}"
            print(line, flush=True)
    print(f"read roofline: {read_roofline_gbs(32000 * 768 * 2):.1f} GB/s")


def gather_sdpa(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    batch, heads, dim = query.shape
    span = block_tables.shape[1] * k_cache.shape[1]
    keys = k_cache[block_tables].view(batch, span, heads, dim).transpose(1, 2)
    values = v_cache[block_tables].view(batch, span, heads, dim).transpose(1, 2)
    mask = torch.arange(span)[None, None, None, :] < kv_lens[:, None, None, None]
    out = F.scaled_dot_product_attention(query[:, :, None], keys, values, mask, scale=scale)
    return out[:, :, 0]


def bench_decode(budget_s: float) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads, dim, block_size = 64, 12, 64, 16
    kv_lens = torch.randint(380, 421, (batch,), generator=gen)
    max_blocks = (int(kv_lens.max()) + block_size - 1) // block_size
    num_blocks = batch * max_blocks
    shape = (num_blocks, block_size, heads, dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, max_blocks)
    query = torch.randn(batch, heads, dim, generator=gen).bfloat16()
    scale = dim**-0.5
    base = time_ms(
        lambda: gather_sdpa(query, k_cache, v_cache, block_tables, kv_lens, scale), budget_s
    )
    paths = ["avx2"] + (["avx512"] if cpu_ops.has_avx512_bf16() else [])
    gb = int(kv_lens.sum()) * heads * dim * 2 * 2 / 1e6  # K and V bytes read, per ms -> GB/s
    line = (
        f"decode attention B={batch} H={heads} D={dim} kv_len~400 bf16 | gather+sdpa"
        f" {base:.3f} ms {gb / base:.1f} GB/s"
    )
    for path in paths:
        ours = time_ms(
            functools.partial(
                cpu_ops.paged_decode_attention,
                query,
                k_cache,
                v_cache,
                block_tables,
                kv_lens,
                scale,
                0,
                path,
            ),
            budget_s,
        )
        line += f" | {path} {ours:.3f} ms {gb / ours:.1f} GB/s x{base / ours:.1f}"
    print(line)


def bench_prefill(budget_s: float) -> None:
    """One 512-token prompt's attention (12 heads x 64, bf16): the torch backend's gather + SDPA
    against the AVX-512 prefill kernel."""
    from tgq.kernels.torch_paged import MultiQuery, attend_multi

    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim, block_size = 512, 12, 64, 16
    num_blocks = tokens // block_size
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).bfloat16()
    block_ids = torch.randperm(num_blocks, generator=gen)
    query = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    seq = MultiQuery(0, tokens, tokens, block_ids)
    base = time_ms(
        functools.partial(attend_multi, query, k_cache, v_cache, seq, dim**-0.5, None), budget_s
    )
    line = f"prefill attention Q=L={tokens} H={heads} D={dim} bf16 | gather+sdpa {base:.3f} ms"
    if cpu_ops.has_avx512_bf16():
        ours = time_ms(
            functools.partial(
                cpu_ops.paged_prefill_attention,
                query,
                k_cache,
                v_cache,
                block_ids,
                tokens,
                dim**-0.5,
                0,
            ),
            budget_s,
        )
        line += f" | avx512 {ours:.3f} ms x{base / ours:.1f}"
    print(line)


def bench_greedy_head(rows: list[int], budget_s: float) -> None:
    """Greedy tokens over a random 32000 x 768 head: the full lm_head + argmax against the int8
    screen (which picks the same tokens): the packed kernel's head with AVX512_BF16 + VNNI,
    else the AVX2 kernel's, each row alone (what the model runs on this CPU)."""
    from tgq.kernels.greedy_head import GreedyHead, build_screen

    gen = torch.Generator().manual_seed(0)
    n, k = 32000, 768
    weight = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight) if cpu_ops.has_avx512_vnni_bf16() else None
    head = GreedyHead(packed, weight, build_screen(weight))
    for m in rows:
        x = torch.randn(m, k, generator=gen).bfloat16()

        def full(x: torch.Tensor = x) -> torch.Tensor:
            if packed is None:  # the model's head: the AVX2 kernel over the batch
                return cpu_ops.argmax(cpu_ops.linear_bf16(x, weight, None, "avx2", out_fp32=True))
            return cpu_ops.argmax(cpu_ops.linear_bf16_packed(x, packed, n, out_fp32=True))

        assert torch.equal(cpu_ops.argmax(head.full_logits(x)), head.argmax(x))
        base = time_ms(full, budget_s)
        ours = time_ms(functools.partial(head.argmax, x), budget_s)
        print(
            f"greedy head ({head.kernels[0]}) N={n} K={k} M={m:>2} | full + argmax {base:.3f} ms"
            f" | screened {ours:.3f} ms x{base / ours:.1f}"
        )


def bench_layer_linears(rows: list[int]) -> None:
    """The medium model's decoder layer: its four linears in the model's own packed layout, on
    every kernel this CPU can run (what `kernels.choice` times at load), and the pick."""
    from tgq.gpu_worker.layers.linear import Linear, measure_linears

    gen = torch.Generator().manual_seed(0)
    linears = []
    for n, k in [(2304, 768), (768, 768), (4096, 768), (768, 2048)]:
        linear = Linear(k, n, bias=False).bfloat16()
        linear.weight.data.copy_(torch.randn(n, k, generator=gen).bfloat16())
        linears.append(linear)
    for entry in measure_linears("linear", linears, rows, prune=float("inf")):
        times = " | ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(entry.timings_ms.items()))
        print(f"layer linears M={entry.rows:>4} | {times} | picked {entry.picked}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M in {1, 16} only, short budgets")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    if not cpu_ops.is_available():
        sys.exit(f"CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    budget_s = 0.2 if args.quick else 1.0
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"threads={torch.get_num_threads()} load average={load} (times: best of repeats)")
    bench_linear([1, 16] if args.quick else BATCH_ROWS, budget_s)
    bench_decode(budget_s)
    bench_prefill(budget_s)
    bench_greedy_head([1, 16] if args.quick else [1, 4, 16, 64], budget_s)
    bench_layer_linears([1, 16, 64] if args.quick else [1, 16, 64, 512, 2048])


if __name__ == "__main__":
    main()
