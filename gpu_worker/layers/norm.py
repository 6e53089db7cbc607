"""RMSNorm with the numerics of the reference implementations: normalise in fp32, then scale
and cast back as each family does. `use_cpu_kernel` (bf16 rows on CPU) runs the same arithmetic
as one fused op."""

from __future__ import annotations

import torch
from torch import nn

from tgq.kernels import cpu_ops


class _RootMeanSquareNorm(nn.Module):
    """What both norms share: the weight, eps, and x * rsqrt(mean(x^2) + eps) in fp32; each
    says how the weight scales it (`_scaled`) and which fused op computes the whole
    (`_fused`)."""

    has_cpu_kernel = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.use_cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel and x.dim() == 2:
            return self._fused(x)
        x32 = x.float()
        return self._scaled(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps), x)

    def _scaled(self, normalized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(_RootMeanSquareNorm):
    """Llama's: cast back to x's dtype, then scale (`cpu_ops.rms_norm`)."""

    def _scaled(self, normalized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.weight * normalized.to(x.dtype)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`residual += delta` IN PLACE, then returns the norm of the new residual."""
        if self.use_cpu_kernel:
            return cpu_ops.add_rms_norm(residual, delta, self.weight, self.eps)
        residual.add_(delta)
        return self(residual)


class OffsetRMSNorm(_RootMeanSquareNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale by `1 + weight`), and the
    product is taken in fp32 before the cast back (Llama casts, then scales). The fused op is
    `cpu_ops.offset_rms_norm`; per-head q/k norms ([T, heads, head_dim]) stay torch ops."""

    def _scaled(self, normalized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (normalized * (1.0 + self.weight.float())).type_as(x)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.offset_rms_norm(x, self.weight, self.eps)
