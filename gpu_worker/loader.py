"""Build a model from a checkpoint directory or hub id, straight into its target dtype.

Parameters are created on the meta device, allocated once (`to_empty`) in the target dtype on the
target device, and filled tensor by tensor from the memory-mapped safetensors files, so the
model's weights exist exactly once in memory (the files stay in the page cache, shared).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.config import ModelConfig, resolve_dtype
from gpu_worker.models import model_class
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.weights import Checkpoint, resolve_model_dir

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: DecoderForCausalLM
    config: ModelConfig
    model_dir: Path
    dtype: torch.dtype


def load_model(
    model_id: str,
    *,
    device: torch.device,
    dtype: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    cpu_kernels: bool = True,
) -> LoadedModel:
    """`cpu_kernels=False` keeps bf16 on CPU on plain torch ops (for comparisons)."""
    model_dir = resolve_model_dir(model_id, revision=revision, cache_dir=cache_dir)
    config = ModelConfig.from_dir(model_dir)
    cls = model_class(config)
    torch_dtype = _DTYPES[resolve_dtype(dtype, config.dtype, device.type)]
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.to(device)
    with Checkpoint.open(model_dir) as checkpoint:
        fill_parameters(model, checkpoint)
    model.eval().requires_grad_(False)
    num_fast = model.use_cpu_kernels() if cpu_kernels else 0
    log.info(
        "loaded %s (%s) as %s on %s (%d modules on the AVX2 bf16 kernels)",
        model_id,
        config.architecture,
        torch_dtype,
        device,
        num_fast,
    )
    return LoadedModel(model, config, model_dir, torch_dtype)


def fill_parameters(model: DecoderForCausalLM, checkpoint: Checkpoint) -> None:
    """Copy every parameter's checkpoint tensors into it; a missing tensor is an error."""
    params = dict(model.named_parameters(remove_duplicate=True))
    for name, sources in model.checkpoint_sources().items():
        param = params[name]
        for source in sources:
            if not checkpoint.has(source.name):
                raise ValueError(f"checkpoint has no tensor {source.name!r} (needed for {name})")
            rows = param.shape[0] if source.rows is None else source.rows
            checkpoint.copy_into(source.name, param.data.narrow(0, source.row_offset, rows))
