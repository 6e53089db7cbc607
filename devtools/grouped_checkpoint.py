"""GPTQ and AWQ checkpoints of a float checkpoint, written here from the formats' published
layouts (no GPTQ or AWQ package runs on this CPU): every decoder-layer linear quantized to 4 bits
by rounding to nearest in groups of input columns (GPTQ's symmetric grid, zero point 8, or AWQ's
asymmetric min-max grid), fp16 scales, packed as the format packs them. Not the GPTQ or AWQ
algorithms (no calibration: the weights are what matters to a loader, not how they were chosen);
`gptq-act-order` shuffles the groups over the columns as GPTQ's desc_act does (one order per
layer and input, as GPTQ's Hessian order is the same for linears reading the same input), with a
stored g_idx.
Beside it, `dequantized_copy` writes the float checkpoint of the same model with each quantized
weight replaced by its exact value (q - zero) * scale: the reference tgq is compared with.

    python -m tgq.devtools.grouped_checkpoint MODEL_DIR OUT_DIR gptq --group-size 128
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("gptq", "gptq-act-order", "awq")
BITS = 4
LARGEST = (1 << BITS) - 1
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of an AWQ word is column AWQ_ORDER[i] of its 8


@dataclass(frozen=True, slots=True)
class Quantized:
    """One linear: q [N, K] ints 0..15, scale and zero [N, G], g_idx [K]."""

    q: torch.Tensor
    scale: torch.Tensor  # fp16
    zero: torch.Tensor  # int
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx
        return (self.q.float() - self.zero[:, g].float()) * self.scale[:, g].float()


def is_grouped_linear(name: str, tensor: torch.Tensor) -> bool:
    """The tensors the formats quantize: the decoder layers' linears' weights."""
    return ".layers." in name and name.endswith("_proj.weight") and tensor.dim() == 2


def quantize(
    weight: torch.Tensor, group_size: int, *, symmetric: bool, g_idx: torch.Tensor
) -> Quantized:
    """Round to nearest per (row, group): symmetric, scale = 2 max |w| / 15 and zero 8 (GPTQ's
    sym grid); otherwise scale = (max - min) / 15 over a range holding 0, zero = round(-min /
    scale) (GPTQ's and AWQ's asymmetric grid)."""
    w = weight.float()
    groups = int(g_idx.max()) + 1
    scale = torch.empty(w.shape[0], groups)
    zero = torch.empty(w.shape[0], groups)
    for g in range(groups):
        part = w[:, g_idx == g]
        low, high = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
        if symmetric:
            high = torch.maximum(low.abs(), high)
            low = -high
        step = ((high - low) / LARGEST).half().float()
        step = torch.where(step > 0, step, torch.ones_like(step))
        scale[:, g] = step
        zero[:, g] = torch.full_like(step, 8.0) if symmetric else torch.round(-low / step)
    q = torch.round(w / scale[:, g_idx]) + zero[:, g_idx]
    return Quantized(q.clamp(0, LARGEST).to(torch.int32), scale.half(), zero.int(), g_idx)


def pack_along(values: torch.Tensor, dim: int) -> torch.Tensor:
    """ints 0..15 -> int32 words of 8, lowest bits first, along `dim`."""
    moved = values.to(torch.int64).movedim(dim, -1)
    words = moved.reshape(*moved.shape[:-1], -1, 32 // BITS)
    shifts = torch.arange(0, 32, BITS)
    packed = (words << shifts).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)  # as int32 bits
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def gptq_tensors(prefix: str, qt: Quantized) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight [K / 8, N], qzeros [G, N / 8] holding each zero point minus 1, scales
    [G, N] fp16, g_idx [K] int32."""
    return {
        f"{prefix}qweight": pack_along(qt.q.T, 0),
        f"{prefix}qzeros": pack_along((qt.zero.T - 1) & LARGEST, 1),
        f"{prefix}scales": qt.scale.T.contiguous(),
        f"{prefix}g_idx": qt.g_idx.to(torch.int32),
    }


def awq_tensors(prefix: str, qt: Quantized) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight [K, N / 8] and qzeros [G, N / 8] with each word's columns in
    AWQ_ORDER, scales [G, N] fp16."""

    def packed(values: torch.Tensor) -> torch.Tensor:  # [rows, N]
        ordered = values.reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
        return pack_along(ordered.flatten(1), 1)

    return {
        f"{prefix}qweight": packed(qt.q.T),
        f"{prefix}qzeros": packed(qt.zero.T),
        f"{prefix}scales": qt.scale.T.contiguous(),
    }


def quantization_config(fmt: str, group_size: int) -> dict[str, object]:
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": BITS,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    return {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "desc_act": fmt == "gptq-act-order",
        "sym": True,
        "checkpoint_format": "gptq",
    }


def write_grouped(model_dir: Path, out_dir: Path, fmt: str, group_size: int, seed: int = 0) -> Path:
    """`model_dir`'s model in `fmt` (one of FORMATS) with `group_size` columns a group, saved to
    `out_dir` with its tokenizer files; the dequantized float copy beside it in
    `dequantized_dir(out_dir)`. Returns `out_dir`; one with weights already is taken as
    written."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_grouped_linear(name, tensor):
            out[name] = reference[name] = tensor
            continue
        columns = tensor.shape[1]
        position = torch.arange(columns)
        if fmt == "gptq-act-order":  # one order per layer and input size (q/k/v share theirs)
            key = (name.split(".layers.")[1].split(".")[0], columns)
            if key not in orders:
                orders[key] = torch.randperm(columns, generator=gen).argsort()
            position = orders[key]
        qt = quantize(tensor, group_size, symmetric=fmt != "awq", g_idx=position // group_size)
        prefix = name.removesuffix("weight")
        out.update(awq_tensors(prefix, qt) if fmt == "awq" else gptq_tensors(prefix, qt))
        reference[name] = qt.dequantize().to(tensor.dtype)
    config = json.loads((model_dir / "config.json").read_text())
    for directory, weights, section in (  # out_dir last: its weights mark both written
        (dequantized_dir(out_dir), reference, None),
        (out_dir, out, quantization_config(fmt, group_size)),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        written = dict(config, quantization_config=section) if section else config
        (directory / "config.json").write_text(json.dumps(written, indent=2))
        for path in model_dir.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(path, directory / path.name)
        save_file(weights, str(directory / "model.safetensors"))
    return out_dir


def dequantized_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f"{out_dir.name}-dequantized")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    print(write_grouped(args.model_dir, args.out_dir, args.format, args.group_size))


if __name__ == "__main__":
    main()
