"""Qwen3: Llama with RMSNorm over each head of q and k before the rotary embedding."""

from __future__ import annotations

from typing import ClassVar

from gpu_worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm: ClassVar[bool] = True
