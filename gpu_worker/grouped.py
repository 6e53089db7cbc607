"""Checkpoints of integer weights quantized in groups (`quantization.GroupedScheme`): GPTQ, AWQ
and compressed-tensors' `pack-quantized`. Each format packs its values into int32 words, lowest
bits first, in its own layout; here each stored linear becomes the same four tensors, which
`Linear.hold_grouped` runs: q [N, K] (the unsigned values, 0..2^bits - 1), scale and zero
[N, G] fp32 (w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = g_idx[k]) and g_idx [K].

- GPTQ (AutoGPTQ / GPTQModel): `qweight` [K / f, N] packed along K (f = 32 / bits values a
  word), `qzeros` [G, N / f] packed along N, `scales` [G, N], `g_idx` [K] (desc_act: the groups
  follow the order the columns were quantized in, not K's). Format v1 stores each zero point
  minus 1.
- AWQ (AutoAWQ's GEMM layout): `qweight` [K, N / 8] and `qzeros` [G, N / 8] packed along N, a
  word's eight values in the column order 0, 2, 4, 6, 1, 3, 5, 7; `scales` [G, N].
- compressed-tensors `pack-quantized`: `weight_packed` [N, K / f] packed along K, the values
  stored plus 2^(bits - 1) (signed values made unsigned), `weight_scale` [N, G],
  `weight_zero_point` [N / f, G] packed along N where asymmetric, `weight_g_idx` [K] where the
  columns were quantized in activation order, `weight_shape` [2].

A linear with such tensors is held quantized; one without stays float (a format may leave
layers out). A quantized tensor no linear takes (a quantized lm_head or stacked experts), or a
fused module whose parts differ (quantized and not, or each with its own g_idx), is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.models.sources import Source
from tgq.gpu_worker.quantization import (
    AWQ,
    COMPRESSED_TENSORS,
    GPTQ,
    GroupedScheme,
    QuantizedCheckpointError,
)
from tgq.gpu_worker.weights import Checkpoint

# The tensor that marks a stored linear as quantized, per method.
PACKED_WEIGHT = {GPTQ: "qweight", AWQ: "qweight", COMPRESSED_TENSORS: "weight_packed"}
# Every tensor a format stores beside (or instead of) `weight`, per method.
STORED = {
    GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    AWQ: ("qweight", "qzeros", "scales"),
    COMPRESSED_TENSORS: (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_g_idx",
        "weight_shape",
    ),
}
# AutoAWQ's GEMM layout: value i of a word is column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True, slots=True)
class GroupedWeights:
    """One linear's (or one stored part's) weights, format-free: see the module's docstring."""

    q: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N, G] fp32
    zero: torch.Tensor  # [N, G] fp32
    g_idx: torch.Tensor  # [K] int64

    def rows(self, start: int, stop: int) -> GroupedWeights:
        return GroupedWeights(
            self.q[start:stop], self.scale[start:stop], self.zero[start:stop], self.g_idx
        )

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, exactly (q - zero) * scale: |q - zero| < 2^9 and the stored scales are
        fp16 or bf16 values, so every product fits fp32's 24 bits."""
        return (self.q.float() - self.zero[:, self.g_idx]) * self.scale[:, self.g_idx]


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 // bits values each, lowest bits first -> the values (uint8), each word's
    values side by side along `dim`."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = words.to(torch.int32).movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & mask  # arithmetic shift: the mask drops the sign
    return values.flatten(-2).movedim(-1, dim).to(torch.uint8)


def read_grouped(
    checkpoint: Checkpoint, prefix: str, scheme: GroupedScheme, in_features: int
) -> GroupedWeights:
    """The stored linear `prefix` ("model.layers.0.mlp.down_proj.") as GroupedWeights."""
    readers = {GPTQ: _read_gptq, AWQ: _read_awq, COMPRESSED_TENSORS: _read_packed}
    weights = readers[scheme.method](checkpoint, prefix, scheme, in_features)
    _check_shapes(prefix, weights, in_features)
    return weights


def _groups(in_features: int, group_size: int) -> torch.Tensor:
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features) // size


def _int32(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    return checkpoint.get(name, torch.int32)


def _read_gptq(
    checkpoint: Checkpoint, prefix: str, scheme: GroupedScheme, in_features: int
) -> GroupedWeights:
    q = unpack_words(_int32(checkpoint, f"{prefix}qweight"), scheme.bits, 0)[:in_features]
    scale = checkpoint.get(f"{prefix}scales", torch.float32)
    zero = unpack_words(_int32(checkpoint, f"{prefix}qzeros"), scheme.bits, 1)
    zero = zero[:, : scale.shape[1]].float() + scheme.zero_offset
    name = f"{prefix}g_idx"
    if checkpoint.has(name):
        g_idx = checkpoint.get(name, torch.int64)
    else:
        g_idx = _groups(in_features, scheme.group_size)
    return GroupedWeights(q.T.contiguous(), scale.T.contiguous(), zero.T.contiguous(), g_idx)


def _read_awq(
    checkpoint: Checkpoint, prefix: str, scheme: GroupedScheme, in_features: int
) -> GroupedWeights:
    def columns(name: str) -> torch.Tensor:  # [rows, N] in column order
        values = unpack_words(_int32(checkpoint, f"{prefix}{name}"), 4, 1)
        order = torch.tensor(AWQ_ORDER).argsort()  # column j sits at value order[j] of its word
        return values.reshape(values.shape[0], -1, 8)[:, :, order].flatten(1)

    q = columns("qweight")
    zero = columns("qzeros").float()
    scale = checkpoint.get(f"{prefix}scales", torch.float32)
    g_idx = _groups(in_features, scheme.group_size)
    return GroupedWeights(q.T.contiguous(), scale.T.contiguous(), zero.T.contiguous(), g_idx)


def _read_packed(
    checkpoint: Checkpoint, prefix: str, scheme: GroupedScheme, in_features: int
) -> GroupedWeights:
    shape = checkpoint.get(f"{prefix}weight_shape", torch.int64).tolist()
    rows, cols = (int(v) for v in shape)
    q = unpack_words(_int32(checkpoint, f"{prefix}weight_packed"), scheme.bits, 1)[:, :cols]
    scale = checkpoint.get(f"{prefix}weight_scale", torch.float32)
    offset = 1 << (scheme.bits - 1)
    name = f"{prefix}weight_zero_point"
    if scheme.symmetric or not checkpoint.has(name):
        zero = torch.full_like(scale, float(offset))
    else:  # stored signed, packed along N like the weights along K
        stored = unpack_words(_int32(checkpoint, name), scheme.bits, 0)[:rows]
        zero = stored.float()
    name = f"{prefix}weight_g_idx"
    if checkpoint.has(name):
        g_idx = checkpoint.get(name, torch.int64)
    else:
        g_idx = _groups(in_features, scheme.group_size)
    return GroupedWeights(q.contiguous(), scale.contiguous(), zero.contiguous(), g_idx)


def _check_shapes(prefix: str, w: GroupedWeights, in_features: int) -> None:
    groups = w.scale.shape[1]
    if (
        w.q.shape[1] != in_features
        or w.g_idx.shape != (in_features,)
        or w.zero.shape != w.scale.shape
        or w.scale.shape[0] != w.q.shape[0]
        or int(w.g_idx.min()) < 0
        or int(w.g_idx.max()) >= groups
    ):
        raise QuantizedCheckpointError(
            f"{prefix!r}: stored shapes do not fit a linear of {in_features} inputs (values"
            f" {tuple(w.q.shape)}, scales {tuple(w.scale.shape)}, zero points"
            f" {tuple(w.zero.shape)}, g_idx {tuple(w.g_idx.shape)})"
        )


def load_grouped(
    linears: dict[str, Linear],
    sources: dict[str, list[Source]],
    checkpoint: Checkpoint,
    scheme: GroupedScheme,
) -> set[str]:
    """The quantized ones of `linears` (a model's decoder-layer linears by name, their weights
    not filled yet) held as grouped integer weights (`Linear.hold_grouped`), read from
    `checkpoint` through `sources` (`DecoderForCausalLM.checkpoint_sources`); returns their
    weight parameters' names, which `fill_parameters` must skip."""
    marker = PACKED_WEIGHT[scheme.method]
    held: set[str] = set()
    taken: set[str] = set()
    for name, module in linears.items():
        parts = sources[f"{name}.weight"]
        prefixes = [part.name.removesuffix("weight") for part in parts]
        stored = [checkpoint.has(f"{p}{marker}") for p in prefixes]
        if not any(stored):
            continue
        if not all(stored):
            unquantized = next(p for p, s in zip(prefixes, stored, strict=True) if not s)
            raise QuantizedCheckpointError(
                f"{name} is fused from quantized and unquantized tensors ({unquantized!r} has no"
                f" {marker})"
            )
        pieces = []
        for part, prefix in zip(parts, prefixes, strict=True):
            whole = read_grouped(checkpoint, prefix, scheme, module.in_features)
            stop = whole.q.shape[0] if part.stop is None else part.stop
            pieces.append(whole.rows(part.start, stop) if part.dim == 0 else whole)
            taken.update(f"{prefix}{t}" for t in STORED[scheme.method])
        g_idx = pieces[0].g_idx
        if any(not torch.equal(p.g_idx, g_idx) for p in pieces):
            raise QuantizedCheckpointError(
                f"{name} is fused from {prefixes} whose g_idx differ: they share one input"
            )
        module.hold_grouped(
            torch.cat([p.q for p in pieces]),
            torch.cat([p.scale for p in pieces]),
            torch.cat([p.zero for p in pieces]),
            g_idx,
        )
        held.add(f"{name}.weight")
    left = [n for n in checkpoint.names() if n.endswith(STORED[scheme.method]) and n not in taken]
    if left:
        raise QuantizedCheckpointError(
            f"tensor {left[0]!r} quantizes a weight tgq keeps in float (the lm_head, embeddings,"
            f" routers and stacked experts): {len(left)} such tensors"
        )
    return held
