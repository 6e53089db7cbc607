"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (`gate`, a linear to one logit per expert) picks each token's top-k experts by softmax
probability (fp32), renormalised over the k where the family says so; each expert is an MLP of
its own. Tokens are grouped by expert: every expert that some token picked runs once, on all of
its tokens at once, so its weights are read once per step whatever the batch, and an expert no
token picked is not read at all. The weighted outputs are summed per token in expert order, in
the model's dtype, as the reference does. A shared expert (Qwen2-MoE) runs on every token, scaled
by a sigmoid gate.

On a CPU with AVX512_BF16 whose experts are SiLU MLPs over packed weights, a step whose
experts would each get few rows can run them all in one kernel call (`cpu_ops.moe_experts_bf16`,
the same values as one by one): a batch-16 decode step of 32 experts picks ~28 of them per
layer, and the Python and thread start-ups around ~56 small linears a layer can cost more than
their weights take to read. Which of the two runs a step of T tokens is measured on this CPU
with the model's shapes (`measure_experts`, op "moe_experts", kernels.choice).

With tensor parallelism each rank holds a slice of every expert's intermediate size (as of a dense
MLP); the router is whole on each rank, so every rank routes alike, and one all-reduce sums the
partial outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.parallel import SINGLE, TensorParallel
from tgq.kernels import cpu_ops
from tgq.kernels.choice import Choices, choose, kernel_for, measure

# The one-call experts kernel may run a step where each expert gets at most this many rows on
# average (decode steps; a prefill's experts go one by one, on the kernel measured for their rows).
FUSED_MAX_ROWS_PER_EXPERT = 16
# The candidates of op "moe_experts": all experts in one call, or one by one.
FUSED = "one_call"
ONE_BY_ONE = "one_by_one"


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
        self.intermediate_size = config.moe_intermediate_size
        # Where the experts can run in one kernel call (`stack_experts`): each expert's packed
        # gate_up and down weights stacked (the experts' own weights become views of them); and
        # which of one call / one by one runs a step of T tokens (`use_thresholds`; empty: one
        # by one always).
        self.fused_gate_up: torch.Tensor | None
        self.fused_down: torch.Tensor | None
        self.register_buffer("fused_gate_up", None, persistent=False)
        self.register_buffer("fused_down", None, persistent=False)
        self.fused_thresholds: list[tuple[int, str]] = []

    def stack_experts(self) -> bool:
        """After the experts' linears switched to their kernels: where every expert is a SiLU
        MLP with packed weights, no bias, an even hidden size and an intermediate size a
        multiple of 16, and this CPU has AVX512_BF16, stacks their packed weights (the experts'
        own become views of them) so that a step can run all of them in one call, from
        `use_thresholds` on. Returns whether it did."""
        by_name: dict[str, list[Linear]] = {"gate_up_proj": [], "down_proj": []}
        for expert in self.experts:
            fused_silu = getattr(expert, "activation", None) == "silu"
            if not fused_silu or not getattr(expert, "use_cpu_kernel", False):
                return False
            for name, linears in by_name.items():
                linear = getattr(expert, name, None)
                if not isinstance(linear, Linear):
                    return False
                if not linear.is_packed or linear.bias is not None:
                    return False
                linears.append(linear)
        hidden = by_name["down_proj"][0].out_features
        if not cpu_ops.has_avx512_bf16() or self.intermediate_size % 16 or hidden % 2:
            return False
        for name, linears in by_name.items():
            stacked = torch.stack([linear.weight.detach() for linear in linears])
            for linear, weight in zip(linears, stacked, strict=True):
                linear.weight = nn.Parameter(weight, requires_grad=False)
            setattr(self, "fused_" + name.removesuffix("_proj"), stacked)
        return True

    def max_fused_tokens(self) -> int:
        """The most tokens a step may have for the one-call kernel (FUSED_MAX_ROWS_PER_EXPERT
        rows per expert on average)."""
        return FUSED_MAX_ROWS_PER_EXPERT * len(self.experts) // self.top_k

    def measure_experts(self) -> Choices:
        """One call against one by one (on the experts' own kernels), at each bucket of tokens
        up to `max_fused_tokens`, with this block's weights and random routing; cached per CPU
        and shapes (kernels.choice). Needs `stack_experts`."""
        assert self.fused_gate_up is not None and self.fused_down is not None
        gate_up, down = self.fused_gate_up, self.fused_down
        hidden = self.gate.in_features
        gen = torch.Generator().manual_seed(0)
        largest = self.max_fused_tokens()
        buckets = [t for t in (1, 4, 16, 64, 256) if t <= largest] or [largest]

        def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = torch.randn(tokens, hidden, generator=gen).bfloat16()
            return x, *self.route(x)

        def one_call(tokens: int) -> Callable[[], object]:
            x, experts, weights = inputs(tokens)
            inter = self.intermediate_size
            return lambda: cpu_ops.moe_experts_bf16(x, experts, weights, gate_up, down, inter)

        def one_by_one(tokens: int) -> Callable[[], object]:
            x, experts, weights = inputs(tokens)
            return lambda: self._experts_one_by_one(x, experts, weights)

        shapes = {"moe_experts": [len(self.experts), hidden, self.intermediate_size, self.top_k]}
        return choose(
            shapes,
            lambda: measure("moe_experts", {FUSED: one_call, ONE_BY_ONE: one_by_one}, buckets),
        )

    def use_thresholds(self, thresholds: Sequence[tuple[int, str]]) -> None:
        """Steps of T tokens run the candidate `kernel_for(thresholds, T)` picks
        (`Choices.thresholds("moe_experts")`), one call only up to `max_fused_tokens` and
        only once `stack_experts` did."""
        self.fused_thresholds = list(thresholds)

    def _runs_fused(self, tokens: int) -> bool:
        return (
            self.fused_gate_up is not None
            and bool(self.fused_thresholds)
            and tokens <= self.max_fused_tokens()
            and kernel_for(self.fused_thresholds, tokens) == FUSED
        )

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
        if self._runs_fused(x.shape[0]):
            assert self.fused_gate_up is not None and self.fused_down is not None
            out = cpu_ops.moe_experts_bf16(
                x, experts, weights, self.fused_gate_up, self.fused_down, self.intermediate_size
            )
        else:
            out = self._experts_one_by_one(x, experts, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce_(out)

    def _experts_one_by_one(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # Each token's k choices, grouped by expert (a stable sort keeps each group's tokens in
        # order): one gather of their rows, each expert on its slice (per-expert gathers,
        # multiplies and adds took a fifth of a batch-16 step of 32 experts).
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
        # A token's k outputs, each scaled and rounded to the model's dtype, are added in expert
        # order with each partial sum rounded, as the reference adds them expert by expert (one
        # index_add_ over all of them would sum in fp32 and round once).
        scaled = (outputs * weights.flatten()[order][:, None]).to(x.dtype)
        row_of_pick = torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))
        by_expert = torch.argsort(experts, dim=1) + torch.arange(0, len(order), self.top_k)[:, None]
        picks = scaled[row_of_pick[by_expert]]  # [T, k, hidden]: each token's in expert order
        out = picks[:, 0]
        for rank in range(1, self.top_k):
            out = out + picks[:, rank]
        return out
