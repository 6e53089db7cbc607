"""CPU backend: the torch backend, with decode (single-query) attention done by the AVX2 kernel
that reads K/V straight through the block table instead of gathering a padded copy, and the KV
write done by one op. A step of only decode tokens hands the query (a view of the fused qkv) to
the kernel and returns its output as is: no copy in or out."""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.torch_paged import TorchMetadata, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_ops.is_available():
            raise RuntimeError(
                f"attention backend 'cpu' is unavailable: {cpu_ops.unavailable_reason()}"
            )

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: TorchMetadata,
    ) -> None:
        cpu_ops.write_kv_(k_cache, v_cache, key, value, meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if meta.multi:
            return super().attend(
                query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
            )
        return self._attend_single(query, k_cache, v_cache, meta, scale, sliding_window)

    def _attend_single(
        self,
        query: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        return cpu_ops.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            meta.single_block_tables,
            meta.single_kv_lens,
            scale,
            sliding_window or 0,
        )
