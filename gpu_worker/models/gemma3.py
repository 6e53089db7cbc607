"""Gemma 3, text only (`Gemma3ForCausalLM`): Gemma 2's layer (offset norms around each sublayer,
GeGLU, scaled embeddings, `query_pre_attn_scalar`) with `(1 + weight)` norms over each head of q
and k, no soft caps unless configured, five sliding-window layers to one global by default, and
a rope per layer type: the sliding layers' own base (`rope_local_base_freq`, plain rope), the
global layers' `rope_theta` with their scaling."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm: ClassVar[bool] = True
