"""A quantized linear's input quantized and dequantized again (W8A8 checkpoints: compressed-tensors'
`input_activations`), as that format's own forward does it, so that the layer sees the values the
checkpoint was calibrated and evaluated with.

Symmetric, 8 bits: int8 (range [-128, 127], rounded half to even) or FP8 E4M3 (range [-448, 448],
converted to nearest). The scale is the absolute maximum (zero counted in) over half the range's
width (127.5 for int8, 448 for FP8), per row of x (a token: "token") or over all of x ("tensor"),
computed in x's dtype with 0 replaced by that dtype's epsilon; or a static per-tensor scale stored
in the checkpoint (computed in fp32, the result back in x's dtype). x / scale, clamped to the
range, rounded to the 8-bit type, times scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgq.kernels import cpu_ops

# The 8-bit types and their ranges.
RANGES = {torch.int8: (-128.0, 127.0), torch.float8_e4m3fn: (-448.0, 448.0)}


@dataclass(frozen=True, slots=True)
class ActivationQuant:
    dtype: torch.dtype  # torch.int8 or torch.float8_e4m3fn
    per_token: bool  # dynamic scales: one per row of x, else one for all of x
    static_scale: torch.Tensor | None = None  # [1] fp32 from the checkpoint; None: dynamic

    def __post_init__(self) -> None:
        if self.dtype not in RANGES:
            raise ValueError(f"activations quantize to int8 or float8_e4m3fn, not {self.dtype}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, K], x's dtype
        """On CPU, the C++ op (`cpu_ops.quantize_inputs`, one pass); elsewhere torch's ops."""
        is_kernel_dtype = x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
        if x.device.type == "cpu" and is_kernel_dtype and cpu_ops.is_available():
            return cpu_ops.quantize_inputs(
                x,
                fp8=self.dtype == torch.float8_e4m3fn,
                per_token=self.per_token,
                static_scale=self.static_scale,
            )
        return self.with_torch(x)

    def with_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same with torch's ops (any device), as compressed-tensors' forward computes it."""
        low, high = RANGES[self.dtype]
        if self.static_scale is not None:
            scale = self.static_scale.to(device=x.device, dtype=torch.float32)
            return self._round_trip(x.float(), scale, low, high).to(x.dtype)
        if self.per_token:
            smallest, largest = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        else:
            smallest, largest = torch.aminmax(x)
        amax = torch.maximum(smallest.clamp(max=0).abs(), largest.clamp(min=0))
        scale = amax / (torch.tensor(high - low, dtype=x.dtype, device=x.device) / 2)
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        return self._round_trip(x, scale, low, high)

    def _round_trip(
        self, x: torch.Tensor, scale: torch.Tensor, low: float, high: float
    ) -> torch.Tensor:
        scaled = (x / scale).clamp(low, high)
        if self.dtype == torch.int8:
            rounded = torch.round(scaled)
        else:
            rounded = scaled.to(self.dtype).to(scaled.dtype)
        return rounded * scale
