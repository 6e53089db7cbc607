"""Gemma 2 (`Gemma2ForCausalLM`): GeGLU MLPs (`gelu_pytorch_tanh`), `(1 + weight)` RMSNorms in fp32,
a norm before and after each sublayer, embeddings scaled by sqrt(hidden_size), attention scores
scaled by `query_pre_attn_scalar` and soft-capped, final logits soft-capped, and a sliding window
on every other layer (from the first), tied embeddings."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.layers.norm import OffsetRMSNorm
from tgq.gpu_worker.models.decoder import MLP, DecoderForCausalLM, SandwichDecoderLayer


class Gemma2ForCausalLM(DecoderForCausalLM):
    norm: ClassVar[type[nn.Module]] = OffsetRMSNorm
    scales_embeddings: ClassVar[bool] = True
    uses_sliding_window: ClassVar[bool] = True

    def _layer(self, config: ModelConfig, index: int) -> nn.Module:
        attention = self._attention(config, index)
        return SandwichDecoderLayer(config, attention, MLP(config, self.tp), self.norm)
