"""The attention interface every backend implements.

A step attends for a list of sequences, each with `query_len` new tokens whose K/V have just been
written into the paged cache, and `kv_len` tokens of context in the cache in total (cached prefix +
new tokens). Sequences with a single query token (decode, or a one-token prefill chunk) come first:
backends batch them in one call.

Cache layout, per layer: `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; token `i` of a sequence lives in block
`block_ids[i // block_size]` at offset `i % block_size`, i.e. in slot
`block_id * block_size + i % block_size` of the flattened cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:  # torch-free at import: configuration code reads `BlockSizeRule` without it
    import torch


@dataclass(frozen=True, slots=True)
class BlockSizeRule:
    """The KV block sizes a backend can read: multiples of `multiple`, `default` when the user
    names none."""

    default: int
    multiple: int = 1

    def check(self, backend: str, block_size: int) -> int:
        """`block_size`, or a ValueError that states the rule of `backend`."""
        if block_size < 1 or block_size % self.multiple:
            raise ValueError(
                f"attention backend {backend!r} needs a KV block size that is a multiple of"
                f" {self.multiple} (its default: {self.default}), got {block_size}"
            )
        return block_size


@dataclass(frozen=True, slots=True)
class SeqSpan:
    query_len: int  # new tokens of this sequence in the step
    kv_len: int  # context length after the step's KV write (prefix + new tokens)
    block_ids: Sequence[int]  # block table, at least ceil(kv_len / block_size) entries


@dataclass(frozen=True, slots=True)
class AttentionStep:
    """Backend-independent description of one step; `prepare` turns it into tensors once."""

    spans: Sequence[SeqSpan]  # single-query spans first
    slot_mapping: Sequence[int]  # one slot per new token, in token order
    block_size: int

    @property
    def num_single(self) -> int:
        count = 0
        for span in self.spans:
            if span.query_len != 1:
                break
            count += 1
        return count


@dataclass(frozen=True, slots=True)
class KvScales:
    """An FP8 cache's per-tensor scales for one layer: a stored byte stands for its E4M3 value
    times `k` (keys) or `v` (values); what is written is e4m3(x / scale). A checkpoint's
    calibrated scales (compressed-tensors `kv_cache_scheme`), else 1. Other caches take 1."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALES = KvScales()


class AttentionMetadata(Protocol):
    """Whatever tensors a backend precomputes from an `AttentionStep`; shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64


MetaT = TypeVar("MetaT", bound=AttentionMetadata)


class AttentionBackend(Protocol[MetaT]):
    """`MetaT` is the backend's own metadata type, made by `prepare` and read by the others."""

    name: str
    fp8_kv: bool  # whether it stores and reads FP8 caches (`--kv-cache-dtype fp8|fp8_e5m2`)

    def prepare(self, step: AttentionStep, device: torch.device) -> MetaT: ...

    def replay_key(self, meta: MetaT) -> Hashable | None:
        """Where this backend's ops for the step depend on nothing but the metadata's tensors
        and this key (hashable, shapes included), a step recorded with the same key may be
        replayed (kernels.replay); None where they depend on more."""
        ...

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: MetaT,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: MetaT,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
        kv_scales: KvScales = UNIT_SCALES,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
