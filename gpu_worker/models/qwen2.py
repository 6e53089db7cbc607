"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (never on o_proj), and a
sliding window on the layers `layer_types` names (off unless `use_sliding_window`)."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    uses_sliding_window: ClassVar[bool] = True

    @classmethod
    def attention_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        return True, False
