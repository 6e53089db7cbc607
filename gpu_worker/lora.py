"""LoRA adapters (`--lora-adapters name=DIR,...`): PEFT checkpoints served beside the base model,
each row of a step taking its own sequence's adapter.

A PEFT adapter stores, per target projection, A [r, K] and B [N, r]; the projection's output
gains `scale * (x @ A^T) @ B^T` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with
`use_rslora`), which is what merging `W + scale * B @ A` computes. tgq fuses q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`, so the parts of one fused linear are stacked: A's of
the parts one under another (their ranks summed), B block-diagonal over the parts' output
columns, zeros where the adapter leaves a part out. The scale is folded into B at load.

Each step the runner says which adapter each token row takes (`AdapterRows.use`); every LoRA
linear then adds each row its own adapter's term, all adapters in the same two matmuls
(`LoraTerm`). Rows of the base model (slot 0) add nothing, and a step without adapter rows runs
no LoRA op at all. The term is added to whatever the base matmul returned, so packed and
quantized linears take adapters too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.models.decoder import MLP, Attention, DecoderForCausalLM

BASE = 0  # the adapter slot of rows that take none
_PEFT_PREFIX = "base_model.model."
# A PEFT target (the checkpoint's module name) -> (our fused linear, its part of the outputs).
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Settings that change what the adapter computes beyond A, B and one scale: refused.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


# Steps of more token rows than this (prefills) run each adapter's runs of rows apart; smaller
# ones (decodes) run every adapter over every row, masked (`LoraTerm`).
MASKED_MAX_ROWS = 64


@dataclass
class AdapterRows:
    """Which adapter each token row of this step takes, shared by every LoRA linear."""

    slots: torch.Tensor | None = None  # [T] int64; None: every row the base model's
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # this step's, by layout
    # Past MASKED_MAX_ROWS rows: (slot, start, stop) of each run of rows of one adapter
    runs: list[tuple[int, int, int]] | None = None

    def use(self, slots: list[int], device: torch.device) -> None:
        """`slots`: the adapter slot of each token row of the step, in row order."""
        self.masks = {}
        self.slots = torch.tensor(slots, device=device) if any(slots) else None
        self.runs = None
        if self.slots is not None and len(slots) > MASKED_MAX_ROWS:
            starts = [i for i in range(len(slots)) if i == 0 or slots[i] != slots[i - 1]]
            stops = [*starts[1:], len(slots)]
            runs = zip(starts, stops, strict=True)
            self.runs = [(slots[start], start, stop) for start, stop in runs if slots[start]]

    def mask(self, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, R]: 1 where rank column r (of adapter `columns[r]`) is the row's adapter's, else
        0; computed once per step for each column layout (`LoraTerm.columns`, shared by the
        linears with one layout)."""
        assert self.slots is not None
        key = id(columns)
        if (mask := self.masks.get(key)) is None:
            mask = (self.slots[:, None] == columns[None, :]).to(dtype)
            self.masks[key] = mask
        return mask


class LoraTerm(nn.Module):
    """One linear's adapters. A decode step's few rows take all of them in one low-rank pair:
    A [R, K] the adapters' A's stacked, B [N, R] theirs side by side (scale folded in), rank
    column r belonging to adapter `columns[r]`, each row's term `((x @ A^T) * its mask) @ B^T`
    (a base row's mask is all 0): two matmuls whatever the adapters, which read every adapter's
    weights once, as a decode step must, and replay as recorded ops. A prefill's many rows take
    each adapter's own pair (`pairs`) over its runs of rows (the runner orders a step's chunks
    by adapter), where the masked pair would multiply every row by every adapter. The pairs are
    `Linear`s, so on the CPU kernels they run on the packed bf16 kernel as the base linears do
    (torch's bf16 matmul is several times slower at these shapes)."""

    def __init__(
        self,
        rows: AdapterRows,
        stacked: tuple[Linear, Linear],
        columns: torch.Tensor,
        pairs: dict[int, tuple[Linear, Linear]],
    ) -> None:
        super().__init__()
        self.rows = rows
        self.a, self.b = stacked
        self.columns: torch.Tensor  # [R] int64
        self.register_buffer("columns", columns, persistent=False)
        self.pairs = nn.ModuleDict({str(slot): nn.ModuleList(pair) for slot, pair in pairs.items()})

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [T, K], [T, N]
        if self.rows.slots is None:
            return out
        if self.rows.runs is None:
            h = self.a(x).mul_(self.rows.mask(self.columns, x.dtype))
            return out.add_(self.b(h))
        for slot, start, stop in self.rows.runs:
            if str(slot) in self.pairs:
                a, b = self.pairs[str(slot)].children()
                out[start:stop].add_(b(a(x[start:stop])))
        return out


@dataclass(frozen=True, slots=True)
class Adapters:
    """The adapters loaded into a model: slot 1, 2, ... in the order given."""

    model: DecoderForCausalLM
    slots: dict[str, int]  # adapter name -> slot
    rows: AdapterRows

    def slot(self, name: str | None) -> int:
        """An adapter's slot (BASE for None); KeyError for a name not loaded."""
        return BASE if name is None else self.slots[name]

    def use(self, slots: list[int], device: torch.device) -> None:
        """`slots`: the adapter slot of each token row of the step, in row order. The rows'
        slots are an input of the model's recorded decode steps (`kernels.replay`): the LoRA
        ops depend on whether the step has adapter rows, not on which."""
        self.rows.use(slots, device)
        self.model.replay_inputs = [] if self.rows.slots is None else [self.rows.slots]


def load_adapters(
    model: DecoderForCausalLM, adapters: dict[str, str], dtype: torch.dtype, *, packed: bool
) -> Adapters:
    """Loads `adapters` (name -> PEFT checkpoint directory) into `model`'s linears, in `dtype`
    (the model's; a quantized linear's weights are not in it); `packed`: their matmuls on the
    packed bf16 CPU kernel (`Linear.use_kernels`). Raises ValueError for a checkpoint tgq
    cannot serve."""
    if adapters and model.config.num_experts:
        raise ValueError("LoRA adapters (--lora-adapters) need a model without experts")
    rows = AdapterRows()
    slots: dict[str, int] = {}
    pairs: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for slot, (name, directory) in enumerate(adapters.items(), start=1):
        slots[name] = slot
        for module_name, (a, b) in _fused_weights(model, Path(directory), name, dtype).items():
            pairs.setdefault(module_name, []).append((slot, a, b))
    modules = dict(model.named_modules())
    layouts: dict[tuple[int, ...], torch.Tensor] = {}  # one tensor per layout: its masks' key
    for module_name, held in pairs.items():
        linear = modules[module_name]
        assert isinstance(linear, Linear)
        layout = tuple(slot for slot, a, _ in held for _ in range(a.shape[0]))
        columns = layouts.setdefault(layout, torch.tensor(layout, device=held[0][1].device))
        a_all = _linear(torch.cat([a for _, a, _ in held]), packed=packed)
        b_all = _linear(torch.cat([b for _, _, b in held], dim=1), packed=packed)
        own = {slot: (_linear(a, packed=packed), _linear(b, packed=packed)) for slot, a, b in held}
        linear.lora = LoraTerm(rows, (a_all, b_all), columns, own)
    return Adapters(model, slots, rows)


def _linear(weight: torch.Tensor, *, packed: bool) -> Linear:
    """A `Linear` over `weight` [N, K], on the packed bf16 kernel with `packed`."""
    linear = Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if packed:
        linear.use_kernels([(1, "avx512")], out_fp32=False)
    return linear


def _fused_weights(
    model: DecoderForCausalLM, directory: Path, name: str, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One PEFT checkpoint's (A, B) per linear of ours, fused as the linears are."""
    config = json.loads((directory / "adapter_config.json").read_text())
    _check_config(config, name)
    parts = _read_parts(directory / "adapter_model.safetensors", name)
    modules = dict(model.named_modules())
    fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for target, (a, b) in parts.items():
        ours = model.stored_name(target)
        owner, _, leaf = (ours or "").rpartition(".")
        fused_leaf, part = _FUSED_PARTS.get(leaf, (leaf, 0))
        module_name = f"{owner}.{fused_leaf}"
        if ours is None or not isinstance(modules.get(module_name), Linear):
            raise ValueError(f"adapter {name!r}: no linear of the model for {target!r}")
        scale = _scale(config, a.shape[0])
        fused.setdefault(module_name, []).append((part, a, b * scale))
    return {
        module_name: _stack(modules, module_name, pieces, dtype)
        for module_name, pieces in fused.items()
    }


def _check_config(config: dict[str, object], name: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, False):
            raise ValueError(f"adapter {name!r}: {key}={config[key]!r} is not supported")


def _scale(config: dict[str, object], rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))  # type: ignore[arg-type]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read_parts(path: Path, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The checkpoint's target module names (as the base checkpoint names them) -> (A, B)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        target = key.removesuffix(".lora_A.weight")
        b = tensors.get(f"{target}.lora_B.weight")
        if b is None:
            raise ValueError(f"adapter {name!r}: {target!r} has lora_A and no lora_B")
        parts[target.removeprefix(_PEFT_PREFIX)] = (a, b)
    if len(parts) * 2 != len(tensors):
        raise ValueError(f"adapter {name!r}: tensors other than lora_A and lora_B weights")
    return parts


def _stack(
    modules: dict[str, torch.nn.Module],
    module_name: str,
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of one fused linear: A's stacked [sum r, K], B block-diagonal [N, sum r]."""
    linear = modules[module_name]
    assert isinstance(linear, Linear)
    sizes = _part_sizes(modules, module_name, linear)
    offsets = [sum(sizes[:index]) for index in range(len(sizes))]
    weight = linear.weight
    rank = sum(a.shape[0] for _, a, _ in pieces)
    a_all = torch.cat([a for _, a, _ in pieces]).to(weight.device, dtype)
    b_all = torch.zeros(linear.out_features, rank, dtype=dtype, device=weight.device)
    column = 0
    for part, a, b in pieces:
        if tuple(b.shape) != (sizes[part], a.shape[0]) or a.shape[1] != linear.in_features:
            raise ValueError(f"{module_name}: LoRA shapes {tuple(a.shape)}, {tuple(b.shape)}")
        b_all[offsets[part] : offsets[part] + sizes[part], column : column + a.shape[0]] = b
        column += a.shape[0]
    return a_all, b_all


def _part_sizes(modules: dict[str, torch.nn.Module], module_name: str, linear: Linear) -> list[int]:
    """The output columns of each part of a fused linear (one part for the others)."""
    owner = modules[module_name.rpartition(".")[0]]
    if isinstance(owner, Attention) and linear is owner.qkv_proj:
        shape = owner.shape
        return [shape.q_size, shape.kv_size, shape.kv_size]
    if isinstance(owner, MLP) and linear is owner.gate_up_proj:
        return [owner.intermediate_size, owner.intermediate_size]
    return [linear.out_features]
