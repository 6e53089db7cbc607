"""How far a kernel's output is from its reference, for the kernel tests."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference, relative to the reference's largest magnitude."""
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
