"""RMSNorm with the numerics of the reference implementations: normalise in fp32, cast back,
then scale. `use_cpu_kernel` (bf16 on CPU) runs the same arithmetic as one fused op."""

from __future__ import annotations

import torch
from torch import nn

from tgq.kernels import cpu_ops


class RMSNorm(nn.Module):
    has_cpu_kernel = True  # `cpu_ops.rms_norm` / `add_rms_norm` compute it

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.use_cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel and x.dim() == 2:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`residual += delta` IN PLACE, then returns the norm of the new residual."""
        if self.use_cpu_kernel:
            return cpu_ops.add_rms_norm(residual, delta, self.weight, self.eps)
        residual.add_(delta)
        return self(residual)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale by `1 + weight`), and the
    product is taken in fp32 before the cast back (Llama casts, then scales). `use_cpu_kernel`
    (bf16 rows on CPU) runs the same arithmetic as one op (`cpu_ops.offset_rms_norm`); per-head
    q/k norms ([T, heads, head_dim]) stay torch ops."""

    has_cpu_kernel = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.use_cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel and x.dim() == 2:
            return cpu_ops.offset_rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)
