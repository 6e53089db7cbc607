"""Tensor parallelism: which slice of every weight and of the KV cache a rank holds, and the
collectives the sharded layers call (torch.distributed: NCCL on CUDA, gloo on CPU).

Megatron's split, as TGI and vLLM do it: q/k/v and gate/up are column-parallel (each rank
computes its heads and its part of the intermediate size), o_proj and down_proj row-parallel
(each rank's partial sums are all-reduced), the embedding and the LM head vocab-parallel (each
rank holds a contiguous range of the vocabulary; the LM head's logits are gathered to rank 0,
which samples). KV heads are split across ranks; when there are fewer KV heads than ranks, each
is replicated on `world_size // num_kv_heads` ranks. With one rank every collective is a no-op.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tgq.gpu_worker.config import ModelConfig

COLLECTIVE_TIMEOUT_S = 60.0  # a rank that stops answering fails the others' collectives
# The row-parallel linears (by attribute name): split along their input, partial sums all-reduced.
ROW_PARALLEL_LINEARS = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group; None with one rank

    @classmethod
    def from_env(cls, device: torch.device) -> TensorParallel:
        """Joins the group described by the torch.distributed contract (RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT); NCCL on CUDA, gloo otherwise."""
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size == 1:
            return cls()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
        return cls(rank, world_size, dist.group.WORLD)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # --- what this rank holds ------------------------------------------------------------------

    def check(self, config: ModelConfig) -> None:
        """The shapes this split needs, with a message naming the one that does not divide."""
        world, heads, kv_heads = self.world_size, config.num_heads, config.num_kv_heads
        if heads % world:
            raise ValueError(f"{heads} attention heads do not split across {world} ranks")
        if kv_heads % world and world % kv_heads:
            raise ValueError(
                f"{kv_heads} KV heads neither split across {world} ranks nor replicate evenly"
            )
        sizes = {
            "intermediate size": config.intermediate_size,
            "expert intermediate size": config.moe_intermediate_size if config.num_experts else 0,
            "shared expert intermediate size": config.shared_expert_intermediate_size or 0,
        }
        for what, size in sizes.items():
            if size % world:
                raise ValueError(f"{what} {size} does not split across {world} ranks")

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as one rank sees it: its heads, KV heads, intermediate sizes (dense, each
        expert's, the shared expert's) and vocabulary range (`hidden_size`, `head_dim` and the
        layer count are the whole model's)."""
        if self.world_size == 1:
            return config
        self.check(config)
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.world_size,
            num_kv_heads=self.num_local_kv_heads(config.num_kv_heads),
            intermediate_size=config.intermediate_size // self.world_size,
            moe_intermediate_size=config.moe_intermediate_size // self.world_size,
            shared_expert_intermediate_size=(
                None
                if config.shared_expert_intermediate_size is None
                else config.shared_expert_intermediate_size // self.world_size
            ),
            vocab_size=self.vocab_shard_size(config.vocab_size),
        )

    def num_local_kv_heads(self, num_kv_heads: int) -> int:
        return max(1, num_kv_heads // self.world_size)

    def first_kv_head(self, num_kv_heads: int) -> int:
        """The first KV head of this rank (a replicated one is shared by consecutive ranks)."""
        if num_kv_heads >= self.world_size:
            return self.rank * (num_kv_heads // self.world_size)
        return self.rank * num_kv_heads // self.world_size

    def shard(self, size: int) -> tuple[int, int]:
        """This rank's `[start, stop)` of a dimension that divides evenly."""
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.world_size)  # the last rank's range is padded

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's token ids `[start, stop)`; `stop - start` can be less than the shard size
        on the last rank (its padding rows are zeros and never win)."""
        size = self.vocab_shard_size(vocab_size)
        start = min(self.rank * size, vocab_size)
        return start, min(start + size, vocab_size)

    # --- collectives ---------------------------------------------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max_(self, x: torch.Tensor) -> torch.Tensor:
        """Maximum over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[N, shard] logits of every rank -> [N, vocab] on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(local, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast_tokens(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0's sampled token ids to every rank."""
        if self.world_size == 1:
            assert token_ids is not None
            return token_ids
        values = torch.tensor(token_ids or [0] * count, dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            values = values.cuda()
        dist.broadcast(values, src=0, group=self.group)
        return [int(token) for token in values.tolist()]


SINGLE = TensorParallel()
