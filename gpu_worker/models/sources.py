"""Where each parameter of a Llama-family decoder comes from in a Hugging Face checkpoint.

Our fused modules (`qkv_proj`, `gate_up_proj`) are filled from several checkpoint tensors, and
with tensor parallelism (`gpu_worker.parallel`) each rank reads its slice: column-parallel
modules their rows, row-parallel ones their columns (their bias on rank 0 only, so that the
all-reduce adds it once), the embedding and head their vocabulary range.
"""

from __future__ import annotations

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
    model: nn.Module, config: ModelConfig, tp: TensorParallel, *, fused: bool = False
) -> dict[str, list[Source]]:
    """`model`'s parameter name -> the checkpoint tensors (this rank's slices) that fill it;
    `config` is the whole model's. `fused`: the checkpoint stores q/k/v as one `qkv_proj` and
    gate/up as one `gate_up_proj` (Phi-3), each part at its offset in the whole model's tensor."""
    local = tp.local_config(config)
    head_dim, inter = config.head_dim, local.intermediate_size
    q_local, kv_local = local.num_heads * head_dim, local.num_kv_heads * head_dim
    q_start = tp.rank * q_local
    kv_start = tp.first_kv_head(config.num_kv_heads) * head_dim
    inter_start = tp.rank * inter
    vocab_start, vocab_stop = tp.vocab_range(config.vocab_size)
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    # module -> (checkpoint module, row offset in ours, rows, first stored row)
    column_parallel = {
        "qkv_proj": [
            ("q_proj", 0, q_local, q_start),
            ("k_proj", q_local, kv_local, kv_start),
            ("v_proj", q_local + kv_local, kv_local, kv_start),
        ],
        "gate_up_proj": [
            ("gate_proj", 0, inter, inter_start),
            ("up_proj", inter, inter, inter_start),
        ],
    }
    if fused:  # each part's rows sit after the whole model's rows of the parts before it
        part_starts = {
            "q_proj": 0,
            "k_proj": q_size,
            "v_proj": q_size + kv_size,
            "gate_proj": 0,
            "up_proj": config.intermediate_size,
        }
        column_parallel = {
            module: [
                (module, offset, rows, part_starts[part] + first)
                for part, offset, rows, first in parts
            ]
            for module, parts in column_parallel.items()
        }
    row_parallel = {"o_proj": (q_start, q_local), "down_proj": (inter_start, inter)}
    sources: dict[str, list[Source]] = {}
    for name, _ in model.named_parameters(remove_duplicate=True):
        module_path, _, leaf = name.rpartition(".")
        prefix, _, module = module_path.rpartition(".")
        if module in column_parallel:
            sources[name] = [
                Source(f"{prefix}.{part}.{leaf}", offset, rows, 0, first, first + rows)
                for part, offset, rows, first in column_parallel[module]
            ]
        elif module in row_parallel and leaf == "weight":
            first, size = row_parallel[module]
            sources[name] = [Source(name, dim=1, start=first, stop=first + size)]
        elif module in row_parallel:  # a bias: added once, after the all-reduce
            sources[name] = [Source(name, zero=not tp.is_first)]
        elif module_path in ("model.embed_tokens", "lm_head"):
            rows = vocab_stop - vocab_start  # the last rank's padding rows stay zeros
            sources[name] = [Source(name, 0, rows, 0, vocab_start, vocab_stop)]
        else:
            sources[name] = [Source(name)]
    return sources
