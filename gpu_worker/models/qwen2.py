"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (never on o_proj)."""

from __future__ import annotations

from gpu_worker.config import ModelConfig
from gpu_worker.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def attention_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        return True, False
