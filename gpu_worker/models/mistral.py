"""Mistral: Llama with an optional sliding attention window on every layer."""

from __future__ import annotations

from typing import ClassVar

from gpu_worker.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    uses_sliding_window: ClassVar[bool] = True
