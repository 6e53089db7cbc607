"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): Llama with q/k/v and gate/up stored fused in the
checkpoint (`qkv_proj`, `gate_up_proj`, as tgq holds them), `longrope` scaling for the long
context variants, partial rotary where `partial_rotary_factor` says so, and a sliding window on
every layer where `sliding_window` is set."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    fused_checkpoint: ClassVar[bool] = True
    uses_sliding_window: ClassVar[bool] = True
