"""The MLP's gate activations, by their `hidden_act` / `hidden_activation` names: SwiGLU's SiLU
(Llama, Qwen, Mistral, Phi) and GeGLU's tanh-approximated GELU (Gemma), as torch ops, and the
fused CPU kernels that compute `act(gate) * up` over a fused gate_up row in one pass."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tgq.kernels import cpu_ops

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
# [T, 2 * I] bf16 gate_up -> [T, I], on the CPU kernels.
FUSED_ON_CPU: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": cpu_ops.silu_mul,
    "gelu_pytorch_tanh": cpu_ops.gelu_tanh_mul,
}
