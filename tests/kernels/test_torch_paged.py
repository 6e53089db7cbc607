"""The torch paged attention (the oracle) against a per-token reference written out longhand."""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tgq.kernels import AttentionStep, SeqSpan, get_backend
from tgq.kernels.torch_paged import TorchPagedAttention

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def reference(
    query: torch.Tensor,  # [Q, H, D] for one sequence
    keys: torch.Tensor,  # [L, Hkv, D] its whole context
    values: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    num_q, num_heads, head_dim = query.shape
    group = num_heads // keys.shape[1]
    out = torch.empty_like(query)
    for i in range(num_q):
        pos = keys.shape[0] - num_q + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            k, v = keys[lo : pos + 1, h // group], values[lo : pos + 1, h // group]
            weights = torch.softmax((k @ query[i, h]) / math.sqrt(head_dim), dim=0)
            out[i, h] = weights @ v
    return out


def build_step(
    query_lens: list[int], kv_lens: list[int], rng: random.Random
) -> tuple[AttentionStep, list[list[int]]]:
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous block tables
    spans, slots, tables = [], [], []
    for q_len, kv_len in zip(query_lens, kv_lens, strict=True):
        table = [free.pop() for _ in range(-(-kv_len // BLOCK_SIZE))]
        tables.append(table)
        spans.append(SeqSpan(q_len, kv_len, table))
        for pos in range(kv_len - q_len, kv_len):
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return AttentionStep(spans, slots, BLOCK_SIZE), tables


def check_step(
    query_lens: list[int],
    kv_lens: list[int],
    shape: tuple[int, int, int],  # num_heads, num_kv_heads, head_dim
    window: int | None,
    seed: int,
) -> None:
    """Write a step's K/V into a noise-filled cache, attend, compare every sequence."""
    num_heads, num_kv_heads, head_dim = shape
    step, tables = build_step(query_lens, kv_lens, random.Random(seed))
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)  # cached prefixes are noise
    v_cache = torch.randn(cache_shape, generator=gen)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)

    backend = TorchPagedAttention()
    meta = backend.prepare(step, torch.device("cpu"))
    backend.write_kv(k_cache, v_cache, key, value, meta)
    out = backend.attend(query, k_cache, v_cache, meta, scale=head_dim**-0.5, sliding_window=window)

    start = 0
    for q_len, kv_len, table in zip(query_lens, kv_lens, tables, strict=True):
        keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        torch.testing.assert_close(keys[kv_len - q_len :], key[start : start + q_len])
        expected = reference(query[start : start + q_len], keys, values, window)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_mixed_step_matches_reference(
    num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    # three decodes (one at kv_len 1), a fresh prefill, a prefill chunk after a cached prefix
    check_step([1, 1, 1, 9, 5], [1, 6, 13, 9, 14], (num_heads, num_kv_heads, 8), window, seed=0)


def test_single_query_spans_are_counted_from_the_front() -> None:
    step = AttentionStep([SeqSpan(3, 3, [1]), SeqSpan(1, 2, [2])], [4, 5, 6, 9], BLOCK_SIZE)
    assert step.num_single == 0  # a decode after a prefill is attended as a multi-query span
    step = AttentionStep([SeqSpan(1, 2, [2]), SeqSpan(3, 3, [1])], [9, 4, 5, 6], BLOCK_SIZE)
    assert step.num_single == 1


def test_registry_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; choose one of: auto"):
        get_backend("nope", torch.device("cpu"))
    from tgq.kernels import cpu_ops

    expected = "cpu" if cpu_ops.is_available() else "torch"
    assert get_backend("auto", torch.device("cpu")).name == expected


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None,
    reason="flash-attn is installed: the refusal cannot happen here",
)
def test_flash_refuses_clearly_without_flash_attn() -> None:
    with pytest.raises(RuntimeError, match="needs flash-attn on a CUDA machine"):
        get_backend("flash", torch.device("cpu"))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    num_seqs=st.integers(1, 5),
    window=st.one_of(st.none(), st.integers(1, 9)),
)
def test_any_step_matches_reference(data: st.DataObject, num_seqs: int, window: int | None) -> None:
    """Random mixes of decodes and prefill chunks, with random cached prefixes and tables."""
    kv_lens = data.draw(st.lists(st.integers(1, 30), min_size=num_seqs, max_size=num_seqs))
    query_lens = [data.draw(st.integers(1, kv)) for kv in kv_lens]
    order = sorted(range(num_seqs), key=lambda i: query_lens[i] != 1)  # single-query first
    query_lens, kv_lens = [query_lens[i] for i in order], [kv_lens[i] for i in order]
    check_step(query_lens, kv_lens, (4, 2, 8), window, seed=data.draw(st.integers(0, 2**16)))
