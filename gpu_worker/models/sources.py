"""Where each parameter of a Llama-family decoder comes from in a Hugging Face checkpoint.

Our fused modules (`qkv_proj`, `gate_up_proj`) are filled from several checkpoint tensors, and
with tensor parallelism (`gpu_worker.parallel`) each rank reads its slice: column-parallel
modules their rows, row-parallel ones their columns (their bias on rank 0 only, so that the
all-reduce adds it once), the embedding and head their vocabulary range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.parallel import TensorParallel


@dataclass(frozen=True, slots=True)
class Source:
    """Fill rows `[row_offset, row_offset + rows)` of a parameter from a checkpoint tensor,
    or from its slice `[start:stop]` along `dim`; `zero`: fill them with zeros instead (a
    row-parallel bias lives on rank 0 only, so that the all-reduce adds it once)."""

    name: str
    row_offset: int = 0
    rows: int | None = None  # None: the whole parameter
    dim: int = 0
    start: int = 0
    stop: int | None = None  # None: the end of `dim`
    zero: bool = False


def decoder_sources(
    model: nn.Module,
    config: ModelConfig,
    tp: TensorParallel,
    *,
    fused: bool = False,
    rename: Callable[[str], str] = str,
) -> dict[str, list[Source]]:
    """`model`'s parameter name -> the checkpoint tensors (this rank's slices) that fill it;
    `config` is the whole model's. Each MLP (dense, an expert, a shared expert) is sliced by its
    own intermediate size, read off the parameter. `fused`: the checkpoint stores q/k/v as one
    `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3), each part at its offset in the whole
    model's tensor. `rename`: our checkpoint-side name -> the family's (Mixtral's `w1`...)."""
    local = tp.local_config(config)
    head_dim = config.head_dim
    q_local, kv_local = local.num_heads * head_dim, local.num_kv_heads * head_dim
    q_start = tp.rank * q_local
    kv_start = tp.first_kv_head(config.num_kv_heads) * head_dim
    vocab_start, vocab_stop = tp.vocab_range(config.vocab_size)
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim

    # (checkpoint module, row offset in ours, rows, first stored row)
    def column_parts(module: str, rows: int) -> list[tuple[str, int, int, int]]:
        if module == "qkv_proj":
            parts = [
                ("q_proj", 0, q_local, q_start, 0),
                ("k_proj", q_local, kv_local, kv_start, q_size),
                ("v_proj", q_local + kv_local, kv_local, kv_start, q_size + kv_size),
            ]
        else:  # gate_up_proj: this rank's slice of the MLP's intermediate size, twice
            inter = rows // 2
            whole = inter * tp.world_size
            start = tp.rank * inter
            parts = [("gate_proj", 0, inter, start, 0), ("up_proj", inter, inter, start, whole)]
        # fused: each part's rows sit after the whole model's rows of the parts before it
        return [
            (module if fused else part, offset, size, first + (base if fused else 0))
            for part, offset, size, first, base in parts
        ]

    sources: dict[str, list[Source]] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        module_path, _, leaf = name.rpartition(".")
        prefix, _, module = module_path.rpartition(".")
        if module in ("qkv_proj", "gate_up_proj"):
            sources[name] = [
                Source(f"{prefix}.{part}.{leaf}", offset, rows, 0, first, first + rows)
                for part, offset, rows, first in column_parts(module, param.shape[0])
            ]
        elif module in ("o_proj", "down_proj") and leaf == "weight":
            size = param.shape[1]  # this rank's columns
            first = q_start if module == "o_proj" else tp.rank * size
            sources[name] = [Source(name, dim=1, start=first, stop=first + size)]
        elif module in ("o_proj", "down_proj"):  # a bias: added once, after the all-reduce
            sources[name] = [Source(name, zero=not tp.is_first)]
        elif module_path in ("model.embed_tokens", "lm_head"):
            rows = vocab_stop - vocab_start  # the last rank's padding rows stay zeros
            sources[name] = [Source(name, 0, rows, 0, vocab_start, vocab_stop)]
        else:
            sources[name] = [Source(name)]
    return {
        name: [dataclasses.replace(source, name=rename(source.name)) for source in parts]
        for name, parts in sources.items()
    }
