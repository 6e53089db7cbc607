"""compressed-tensors checkpoints (`quantization.compressed_scheme`): their 8-bit linears loaded as
stored. `fill_parameters` has already copied each stored int8 or FP8 weight into the float
parameter (exactly: every such value is a bf16, fp16 and fp32 value); here each linear whose
checkpoint tensors have a `weight_scale` beside them takes those values back as 8-bit weights with
one fp32 scale per output row (a per-tensor scale repeated over its rows; a fused module's parts
each with their own), and, for W8A8 schemes, the input quantization the scheme asks for.

A scale tensor no linear takes (a quantized lm_head, router or stacked experts, which tgq keeps
in float), a fused module only partly quantized, or parts with different static input scales
are refused, naming the tensor.
"""

from __future__ import annotations

import torch

from tgq.gpu_worker.layers.activation_quant import ActivationQuant
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.models.sources import Source
from tgq.gpu_worker.quantization import CompressedScheme, QuantArgs, QuantizedCheckpointError
from tgq.gpu_worker.weights import Checkpoint

DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}
# Tensors the format stores beside a quantized weight.
WEIGHT_SCALE, INPUT_SCALE = "weight_scale", "input_scale"
ZERO_POINTS = ("weight_zero_point", "input_zero_point")


def load_compressed(
    linears: dict[str, Linear],
    sources: dict[str, list[Source]],
    checkpoint: Checkpoint,
    scheme: CompressedScheme,
) -> int:
    """The quantized ones of `linears` (a model's decoder-layer linears by name, filled already
    from `checkpoint` through `sources`, `DecoderForCausalLM.checkpoint_sources`) as 8-bit
    layers; returns how many."""
    taken: set[str] = set()
    count = 0
    for name, module in linears.items():
        parts = sources[f"{name}.weight"]
        scaled = [checkpoint.has(_beside(part.name, WEIGHT_SCALE)) for part in parts]
        if not any(scaled):
            continue
        if not all(scaled):
            unscaled = next(p.name for p, s in zip(parts, scaled, strict=True) if not s)
            raise QuantizedCheckpointError(
                f"{name} is fused from quantized and unquantized tensors ({unscaled!r} has no"
                f" {WEIGHT_SCALE})"
            )
        scale = torch.cat([_row_scales(checkpoint, part, module) for part in parts])
        input_quant = _input_quant(checkpoint, parts, scheme.activations)
        q = module.weight.detach().to(DTYPES[scheme.weights.type])
        module.hold_quantized(q, scale, input_quant)
        for part in parts:
            _check_zero_points(checkpoint, part.name)
            taken.update(_beside(part.name, s) for s in (WEIGHT_SCALE, INPUT_SCALE, *ZERO_POINTS))
        count += 1
    _refuse_untaken(checkpoint, taken)
    return count


def _beside(weight_name: str, tensor: str) -> str:
    return f"{weight_name.removesuffix('weight')}{tensor}"


def _row_scales(checkpoint: Checkpoint, part: Source, module: Linear) -> torch.Tensor:
    """[rows] fp32: the part's rows' scales (channel: [N, 1] stored; tensor: [1] or [])."""
    rows = module.out_features if part.rows is None else part.rows
    stored = checkpoint.get(_beside(part.name, WEIGHT_SCALE), torch.float32).reshape(-1)
    if stored.numel() == 1:
        return stored.expand(rows).clone()
    if part.dim == 0:
        stored = stored[part.start : part.stop]
    if stored.numel() != rows:
        raise QuantizedCheckpointError(
            f"{_beside(part.name, WEIGHT_SCALE)!r} holds {stored.numel()} scales for {rows} rows"
        )
    return stored.contiguous()


def _check_zero_points(checkpoint: Checkpoint, weight_name: str) -> None:
    """Symmetric schemes may store zero points; they must be zeros."""
    for kind in ZERO_POINTS:
        name = _beside(weight_name, kind)
        if checkpoint.has(name) and checkpoint.get(name, torch.float32).any():
            raise QuantizedCheckpointError(f"{name!r} is not zero in a symmetric scheme")


def _input_quant(
    checkpoint: Checkpoint, parts: list[Source], args: QuantArgs | None
) -> ActivationQuant | None:
    if args is None:
        return None
    dtype = DTYPES[args.type]
    if args.dynamic:
        return ActivationQuant(dtype, per_token=args.strategy == "token")
    scales = [checkpoint.get(_beside(p.name, INPUT_SCALE), torch.float32) for p in parts]
    if any(not torch.equal(s, scales[0]) for s in scales):
        raise QuantizedCheckpointError(
            f"the parts fused from {[p.name for p in parts]} have different static input scales"
            f" ({[s.item() for s in scales]}): they share one input"
        )
    return ActivationQuant(dtype, per_token=False, static_scale=scales[0].reshape(1))


def _refuse_untaken(checkpoint: Checkpoint, taken: set[str]) -> None:
    kinds = (WEIGHT_SCALE, INPUT_SCALE, *ZERO_POINTS)
    left = [n for n in checkpoint.names() if n.endswith(kinds) and n not in taken]
    if left:
        raise QuantizedCheckpointError(
            f"tensor {left[0]!r} quantizes a weight tgq keeps in float (the lm_head, embeddings,"
            f" routers and stacked experts): {len(left)} such tensors"
        )
