"""Llama 2 / 3 / 3.1 / 3.2: the base decoder as is (rope scaling and tied embeddings come from
the config)."""

from __future__ import annotations

from tgq.gpu_worker.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
