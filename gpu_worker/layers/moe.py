"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (`gate`, a linear to one logit per expert) picks each token's top-k experts by softmax
probability (fp32), renormalised over the k where the family says so; each expert is an MLP of
its own. Tokens are grouped by expert: every expert that some token picked runs once, on all of
its tokens at once, so its weights are read once per step whatever the batch, and an expert no
token picked is not read at all. The weighted outputs are summed per token in expert order, in
the model's dtype, as the reference does. A shared expert (Qwen2-MoE) runs on every token, scaled
by a sigmoid gate.

With tensor parallelism each rank holds a slice of every expert's intermediate size (as of a dense
MLP); the router is whole on each rank, so every rank routes alike, and one all-reduce sums the
partial outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.parallel import SINGLE, TensorParallel


class SparseMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,  # this rank's (`TensorParallel.local_config`)
        expert: Callable[[ModelConfig], nn.Module],  # an MLP that sums nothing across ranks
        tp: TensorParallel = SINGLE,
        *,
        weights_in_model_dtype: bool,
    ) -> None:
        """`weights_in_model_dtype`: the top-k weights are cast to the model's dtype before they
        scale the experts' outputs (Qwen-MoE); else they stay fp32 (Mixtral)."""
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        per_expert = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size)
        self.experts = nn.ModuleList(expert(per_expert) for _ in range(config.num_experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                config, intermediate_size=config.shared_expert_intermediate_size
            )
            self.shared_expert = expert(shared)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> each token's top-k expert ids [T, k] and weights [T, k]."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        # Each token's k choices, grouped by expert (a stable sort keeps each group's tokens in
        # order): one gather of their rows, each expert on its slice, one weighted scatter-add.
        # A token's k outputs are added in expert order, each rounded to the model's dtype first,
        # as the reference adds them expert by expert (per-expert gathers, multiplies and adds
        # took a fifth of a batch-16 step of 32 experts).
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        rows = x[tokens]
        outputs = torch.empty_like(rows)
        start = 0
        for index, count in enumerate(counts):
            if count:
                part = slice(start, start + count)
                outputs[part] = self.experts[index](rows[part])
                start += count
        scaled = (outputs * weights.flatten()[order][:, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, scaled)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce_(out)
