"""Rotary position embeddings, with the `rope_scaling` types of Llama-, Qwen- and Phi-family
checkpoints, over all of a head or its leading `rotary_dim` dimensions (partial rotary).

`default`, `linear`, `llama3` and `yarn` are a fixed set of inverse frequencies (yarn also scales
cos and sin by its attention factor). `dynamic` (NTK-aware) raises the base once the sequence
reaches the original context length, and `longrope` switches from its short to its long factors
there. For those two a token's rotation follows its sequence's length as the reference
implementation sees it in the forward that computes the token (`ModelConfig.rope_length`: the
prompt's length for prompt tokens, `position + 1` for generated ones); cached keys keep the
rotation they were written with, as in the reference's generate loop, and the prefix cache keeps
prompts past the original length apart (`ModelConfig.prefix_cache_salt`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")


def _wavelength_bases(base: float, dim: int) -> torch.Tensor:
    """base^(2i / dim) for i < dim / 2: the inverse frequencies' denominators."""
    # explicit device: models are built under `torch.device("meta")`
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return base**exponents


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / _wavelength_bases(base, dim)


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): each frequency between its interpolated (divided by `factor`)
    and its original value by how many rotations it makes over the original context (a linear
    ramp between the `beta_slow` and `beta_fast` rotation counts); cos and sin scaled by the
    attention factor (given, else from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def dimension_for(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dimension_for(scaling.get("beta_fast") or 32.0)
    high = dimension_for(scaling.get("beta_slow") or 1.0)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    bases = _wavelength_bases(base, dim)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    inv_freq = 1.0 / (factor * bases) * (1 - keep) + 1.0 / bases * keep
    return inv_freq, float(attention)


def _longrope_attention(scaling: dict[str, Any], max_positions: int) -> float:
    """The given attention factor, else sqrt(1 + ln(factor) / ln(original length)) with
    `factor` the given one or the extended over the original context length."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """Computes cos/sin for a flat list of positions; applies them to q and k."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
        rotary_dim: int | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim  # cos and sin cover these leading dimensions
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
        dim = self.rotary_dim
        inv_freq = _base_inv_freq(base, dim)
        self.attention_factor = 1.0  # cos and sin are scaled by it
        self.long_inv_freq: torch.Tensor | None = None  # longrope's, past the original length
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif self.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn(base, dim, self.scaling)
        elif self.rope_type == "longrope":
            bases = _wavelength_bases(base, dim)
            short = torch.tensor(self.scaling["short_factor"], dtype=torch.float32, device="cpu")
            long = torch.tensor(self.scaling["long_factor"], dtype=torch.float32, device="cpu")
            self.long_inv_freq = 1.0 / (long * bases)
            inv_freq = 1.0 / (short * bases)
            self.attention_factor = _longrope_attention(self.scaling, max_position_embeddings)
        self.inv_freq = inv_freq  # [rotary_dim / 2] fp32

    @property
    def uses_lengths(self) -> bool:
        """Whether `cos_sin` needs each token's sequence length (`ModelConfig.rope_length`)."""
        return self.rope_type in LENGTH_DEPENDENT

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        return self

    def dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[T] sequence lengths -> [T, rotary_dim / 2] NTK-scaled inverse frequencies."""
        factor = self.scaling["factor"]
        dim = self.rotary_dim
        ratio = factor * seq_lens.double() / self.original_max_positions - (factor - 1)
        bases = self.base * ratio ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device) / dim
        return (1.0 / (bases[:, None] ** exponents[None, :])).float()

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """[T] positions -> cos, sin of shape [T, rotary_dim] in `dtype`. `lengths`: each
        token's sequence length for the length-dependent types (`uses_lengths`; default
        `positions + 1`, as for a generated token)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if self.uses_lengths:
            lengths = positions + 1 if lengths is None else lengths
            long = lengths > self.original_max_positions
            if bool(long.any()):
                if self.long_inv_freq is not None:
                    inv_freq = self.long_inv_freq[None, :]
                else:
                    inv_freq = self.dynamic_inv_freq(lengths[long])
                freqs[long] = positions[long][:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]: the leading rotary_dim of each head rotate
    sin: torch.Tensor,
) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]
