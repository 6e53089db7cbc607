"""Rotary position embeddings, with the `rope_scaling` types of Llama-family checkpoints.

`default`, `linear` and `llama3` are a fixed set of inverse frequencies. `dynamic` (NTK-aware)
raises the base once a position reaches the original context length; here each token uses the base
for the length its sequence has at that token (`position + 1`), so cached keys keep the rotation
they were written with. That equals the reference implementation token for token while decoding,
and differs from it only for prompts that start beyond the original length, where the reference
rotates the whole prompt with the base for its final length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # explicit device: models are built under `torch.device("meta")`
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for a flat list of positions; applies them to q and k."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
    ) -> None:
        self.head_dim = head_dim
        self.base = base
        self.rope_type = "default" if scaling is None else scaling["rope_type"]
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        self.scaling = scaling or {}
        self.original_max_positions = int(
            self.scaling.get("original_max_position_embeddings", max_position_embeddings)
        )
        inv_freq = _base_inv_freq(base, head_dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        self.inv_freq = inv_freq  # [head_dim / 2] fp32

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[T] sequence lengths -> [T, head_dim / 2] NTK-scaled inverse frequencies."""
        factor = self.scaling["factor"]
        dim = self.head_dim
        ratio = factor * seq_lens.double() / self.original_max_positions - (factor - 1)
        bases = self.base * ratio ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device) / dim
        return (1.0 / (bases[:, None] ** exponents[None, :])).float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T] positions -> cos, sin of shape [T, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if self.rope_type == "dynamic":
            long = positions >= self.original_max_positions
            if bool(long.any()):
                scaled = positions[long][:, None].float() * self.dynamic_inv_freq(
                    positions[long] + 1
                )
                freqs[long] = scaled
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
