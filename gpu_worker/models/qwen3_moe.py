"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 (q/k norm) with sparse MLPs of many small experts,
top-k renormalised where `norm_topk_prob` says so (`layers/moe.py`)."""

from __future__ import annotations

from tgq.gpu_worker.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    pass
