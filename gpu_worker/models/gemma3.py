"""Gemma 3: text only (`Gemma3ForCausalLM`, 1B), and the text model of the multimodal
checkpoints (`Gemma3ForConditionalGeneration`, 4B and up; images are not served). Gemma 2's layer
(offset norms around each sublayer, GeGLU, scaled embeddings, `query_pre_attn_scalar`) with
`(1 + weight)` norms over each head of q and k, no soft caps unless configured, five
sliding-window layers to one global by default, and a rope per layer type: the sliding layers'
own base (`rope_local_base_freq`, plain rope), the global layers' `rope_theta` with their
scaling."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm: ClassVar[bool] = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The same text model, stored beside a vision tower and its projector (not loaded): under
    `language_model.model.` / `language_model.lm_head.` as the hub's checkpoints store it
    (transformers 4), or `model.language_model.` / `lm_head.` (transformers 5). Its config is
    the `text_config` (`config.text_config`)."""

    _LAYOUTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("lm_head.", "lm_head."),
    )

    @classmethod
    def stored_name(cls, stored: str) -> str | None:
        for prefix, ours in cls._LAYOUTS:
            if stored.startswith(prefix):
                return ours + stored.removeprefix(prefix)
        return None  # the vision tower, the projector
