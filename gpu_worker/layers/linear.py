"""Linear layer whose matmul goes to the fastest kernel for its device and dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tgq.kernels import cpu_ops

MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [N, K]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul: MatmulFn = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return self.matmul(x, self.weight, self.bias)

    def pack_for_cpu(self, *, out_fp32: bool = False) -> None:
        """Replaces `weight` by its packed layout (`cpu_ops.pack_weight_bf16`, bf16 on a CPU with
        AVX512_BF16) and runs the AVX-512 kernel on it; `out_fp32`: fp32 results (logits). The
        [N, K] tensor is released unless something else holds it (tied embeddings, the greedy
        head)."""
        packed = cpu_ops.pack_weight_bf16(self.weight.detach())
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.matmul = functools.partial(
            _packed_matmul, out_features=self.out_features, out_fp32=out_fp32
        )


def _packed_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out_features: int,
    out_fp32: bool,
) -> torch.Tensor:
    return cpu_ops.linear_bf16_packed(x, packed, out_features, bias, out_fp32=out_fp32)
