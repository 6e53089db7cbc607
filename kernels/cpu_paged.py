"""CPU backend: the torch backend, with decode (single-query) attention done by the CPU kernels
(AVX-512 bf16 where the CPU has it, else AVX2) that read K/V straight through the block table
instead of gathering a padded copy, and the KV write done by one op. The query the kernels get
may be a view of the fused qkv: no copy. On AVX512_BF16 CPUs bf16 prefill chunks go to the
AVX-512 prefill kernel too. Where `choose_kernels` measured the torch backend's gather + SDPA
faster on this CPU, for a prefill chunk's length or a decode step's batch size, that runs
instead (the AVX-512 prefill kernel was 3-6x SDPA on a Zen 4 EPYC at 512-2,048 tokens; on an
AMX Xeon SDPA was ~2x it from 256 tokens). Other dtypes, CPUs and head sizes take the torch
backend's path."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from tgq.kernels import cpu_ops
from tgq.kernels.choice import Choices, choose, measure
from tgq.kernels.interface import UNIT_SCALES, KvScales
from tgq.kernels.torch_paged import MultiQuery, TorchMetadata, TorchPagedAttention, attend_multi

# Prompt chunk lengths the prefill kernels are timed at, and decode batch sizes (at a context of
# DECODE_CONTEXT tokens) the decode kernels are (kernels.choice).
PREFILL_BUCKETS = (16, 64, 256, 1024, 2048, 4096)
DECODE_BUCKETS = (1, 16, 64, 256)
DECODE_CONTEXT = 512


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_ops.is_available():
            raise RuntimeError(
                f"attention backend 'cpu' is unavailable: {cpu_ops.unavailable_reason()}"
            )
        # Set by choose_kernels; None: the own kernels wherever they serve.
        self.prefill_choices: Choices | None = None
        self.decode_choices: Choices | None = None
        # An FP8 cache beside queries the own kernels cannot pair it with (`use_kv_dtype`):
        # every step on torch's path.
        self.kv_on_torch = False

    def use_kv_dtype(self, kv_dtype: torch.dtype, query_dtype: torch.dtype) -> None:
        """The KV cache's element type. An FP8 cache beside bf16 queries is read by the own
        kernels as it is (decode: AVX-512 or AVX2, `cpu_ops.fp8_kv_decode_path`; prefill: the
        AVX-512 kernel where `cpu_ops.fp8_kv_attention_serves`, else torch's gather, which
        converts); beside fp32 queries, by torch's path only."""
        self.kv_on_torch = query_dtype not in (kv_dtype, torch.bfloat16)

    def choose_kernels(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        """Times this backend's own path against the torch backend's gather + SDPA for this
        model's heads, on random inputs (`_Cases`), and keeps the choices: decode at each of
        `DECODE_BUCKETS` (sequences of `DECODE_CONTEXT` tokens), prefill at each of
        `PREFILL_BUCKETS` (a whole prompt of that length, causal) where the AVX-512 prefill
        kernel serves the shape. The choices are cleared first, so "own" times the own kernels."""
        self.decode_choices = self.prefill_choices = None
        cases = _Cases(num_heads, num_kv_heads, head_dim, dtype)
        scale = head_dim**-0.5

        def decode(attend: Callable[..., torch.Tensor]) -> Callable[[int], Callable[[], object]]:
            def make(batch: int) -> Callable[[], object]:
                q, k, v, meta = cases.decode(batch)
                return lambda: attend(self, q, k, v, meta, scale, None)

            return make

        def prefill(attend: Callable[..., torch.Tensor]) -> Callable[[int], Callable[[], object]]:
            def make(tokens: int) -> Callable[[], object]:
                q, k, v, seq = cases.prefill(tokens)
                return lambda: attend(self, q, k, v, seq, scale, None)

            return make

        heads = [num_heads, num_kv_heads, head_dim, str(dtype)]
        decode_candidates = {
            "own": decode(CpuPagedAttention._attend_single),
            "torch": decode(TorchPagedAttention._attend_single),
        }
        prefill_candidates = {
            kernel: prefill(_own_prefill(kernel)) for kernel in own_prefill_kernels()
        } | {"torch": prefill(lambda _, *args: attend_multi(*args))}
        decode_choices = choose(
            {"decode_attention": heads},
            lambda: measure("decode_attention", decode_candidates, DECODE_BUCKETS),
        )
        if cpu_ops.avx512_attention_serves(dtype, head_dim):
            self.prefill_choices = choose(
                {"prefill_attention": heads, "candidates": sorted(prefill_candidates)},
                lambda: measure("prefill_attention", prefill_candidates, PREFILL_BUCKETS),
            )
        self.decode_choices = decode_choices

    def _torch_decode(self, batch: int) -> bool:
        choices = self.decode_choices
        return choices is not None and choices.pick("decode_attention", batch) == "torch"

    def replay_key(self, meta: TorchMetadata) -> Hashable | None:
        """A decode-only step's ops depend on its row count only: the kernels read the block
        tables and lengths whatever their width (kernels.replay). Not where torch's gather +
        SDPA runs it: its ops' shapes follow the widest block table."""
        if not meta.num_single or meta.multi or self._torch_decode(meta.num_single):
            return None
        if self.kv_on_torch:
            return None
        return ("decode", meta.num_single)

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: TorchMetadata,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> None:
        cpu_ops.write_kv_(  # FP8: converted
            k_cache, v_cache, key, value, meta.slot_mapping, kv_scales.k, kv_scales.v
        )

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
        if self._torch_decode(query.shape[0]) or self.kv_on_torch:
            return super()._attend_single(
                query, k_cache, v_cache, meta, scale, sliding_window, softcap, kv_scales
            )
        return cpu_ops.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            meta.single_block_tables,
            meta.single_kv_lens,
            scale,
            sliding_window or 0,
            softcap=softcap or 0.0,
            k_scale=kv_scales.k,
            v_scale=kv_scales.v,
        )

    def _attend_multi(
        self,
        query: torch.Tensor,  # [Q, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: MultiQuery,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> torch.Tensor:
        kernel = "avx512"
        if self.prefill_choices is not None:
            kernel = self.prefill_choices.pick("prefill_attention", seq.query_len)
        head_dim = query.shape[-1]
        fp8 = k_cache.dtype != query.dtype
        if fp8 and kernel == "amx":  # the AMX kernel's FP8 reading has not run on hardware
            kernel = "avx512"
        if (
            kernel == "torch"
            or softcap is not None
            or not cpu_ops.avx512_attention_serves(query.dtype, head_dim)
            or (fp8 and not cpu_ops.fp8_kv_attention_serves(head_dim))
        ):
            return super()._attend_multi(
                query, k_cache, v_cache, seq, scale, sliding_window, softcap, kv_scales
            )
        return _own_prefill(kernel)(
            self, query, k_cache, v_cache, seq, scale, sliding_window, kv_scales
        )


def own_prefill_kernels() -> list[str]:
    """The own prefill kernels this CPU runs: AVX-512, and AMX where it has AMX-BF16."""
    return ["avx512", "amx"] if cpu_ops.has_amx_bf16() else ["avx512"]


def _own_prefill(kernel: str) -> Callable[..., torch.Tensor]:
    """One own prefill kernel as `_attend_multi` calls it (and `choose_kernels` times it)."""

    def attend(
        _: object,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: MultiQuery,
        scale: float,
        sliding_window: int | None,
        kv_scales: KvScales = UNIT_SCALES,
    ) -> torch.Tensor:
        return cpu_ops.paged_prefill_attention(
            query, k_cache, v_cache, seq.block_ids, seq.kv_len, scale, sliding_window or 0,
            kernel, k_scale=kv_scales.k, v_scale=kv_scales.v,
        )  # fmt: skip

    return attend


class _Cases:
    """Random inputs of one model's attention shape for `choose_kernels`, in a paged cache of
    16-token blocks in shuffled order."""

    block_size = 16

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.heads = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(0)

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.dtype)

    def _paged(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_kv_heads, head_dim = self.heads
        shape = (blocks, self.block_size, num_kv_heads, head_dim)
        return self._random(*shape), self._random(*shape)

    def decode(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TorchMetadata]:
        num_heads, _, head_dim = self.heads
        per_seq = -(-DECODE_CONTEXT // self.block_size)
        k_cache, v_cache = self._paged(batch * per_seq)
        meta = TorchMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64),
            num_single=batch,
            single_block_tables=torch.randperm(batch * per_seq).view(batch, per_seq),
            single_kv_lens=torch.full((batch,), DECODE_CONTEXT),
            multi=[],
        )
        return self._random(batch, num_heads, head_dim), k_cache, v_cache, meta

    def prefill(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MultiQuery]:
        num_heads, _, head_dim = self.heads
        blocks = -(-tokens // self.block_size)
        k_cache, v_cache = self._paged(blocks)
        seq = MultiQuery(0, tokens, tokens, torch.randperm(blocks))
        return self._random(tokens, num_heads, head_dim), k_cache, v_cache, seq
