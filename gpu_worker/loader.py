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

from tgq.gpu_worker.compressed import load_compressed
from tgq.gpu_worker.config import ModelConfig, resolve_dtype
from tgq.gpu_worker.grouped import load_grouped
from tgq.gpu_worker.hub import resolve_model_dir
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.layers.moe import SparseMoE
from tgq.gpu_worker.models import model_class
from tgq.gpu_worker.models.decoder import DecoderForCausalLM
from tgq.gpu_worker.models.sources import Source
from tgq.gpu_worker.parallel import ROW_PARALLEL_LINEARS, SINGLE, TensorParallel
from tgq.gpu_worker.quantization import (
    CompressedScheme,
    GroupedScheme,
    check_quantize,
    check_stored_quantization,
    declares_kv_scales,
    refuse_quantized_checkpoint,
    stored_method,
)
from tgq.gpu_worker.weights import Checkpoint
from tgq.kernels.interface import KvScales

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: DecoderForCausalLM
    config: ModelConfig  # the whole model's
    model_dir: Path
    dtype: torch.dtype
    tp: TensorParallel = SINGLE
    num_cpu_kernel_modules: int = 0  # modules on the C++ CPU kernels (0: plain torch ops)
    # "int8" or "fp8": the linears quantized at load; "compressed-tensors", "gptq", "awq": stored
    quantize: str | None = None
    # A checkpoint's calibrated FP8 KV-cache scales, one per layer (`read_kv_scales`); None: none
    kv_scales: tuple[KvScales, ...] | None = None

    @property
    def local_config(self) -> ModelConfig:
        """The shapes this rank holds (its KV heads size its KV cache)."""
        return self.tp.local_config(self.config)


def load_model(
    model_id: str,
    *,
    device: torch.device,
    dtype: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    cpu_kernels: bool = True,
    greedy_head: bool = True,
    tp: TensorParallel = SINGLE,
    quantize: str | None = None,
) -> LoadedModel:
    """`cpu_kernels=False` keeps bf16 on CPU on plain torch ops (for comparisons);
    `greedy_head=False` computes every row's logits (`DecoderForCausalLM.use_cpu_kernels`);
    `quantize` ("int8" or "fp8", `quantization.QUANTIZE_METHODS`) quantizes the linears once
    (`quantize_linears`); a quantized checkpoint's linears load as stored: 8-bit
    compressed-tensors ones by `compressed.load_compressed`, GPTQ, AWQ and `pack-quantized` ones
    by `grouped.load_grouped`.
    With `tp`, the rank's slice of the model: only that slice of each tensor is read from the
    files."""
    model_dir = resolve_model_dir(model_id, revision=revision, cache_dir=cache_dir)
    scheme = refuse_quantized_checkpoint(model_dir)  # config.json and headers: no weight read
    check_stored_quantization(scheme, quantize, tp.world_size)
    config = ModelConfig.from_dir(model_dir)
    cls = model_class(config)
    torch_dtype = _DTYPES[resolve_dtype(dtype, config.dtype, device.type)]
    tp.check(config)
    with torch.device("meta"):
        model = cls(config, tp)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.to(device)
    if model.local_rotary is not None:
        model.local_rotary.to(device)
    with Checkpoint.open(model_dir, rename=cls.stored_name) as checkpoint:
        sources = model.checkpoint_sources()
        held: set[str] = set()
        if isinstance(scheme, GroupedScheme):
            held = load_grouped(quantizable_linears(model), sources, checkpoint, scheme)
        fill_parameters(model, checkpoint, sources, skip=held)
        if isinstance(scheme, CompressedScheme):
            load_compressed(quantizable_linears(model), sources, checkpoint, scheme)
        if scheme is not None:
            quantize = stored_method(scheme)
        kv_scales = read_kv_scales(checkpoint, config) if declares_kv_scales(model_dir) else None
    model.eval().requires_grad_(False)
    if quantize is not None and scheme is None:
        check_quantize(quantize)
        quantize_linears(model, quantize, tp)
    num_fast = model.use_cpu_kernels(greedy_head=greedy_head) if cpu_kernels else 0
    log.info(
        "loaded %s (%s) as %s%s on %s, rank %d of %d: weights %.1f MiB (%d modules on the CPU"
        " kernels)",
        model_id,
        config.architecture,
        torch_dtype,
        f" with {quantize} linears" if quantize else "",
        device,
        tp.rank,
        tp.world_size,
        weight_bytes(model) / 2**20,
        num_fast,
    )
    return LoadedModel(model, config, model_dir, torch_dtype, tp, num_fast, quantize, kv_scales)


# Where a compressed-tensors checkpoint stores each layer's KV-cache scales: on the attention
# module (llm-compressor today), or as the k/v projections' output scales (its older releases).
KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
)


def read_kv_scales(checkpoint: Checkpoint, config: ModelConfig) -> tuple[KvScales, ...]:
    """Each layer's calibrated FP8 KV-cache scales (a stored byte stands for its E4M3 value times
    the scale), or a ValueError naming the tensor that is missing or not one finite scale > 0."""
    scales = []
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        names = next(
            (pair for pair in KV_SCALE_NAMES if checkpoint.has(prefix + pair[0])),
            KV_SCALE_NAMES[0],
        )
        values = []
        for name in (prefix + names[0], prefix + names[1]):
            if not checkpoint.has(name):
                raise ValueError(
                    f"checkpoint declares a kv_cache_scheme but has no tensor {name!r}"
                )
            tensor = checkpoint.get(name, torch.float32)
            value = float(tensor.reshape(-1)[0]) if tensor.numel() == 1 else float("nan")
            if not 0.0 < value < float("inf"):
                raise ValueError(
                    f"checkpoint tensor {name!r} is not one finite scale > 0 (shape"
                    f" {tuple(tensor.shape)})"
                )
            values.append(value)
        scales.append(KvScales(*values))
    return tuple(scales)


def quantize_linears(model: DecoderForCausalLM, method: str, tp: TensorParallel = SINGLE) -> int:
    """The decoder layers' linears as 8-bit weights (`method` "int8" or "fp8") with a scale per
    output row (`Linear.quantize`). Returns the layers quantized. On several ranks a
    row-parallel linear's rows are split along K: each row's largest magnitude is taken over
    every rank's part (an all-reduce), so each rank holds its slice of what one process would
    quantize, scales and values alike."""
    linears = quantizable_linears(model)
    for name, module in linears.items():
        amax = None
        if tp.world_size > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL_LINEARS:
            amax = tp.all_reduce_max_(module.weight.detach().float().abs().amax(dim=1))
        module.quantize(method, amax)
    return len(linears)


def quantizable_linears(model: DecoderForCausalLM) -> dict[str, Linear]:
    """The decoder layers' linears by name: not the lm_head or the experts' routers, which keep
    their dtype (the head has its own int8 screen for greedy rows; routing stays exact)."""
    kept: set[int] = {id(model.lm_head)}
    for block in model.modules():
        if isinstance(block, SparseMoE):
            kept.update(id(gate) for gate in (block.gate, block.shared_expert_gate) if gate)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and id(module) not in kept
    }


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held (shared tensors once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def fill_parameters(
    model: DecoderForCausalLM,
    checkpoint: Checkpoint,
    sources_by_name: dict[str, list[Source]],
    skip: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Copy every parameter's checkpoint tensors (`sources_by_name`, the model's
    `checkpoint_sources`) into it, but those named in `skip` (held already); a missing tensor is
    an error."""
    params = dict(model.named_parameters(remove_duplicate=True))
    for name, sources in sources_by_name.items():
        if name in skip:
            continue
        param = params[name]
        covered = sum(param.shape[0] if s.rows is None else s.rows for s in sources)
        if covered < param.shape[0]:  # a vocabulary shard's padding rows
            param.data.zero_()
        for source in sources:
            rows = param.shape[0] if source.rows is None else source.rows
            out = param.data.narrow(0, source.row_offset, rows)
            if source.zero:
                out.zero_()
                continue
            if not checkpoint.has(source.name):
                raise ValueError(f"checkpoint has no tensor {source.name!r} (needed for {name})")
            checkpoint.copy_into(
                source.name, out, dim=source.dim, start=source.start, stop=source.stop
            )
