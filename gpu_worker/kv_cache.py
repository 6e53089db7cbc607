"""The paged KV cache tensors and how many blocks fit in a memory budget."""

from __future__ import annotations

import torch

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.models.decoder import KVCache


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for `block_size` tokens."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
    if num_blocks < 2:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
            f"{block_size} tokens; at least 2 are needed (block 0 is reserved)"
        )
    return int(num_blocks)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]
