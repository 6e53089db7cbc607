"""CPU backend: the torch backend, with decode (single-query) attention done by the CPU kernels
(AVX-512 bf16 where the CPU has it, else AVX2) that read K/V straight through the block table
instead of gathering a padded copy, and the KV write done by one op. The query the kernels get
may be a view of the fused qkv: no copy. On AVX512_BF16 CPUs bf16 prefill chunks go to the
AVX-512 prefill kernel too (3-6x torch's gather + SDPA, measured at 512-2,048 tokens); other
dtypes, CPUs and head sizes take the torch backend's path."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from tgq.kernels import cpu_ops
from tgq.kernels.torch_paged import MultiQuery, TorchMetadata, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_ops.is_available():
            raise RuntimeError(
                f"attention backend 'cpu' is unavailable: {cpu_ops.unavailable_reason()}"
            )

    def replay_key(self, meta: TorchMetadata) -> Hashable | None:
        """A decode-only step's ops depend on its row count only: the kernels read the block
        tables and lengths whatever their width (kernels.replay)."""
        return ("decode", meta.num_single) if meta.num_single and not meta.multi else None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: TorchMetadata,
    ) -> None:
        cpu_ops.write_kv_(k_cache, v_cache, key, value, meta.slot_mapping)

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

    def _attend_multi(
        self,
        query: torch.Tensor,  # [Q, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: MultiQuery,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if k_cache.dtype != query.dtype or not cpu_ops.avx512_attention_serves(
            query.dtype, query.shape[-1]
        ):
            return super()._attend_multi(query, k_cache, v_cache, seq, scale, sliding_window)
        return cpu_ops.paged_prefill_attention(
            query, k_cache, v_cache, seq.block_ids, seq.kv_len, scale, sliding_window or 0
        )
