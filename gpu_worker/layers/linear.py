"""Linear layer whose matmul goes to the fastest kernel for its device and dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [N, K]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul: MatmulFn = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return self.matmul(x, self.weight, self.bias)
