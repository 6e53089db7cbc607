"""The MLP's gate activations, by their `hidden_act` / `hidden_activation` names: SwiGLU's SiLU
(Llama, Qwen, Mistral, Phi) and GeGLU's tanh-approximated GELU (Gemma). Only SiLU has a fused CPU
kernel (`cpu_ops.silu_mul`); the others run as torch ops."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
FUSED_ON_CPU = ("silu",)
