"""Quantization's torch-free parts: `--quantize` (what tgq quantizes at load from a float
checkpoint, `loader.quantize_linears`), and pre-quantized checkpoints, refused before any weight
is read (the batcher's and the api's start-up check them too).

`--quantize int8` and `--quantize fp8`: the decoder layers' linears as 8-bit weights, symmetric,
one fp32 scale per output row (max |w| / 127, rounded half to even to int8; or max |w| / 448,
converted to FP8 E4M3; `layers.linear.quantize_rows`); their output is `(x @ w^T) * scale +
bias`, summed in fp32. Half the bytes of bf16 a decode step streams; the lm_head and MoE routers
keep their dtype.

tgq's layers hold float weights only. A quantized checkpoint stores some weights as float8 or
packed integers next to the scales that give them meaning (`weight_scale`, `scales`, ...);
loading the integers as if they were the weights and ignoring the scales would serve garbage,
so such a checkpoint is refused with the method it uses. Two signs are read: `config.json`'s
`quantization_config` (FP8, AWQ, GPTQ, compressed-tensors, bitsandbytes, ...), and, for
checkpoints without one, a `.weight` tensor whose stored dtype (from the safetensors headers,
no tensor data) is not a float type.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tgq.gpu_worker.hub import weight_files

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors' names
CONFIG_KEYS = ("quantization_config", "compression_config")  # the latter: older compressed-tensors
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


QUANTIZE_METHODS = ("int8", "fp8")  # `--quantize` (TGI's flag; its others are not built yet)


class QuantizeError(ValueError):
    """`--quantize` asks for what tgq cannot do."""


def check_quantize(method: str, world_size: int) -> None:
    """A QuantizeError naming what is wrong with `--quantize method` on `world_size` ranks."""
    if method not in QUANTIZE_METHODS:
        raise QuantizeError(
            f"--quantize {method!r} is not supported (supported: {', '.join(QUANTIZE_METHODS)})"
        )
    if world_size > 1:
        raise QuantizeError(
            f"--quantize {method} runs on one rank only (--num-shard 1), not {world_size}"
        )


class QuantizedCheckpointError(ValueError):
    """The checkpoint is quantized, which tgq cannot run yet."""


def quantization_method(config: Mapping[str, Any]) -> str | None:
    """The quantization method `config.json` declares, or None for an unquantized model."""
    for key in CONFIG_KEYS:
        section = config.get(key)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            return f"unknown ({key} is {section!r})"
        if section.get("quant_method"):
            return str(section["quant_method"])
        if section.get("load_in_4bit") or section.get("load_in_8bit"):
            return "bitsandbytes"  # configs written before quant_method existed
        return f"unknown ({key} without quant_method)"
    return None


def refuse_quantized_config(model_dir: str | Path) -> None:
    """The config check alone (the api has the model's config and tokenizer, not its weights)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    method = quantization_method(config)
    if method is not None:
        key = next(key for key in CONFIG_KEYS if config.get(key) is not None)
        raise QuantizedCheckpointError(
            f"quantized checkpoints are not supported yet: this one uses quant_method {method!r}"
            f" (config.json {key})"
        )


def refuse_quantized_tensors(dtypes: Mapping[str, str]) -> None:
    """`dtypes`: safetensors dtype of each stored tensor, by name. A weight stored as anything
    but a float type is refused, naming the scale tensors stored beside it."""
    weights = [name for name in dtypes if name.endswith("weight")]  # also GPTQ/AWQ's qweight
    quantized = sorted(name for name in weights if dtypes[name] not in FLOAT_DTYPES)
    if not quantized:
        return
    first = quantized[0]
    scales = sorted(name for name in dtypes if "scale" in name.rsplit(".", 1)[-1])
    beside = f"; scale tensors such as {scales[0]!r} are stored beside it" if scales else ""
    raise QuantizedCheckpointError(
        f"quantized checkpoints are not supported yet: tensor {first!r} is stored as"
        f" {dtypes[first]} ({len(quantized)} weights are not float16, bfloat16 or float32)"
        f"{beside}"
    )


def refuse_quantized_checkpoint(model_dir: str | Path) -> None:
    """Both checks on a model directory: its config.json, then its weight files' headers."""
    refuse_quantized_config(model_dir)
    dtypes: dict[str, str] = {}
    for path in weight_files(Path(model_dir)):
        dtypes.update(safetensors_dtypes(path))
    refuse_quantized_tensors(dtypes)


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's stored dtype, from the file's JSON header (8-byte little-endian length,
    then the header; the tensor data is not read)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a safetensors header of {length} bytes is not plausible")
        header: dict[str, Any] = json.loads(f.read(length))
    return {name: str(entry["dtype"]) for name, entry in header.items() if name != "__metadata__"}
