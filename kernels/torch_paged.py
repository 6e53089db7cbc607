"""Pure-PyTorch paged attention: runs anywhere, and is the oracle the other backends are tested
against.

Single-query sequences (decode, or one-token prefill chunks) are batched into one SDPA call over
their gathered blocks; multi-query sequences (prefill chunks, possibly after cached prefix blocks)
run one SDPA call each, with a causal mask offset by the cached prefix. Prefill is compute-bound,
so that per-sequence loop costs nothing next to the attention itself, while padding ragged prompts
into one call would waste compute on the padding.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgq.kernels.interface import UNIT_SCALES, AttentionStep, KvScales
from tgq.kernels.kv_write import FP8_CACHE_DTYPES, write_kv_slots


@dataclass(frozen=True, slots=True)
class MultiQuery:
    query_start: int
    query_len: int
    kv_len: int
    block_ids: torch.Tensor  # [num_blocks_used] int64


@dataclass(frozen=True, slots=True)
class TorchMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_single: int
    single_block_tables: torch.Tensor  # [num_single, max_blocks] int64, padded with block 0
    single_kv_lens: torch.Tensor  # [num_single] int64
    multi: list[MultiQuery]


def _blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, num_kv_heads, head_dim] in
    `dtype` (an FP8 cache's values converted: exact, every E4M3 value is a bf16 value)."""
    ids = block_ids.reshape(-1)
    if cache.dtype in FP8_CACHE_DTYPES:  # torch has no fp8 index_select: move the bytes
        gathered = cache.view(torch.uint8).index_select(0, ids).view(cache.dtype).to(dtype)
    else:
        gathered = cache.index_select(0, ids)
    return gathered.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def softcapped_attention(
    query: torch.Tensor,  # [..., H, Q, D]
    keys: torch.Tensor,  # [..., Hkv, L, D]
    values: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcast to [..., H, Q, L]: True where a query sees a key
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [..., H, Q, D]
    """Attention with soft-capped scores (Gemma 2): cap * tanh(q.k * scale / cap), then the mask
    and a softmax in fp32, as the reference's eager attention computes it. SDPA has no cap."""
    group = query.shape[-3] // keys.shape[-3]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)


def attend_multi(
    query: torch.Tensor,  # [Q, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: MultiQuery,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    kv_scales: KvScales = UNIT_SCALES,
) -> torch.Tensor:
    """One multi-query sequence's attention. An FP8 cache's scales as the kernels apply them:
    the keys' folded into the score scale, the values' onto the output."""
    scale *= kv_scales.k
    keys = _gather(k_cache, seq.block_ids, query.dtype)[: seq.kv_len].transpose(0, 1)  # [Hkv, L, D]
    values = _gather(v_cache, seq.block_ids, query.dtype)[: seq.kv_len].transpose(0, 1)
    mask = None
    # A whole prompt with no window is plain causal attention: `is_causal` lets the flash kernel
    # skip the blocks above the diagonal, which an explicit mask does not (same values; a 2,048-
    # token prompt's attention measured 77 -> 46 ms). After cached prefix blocks, torch's
    # `is_causal` would align the mask to the wrong corner, so the mask stays explicit there.
    is_causal = (
        seq.kv_len == seq.query_len
        and (sliding_window is None or sliding_window >= seq.kv_len)
        and softcap is None
    )
    if not is_causal:
        query_pos = torch.arange(seq.kv_len - seq.query_len, seq.kv_len, device=query.device)
        key_pos = torch.arange(seq.kv_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [Q, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    if softcap is not None:
        assert mask is not None
        out = softcapped_attention(query.transpose(0, 1), keys, values, mask, scale, softcap)
        return _times_v_scale(out.transpose(0, 1), kv_scales)
    # A leading batch axis of 1: on CPU, torch takes its flash kernel only for 4-D inputs (3-D ones
    # run the unfused math path, measured 2-3x slower on a 512-token prompt).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=True,
    )
    return _times_v_scale(out[0].transpose(0, 1), kv_scales)


def _times_v_scale(out: torch.Tensor, kv_scales: KvScales) -> torch.Tensor:
    return out if kv_scales.v == 1.0 else out * kv_scales.v


class TorchPagedAttention:
    name = "torch"
    fp8_kv = True  # stores and reads FP8 caches, E4M3 or E5M2 (`--kv-cache-dtype`)

    def prepare(self, step: AttentionStep, device: torch.device) -> TorchMetadata:
        num_single = step.num_single
        singles = step.spans[:num_single]
        counts = [_blocks_needed(s.kv_len, step.block_size) for s in singles]
        max_blocks = max(counts, default=0)
        # One tensor from padded lists: a row at a time was an indexed copy per sequence.
        rows = [
            [*s.block_ids[:n], *[0] * (max_blocks - n)]
            for s, n in zip(singles, counts, strict=True)
        ]
        table = torch.tensor(rows, dtype=torch.int64).view(num_single, max_blocks)
        multi = []
        query_start = num_single
        for span in step.spans[num_single:]:
            used = _blocks_needed(span.kv_len, step.block_size)
            block_ids = torch.tensor(span.block_ids[:used], dtype=torch.int64, device=device)
            multi.append(MultiQuery(query_start, span.query_len, span.kv_len, block_ids))
            query_start += span.query_len
        return TorchMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
            num_single=num_single,
            single_block_tables=table.to(device),
            single_kv_lens=torch.tensor([s.kv_len for s in singles], device=device),
            multi=multi,
        )

    def replay_key(self, meta: TorchMetadata) -> Hashable | None:
        """What this backend's ops for a step depend on beyond the metadata's tensors, where
        nothing but that (kernels.replay): None here, as the gathered blocks' shape varies."""
        return None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: TorchMetadata,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> None:
        write_kv_slots(k_cache, v_cache, key, value, meta.slot_mapping, kv_scales.k, kv_scales.v)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> torch.Tensor:
        args = (scale, sliding_window, softcap, kv_scales)
        if meta.num_single and not meta.multi:  # decode only: that output is the whole output
            return self._attend_single(query, k_cache, v_cache, meta, *args)
        out = torch.empty_like(query)
        if meta.num_single:
            out[: meta.num_single] = self._attend_single(
                query[: meta.num_single], k_cache, v_cache, meta, *args
            )
        for seq in meta.multi:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._attend_multi(query[rows], k_cache, v_cache, seq, *args)
        return out

    # One multi-query sequence's attention; a backend with a faster kernel overrides it.
    _attend_multi = staticmethod(attend_multi)

    def _attend_single(
        self,
        query: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> torch.Tensor:
        scale *= kv_scales.k  # as attend_multi
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        tables = meta.single_block_tables
        keys = _gather(k_cache, tables, query.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        values = _gather(v_cache, tables, query.dtype).transpose(1, 2)
        key_pos = torch.arange(keys.shape[2], device=query.device)
        lens = meta.single_kv_lens[:, None]
        mask = key_pos[None, :] < lens  # [B, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > lens - 1 - sliding_window
        # One query per sequence: fold the query heads sharing a KV head into the query-length axis,
        # so GQA needs no repeated K/V.
        grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if softcap is not None:
            out = softcapped_attention(
                grouped, keys, values, mask[:, None, None, :], scale, softcap
            )
        else:
            out = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale
            )
        return _times_v_scale(out.reshape(num_seqs, num_heads, head_dim), kv_scales)
