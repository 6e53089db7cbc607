"""Qwen1.5-MoE / Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2 (q/k/v bias) with sparse MLPs every
`decoder_sparse_step` layers (but `mlp_only_layers`): routed experts plus a shared expert behind
a sigmoid gate (`layers/moe.py`)."""

from __future__ import annotations

from tgq.gpu_worker.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    pass
