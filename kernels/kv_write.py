"""The KV-write op shared by backends: scatter new K/V rows into their cache slots, converted to
the cache's element type (FP8 E4M3: `--kv-cache-dtype fp8`; E5M2: `fp8_e5m2`)."""

from __future__ import annotations

import torch

# Caches of one byte a value, and each one's largest finite value (what larger values saturate to).
FP8_LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_CACHE_DTYPES = tuple(FP8_LARGEST)


def to_fp8(
    x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """x / scale in fp32, saturated to the format's largest value (448 for E4M3, 57344 for
    E5M2), to the nearest value of `dtype` (ties to even): what an FP8 cache stores for x (it
    stands for the stored value times `scale`)."""
    scaled = x.float() / scale if scale != 1.0 else x.float()
    largest = FP8_LARGEST[dtype]
    return scaled.clamp(-largest, largest).to(dtype)


def write_kv_slots(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block_id * block_size + offset
    k_scale: float = 1.0,  # FP8 caches: what a stored value stands for is it times its scale
    v_scale: float = 1.0,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    if (fp8 := k_cache.dtype) in FP8_CACHE_DTYPES:  # torch has no fp8 index_copy_: move bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key = to_fp8(key, k_scale, fp8).view(torch.uint8)
        value = to_fp8(value, v_scale, fp8).view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
