"""Qwen3: Llama with RMSNorm over each head of q and k before the rotary embedding, and Qwen2's
per-layer sliding window (off unless `use_sliding_window`)."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm: ClassVar[bool] = True
    uses_sliding_window: ClassVar[bool] = True
