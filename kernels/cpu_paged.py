"""CPU backend: the torch backend, with decode (single-query) attention done by the CPU kernels
(AVX-512 bf16 where the CPU has it, else AVX2) that read K/V straight through the block table
instead of gathering a padded copy, and the KV write done by one op. The query the kernels get
may be a view of the fused qkv: no copy. On AVX512_BF16 CPUs bf16 prefill chunks go to the
AVX-512 prefill kernel or to the torch backend's gather + SDPA, whichever `choose_kernels`
measured faster for the chunk's length on this CPU (the AVX-512 kernel was 3-6x SDPA on a Zen 4
EPYC at 512-2,048 tokens; on an AMX Xeon SDPA was ~2x it); other dtypes, CPUs and head sizes
take the torch backend's path."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from tgq.kernels import cpu_ops
from tgq.kernels.choice import Choices, choose, measure
from tgq.kernels.torch_paged import MultiQuery, TorchMetadata, TorchPagedAttention, attend_multi

# Prompt chunk lengths the prefill kernels are timed at (kernels.choice).
PREFILL_BUCKETS = (16, 64, 256, 1024, 4096)


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_ops.is_available():
            raise RuntimeError(
                f"attention backend 'cpu' is unavailable: {cpu_ops.unavailable_reason()}"
            )
        self.prefill_choices: Choices | None = None  # None: the AVX-512 kernel where it serves

    def choose_kernels(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> Choices | None:
        """Times the prefill kernels for this model's heads at each of `PREFILL_BUCKETS` (a
        whole prompt of that length, causal) and keeps the choices; None where the AVX-512
        kernel cannot serve the shape (torch's path is then the only one)."""
        if not cpu_ops.avx512_attention_serves(dtype, head_dim):
            return None
        block_size = 16
        gen = torch.Generator().manual_seed(0)

        def case(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MultiQuery]:
            blocks = -(-tokens // block_size)
            cache_shape = (blocks, block_size, num_kv_heads, head_dim)
            k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
            v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
            query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
            return query, k_cache, v_cache, MultiQuery(0, tokens, tokens, torch.randperm(blocks))

        scale = head_dim**-0.5

        def own(tokens: int) -> Callable[[], object]:
            q, k, v, seq = case(tokens)
            return lambda: cpu_ops.paged_prefill_attention(
                q, k, v, seq.block_ids, seq.kv_len, scale, 0
            )

        def sdpa(tokens: int) -> Callable[[], object]:
            q, k, v, seq = case(tokens)
            return lambda: attend_multi(q, k, v, seq, scale, None)

        shapes = {"prefill_attention": [num_heads, num_kv_heads, head_dim, str(dtype)]}
        self.prefill_choices = choose(
            shapes,
            lambda: measure("prefill_attention", {"avx512": own, "torch": sdpa}, PREFILL_BUCKETS),
        )
        return self.prefill_choices

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
        torch_picked = (
            self.prefill_choices is not None
            and self.prefill_choices.pick("prefill_attention", seq.query_len) == "torch"
        )
        if (
            torch_picked
            or k_cache.dtype != query.dtype
            or not cpu_ops.avx512_attention_serves(query.dtype, query.shape[-1])
        ):
            return super()._attend_multi(query, k_cache, v_cache, seq, scale, sliding_window)
        return cpu_ops.paged_prefill_attention(
            query, k_cache, v_cache, seq.block_ids, seq.kv_len, scale, sliding_window or 0
        )
