"""transformers' model of a checkpoint with the weights `--quantize` quantizes replaced by their
dequantized values (q * scale): the reference the int8 and fp8 tests compare tgq with, and the
model the quantization-quality benchmark compares with the unquantized one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# [..., out, in] float32 -> (q [..., out, in], scale [..., out]), one scale per output row.
RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def is_quantized_by_tgq(name: str, param: torch.Tensor) -> bool:
    """The transformers parameters tgq's quantized layers hold: the decoder layers' linear weights
    ([out, in]; stacked experts [E, out, in]), not the MoE routers (`loader.quantize_linears`)."""
    router = name.endswith("mlp.gate.weight") or "shared_expert_gate" in name
    return ".layers." in name and param.dim() >= 2 and not router


def dequantize_in_place(model: Any, quantize_rows: RowQuantizer, dtype: torch.dtype) -> Any:
    """`model`'s quantized parameters as q * scale, quantized from their values in `dtype` (what
    tgq loads in that dtype), then its parameters in `dtype`. Buffers keep theirs (the rotary
    `inv_freq` stays fp32, as `from_pretrained(dtype=...)` keeps it), so that the model differs
    from the unquantized one loaded in `dtype` by its quantized weights alone."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_quantized_by_tgq(name, param):
                q, scale = quantize_rows(param.to(dtype).float())
                param.copy_(q.float() * scale[..., None])
            param.data = param.data.to(dtype)
    return model
