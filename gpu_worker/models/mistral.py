"""Mistral: Llama with an optional sliding attention window (on every layer unless
`layer_types` says otherwise)."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    uses_sliding_window: ClassVar[bool] = True
