"""FP8 E5M2 KV caches (`--kv-cache-dtype fp8_e5m2`), as tests/kernels/test_kv_fp8.py checks E4M3:
write_kv_ stores torch's E5M2 bytes bit for bit (saturated to +-57344); the decode kernels (AVX2
and AVX-512) and the prefill kernels read them as they read `cache.to(bfloat16)`, bit for bit at
unit and power-of-two scales (every E5M2 value is a bf16 value). Every byte's decoding:
test_kv_fp8.py's `test_decode_decodes_every_byte_exactly`."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tests.kernels.test_kv_fp8 import (
    _DECODES_FP8,
    _PREFILL_KERNELS,
    KV_LENS,
    _decode,
    _decode_inputs,
    _prefill,
)
from tgq.kernels import cpu_ops

E5M2 = torch.float8_e5m2
LARGEST = 57344.0

pytestmark = requires_kernels


def _quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-LARGEST, LARGEST).to(E5M2)


def _values(gen: torch.Generator, size: int) -> torch.Tensor:
    """Every finite bf16 value, E5M2's edges (saturation, ties, subnormals, NaN), then random
    values of every magnitude it holds and more."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    sub = 2.0**-16  # the smallest E5M2 subnormal
    edges = [57344.0, -57344.0, 61439.0, 61440.0, 1e6, float("inf"), float("-inf"), float("nan")]
    edges += [m * sub / 2 for m in range(-9, 10)] + [2.0**-14, 1.125, 1.375, -1.125, 1e-40]
    magnitude = torch.exp2(torch.randint(-20, 18, (size,), generator=gen).float())
    random = torch.randn(size, generator=gen) * magnitude
    return torch.cat([torch.tensor(edges), every[torch.isfinite(every)], random])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-5])
def test_write_kv_stores_torchs_e5m2_bytes(dtype: torch.dtype, scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 100))
    values = _values(gen, 20_000)
    values = values[: values.numel() // 56 * 56]  # rows of 2 heads of 28: vector and tail
    key = values.to(dtype).reshape(-1, 2, 28)
    tokens = key.shape[0]
    k_cache = torch.zeros(tokens, 1, 2, 28, dtype=E5M2)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(tokens, generator=gen)
    cpu_ops.write_kv_(k_cache, v_cache, key, -key, slots, k_scale=scale, v_scale=scale)
    assert torch.equal(
        k_cache.view(tokens, 2, 28)[slots].view(torch.uint8),
        _quantized(key, scale).view(torch.uint8),
    )
    assert torch.equal(
        v_cache.view(tokens, 2, 28)[slots].view(torch.uint8),
        _quantized(-key, scale).view(torch.uint8),
    )


def _e5m2(caches: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return caches[0].float().to(E5M2), caches[1].float().to(E5M2)


@pytest.mark.parametrize("path", ["avx2", pytest.param("avx512", marks=_DECODES_FP8)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(12, 4), (8, 1), (14, 2)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (37, 0.0), (20, 2.0)])
def test_decode_reads_e5m2_as_it_reads_the_converted_cache(
    path: str, head_dim: int, heads: tuple[int, int], window: int, softcap: float
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 31 + heads[0] * 7 + heads[1] + window)
    inputs = _decode_inputs(gen, KV_LENS, heads, head_dim)
    e5m2 = _e5m2((inputs[1], inputs[2]))
    bf16 = (e5m2[0].bfloat16(), e5m2[1].bfloat16())
    out = _decode(inputs, e5m2, path, window=window, softcap=softcap)
    assert torch.equal(out, _decode(inputs, bf16, path, window=window, softcap=softcap))
    scaled = (bf16[0] * 0.25, bf16[1] * 8.0)
    out = _decode(inputs, e5m2, path, window=window, softcap=softcap, k_scale=0.25, v_scale=8.0)
    assert torch.equal(out, _decode(inputs, scaled, path, window=window, softcap=softcap))


@_DECODES_FP8
@pytest.mark.parametrize("kernel", _PREFILL_KERNELS)
@pytest.mark.parametrize(("num_queries", "kv_len", "window"), [(37, 37, 0), (50, 70, 23)])
def test_prefill_reads_e5m2_as_it_reads_the_converted_cache(
    kernel: str, num_queries: int, kv_len: int, window: int
) -> None:
    gen = torch.Generator().manual_seed(kv_len)
    used = (kv_len + 15) // 16
    inputs = _decode_inputs(gen, [used * 16 + 48], (12, 4), 64)
    e5m2 = _e5m2((inputs[1], inputs[2]))
    bf16 = (e5m2[0].bfloat16(), e5m2[1].bfloat16())
    block_ids = torch.randperm(e5m2[0].shape[0], generator=gen)[:used]
    query = torch.randn(num_queries, 12, 64, generator=gen).bfloat16()
    out = _prefill(query, e5m2, block_ids, kv_len, window, kernel)
    assert torch.equal(out, _prefill(query, bf16, block_ids, kv_len, window, kernel))
    scaled = (bf16[0] * 4.0, bf16[1] * 0.125)
    out = _prefill(query, e5m2, block_ids, kv_len, window, kernel, k_scale=4.0, v_scale=0.125)
    assert torch.equal(out, _prefill(query, scaled, block_ids, kv_len, window, kernel))
