"""flash-attn backend: one `flash_attn_varlen_func` call per layer over the paged cache.

flash-attn is an optional GPU extra (`pip install tgq[gpu]`); this module imports it lazily and
only on CUDA. Its paged mode reads K/V through a block table and requires the KV block size to be
a multiple of 256 (the rule in the registry, `tgq.kernels`). Causal masking with more keys than
queries is aligned bottom-right, which is exactly "new tokens come after the cached prefix".
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from tgq.kernels.interface import UNIT_SCALES, AttentionStep, KvScales
from tgq.kernels.kv_write import write_kv_slots


def is_flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen_func() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError(
            "attention backend 'flash' needs flash-attn on a CUDA machine: pip install 'tgq[gpu]'"
        ) from exc
    return flash_attn_varlen_func


@dataclass(frozen=True, slots=True)
class FlashMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32


class FlashAttention:
    name = "flash"
    fp8_kv = False  # flash-attn reads caches of the query's dtype

    def __init__(self) -> None:
        self._varlen = _varlen_func()

    def prepare(self, step: AttentionStep, device: torch.device) -> FlashMetadata:
        query_lens = [span.query_len for span in step.spans]
        kv_lens = [span.kv_len for span in step.spans]
        max_blocks = max(-(-kv // step.block_size) for kv in kv_lens)
        table = torch.zeros((len(step.spans), max_blocks), dtype=torch.int32)
        for row, span in enumerate(step.spans):
            used = -(-span.kv_len // step.block_size)
            table[row, :used] = torch.tensor(span.block_ids[:used], dtype=torch.int32)
        return FlashMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
            cu_seqlens_q=_cumulative(query_lens, device),
            cu_seqlens_k=_cumulative(kv_lens, device),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(kv_lens),
            block_table=table.to(device),
        )

    def replay_key(self, meta: FlashMetadata) -> Hashable | None:
        """None: steps on the GPU are not replayed (kernels.replay)."""
        return None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: FlashMetadata,
        kv_scales: KvScales = UNIT_SCALES,  # caches of the query's dtype: always 1
    ) -> None:
        write_kv_slots(k_cache, v_cache, key, value, meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: FlashMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        kv_scales: KvScales = UNIT_SCALES,  # caches of the query's dtype: always 1
    ) -> torch.Tensor:
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        out: torch.Tensor = self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            softcap=softcap or 0.0,  # flash-attn's "no cap"
            block_table=meta.block_table,
        )
        return out


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    cumulative = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cumulative[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cumulative.to(device)
