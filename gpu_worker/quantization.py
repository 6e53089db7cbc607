"""Quantization's torch-free parts: `--quantize` (what tgq quantizes at load from a float
checkpoint, `loader.quantize_linears`), and pre-quantized checkpoints: the compressed-tensors ones
tgq runs (`compressed_scheme`, loaded by `gpu_worker.compressed`), and the others, refused before
any weight is read (the batcher's and the api's start-up check them too).

`--quantize int8` and `--quantize fp8`: the decoder layers' linears as 8-bit weights, symmetric,
one fp32 scale per output row (max |w| / 127, rounded half to even to int8; or max |w| / 448,
converted to FP8 E4M3; `layers.linear.quantize_rows`); their output is `(x @ w^T) * scale +
bias`, summed in fp32. Half the bytes of bf16 a decode step streams; the lm_head and MoE routers
keep their dtype.

compressed-tensors checkpoints (vLLM's format, written by llm-compressor) with 8-bit symmetric
weights, int8 or FP8 E4M3, one scale per output channel or per tensor, and inputs unquantized or
quantized to 8 bits per token (dynamic) or per tensor (dynamic or static): the stored values and
scales are used as they are, and the inputs quantized and dequantized as the format's own forward
does. Anything else a checkpoint declares (AWQ, GPTQ, FP8 blocks, int4 packing, ...) is refused
with what it uses. Two signs are read: `config.json`'s `quantization_config`, and, for
checkpoints without one, a `.weight` tensor whose stored dtype (from the safetensors headers, no
tensor data) is not a float type: loading the integers as if they were the weights and ignoring
their scales would serve garbage.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


def refuse_quantized_config(model_dir: str | Path) -> CompressedScheme | None:
    """The config check alone (the api has the model's config and tokenizer, not its weights):
    None for an unquantized checkpoint, the scheme of a compressed-tensors one tgq runs, or a
    QuantizedCheckpointError naming the method or the part of the scheme it cannot run."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    method = quantization_method(config)
    if method is None:
        return None
    key = next(key for key in CONFIG_KEYS if config.get(key) is not None)
    if method == COMPRESSED_TENSORS:
        return compressed_scheme(config[key])
    raise QuantizedCheckpointError(
        f"quantized checkpoints are not supported yet: this one uses quant_method {method!r}"
        f" (config.json {key})"
    )


COMPRESSED_TENSORS = "compressed-tensors"


def check_stored_quantization(
    scheme: CompressedScheme | None, quantize: str | None, world_size: int
) -> None:
    """A checkpoint stored quantized loads as stored: on one rank, without `--quantize`."""
    if scheme is not None and (quantize is not None or world_size > 1):
        raise QuantizedCheckpointError(
            f"this {COMPRESSED_TENSORS} checkpoint is quantized already: it loads on one rank"
            f" (--num-shard 1) without --quantize"
        )


# The compressed-tensors formats that store 8-bit values as they are (int8, float8_e4m3fn).
COMPRESSED_FORMATS = frozenset({"float-quantized", "int-quantized", "naive-quantized"})


@dataclass(frozen=True, slots=True)
class QuantArgs:
    """How one kind of tensor of a compressed-tensors scheme is quantized: 8 bits, symmetric."""

    type: Literal["int", "float"]  # int8, or FP8 E4M3
    strategy: Literal["channel", "tensor", "token"]
    dynamic: bool  # scales computed from the values at run time (activations only)


@dataclass(frozen=True, slots=True)
class CompressedScheme:
    """The one scheme of a compressed-tensors checkpoint's quantized linears."""

    weights: QuantArgs
    activations: QuantArgs | None  # None: inputs stay in the model's dtype (weight-only)


def compressed_scheme(section: Mapping[str, Any]) -> CompressedScheme:
    """config.json's compressed-tensors section -> the scheme, or a QuantizedCheckpointError
    saying which part of it tgq cannot run."""

    def refuse(what: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(
            "compressed-tensors checkpoints are supported with 8-bit symmetric weights (a scale"
            " per channel or per tensor) and inputs unquantized or 8-bit (dynamic per token or"
            f" per tensor, or static per tensor): this one has {what}"
        )

    formats = {section.get("format")} | {
        group.get("format") for group in (section.get("config_groups") or {}).values()
    }
    unknown = sorted(str(f) for f in formats - {None} - COMPRESSED_FORMATS)
    if unknown:
        raise refuse(f"format {unknown[0]!r}")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if section.get(key):
            raise refuse(f"a {key}")
    groups = list((section.get("config_groups") or {}).values())
    if not groups:
        raise refuse("no config_groups")
    schemes = {_group_scheme(group, refuse) for group in groups}
    if len(schemes) > 1:
        raise refuse(f"{len(schemes)} different schemes in its config_groups")
    return schemes.pop()


_Refuse = Callable[[str], QuantizedCheckpointError]


def _group_scheme(group: Mapping[str, Any], refuse: _Refuse) -> CompressedScheme:
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    weights = group.get("weights")
    if not weights:
        raise refuse("a group without weights")
    activations = group.get("input_activations")
    return CompressedScheme(
        _quant_args(weights, "weights", ("channel", "tensor"), refuse),
        None
        if not activations
        else _quant_args(activations, "inputs", ("token", "tensor"), refuse),
    )


def _quant_args(
    args: Mapping[str, Any], kind: str, strategies: tuple[str, ...], refuse: _Refuse
) -> QuantArgs:
    if args.get("num_bits") != 8 or args.get("type") not in ("int", "float"):
        raise refuse(f"{kind} of {args.get('num_bits')} bits of type {args.get('type')!r}")
    if not args.get("symmetric", True):
        raise refuse(f"asymmetric {kind}")
    strategy = args.get("strategy")
    if strategy not in strategies or args.get("group_size") or args.get("block_structure"):
        raise refuse(f"{kind} quantized per {strategy}")
    if args.get("actorder"):
        raise refuse(f"{kind} with actorder {args['actorder']!r}")
    dynamic = bool(args.get("dynamic"))
    if kind == "weights" and dynamic:
        raise refuse("dynamic weights")
    if strategy == "token" and not dynamic:
        raise refuse("static per-token inputs")
    return QuantArgs(args["type"], strategy, dynamic)


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


def refuse_quantized_checkpoint(model_dir: str | Path) -> CompressedScheme | None:
    """Both checks on a model directory: its config.json, then (for a checkpoint that declares
    no scheme tgq runs) its weight files' headers. Returns the compressed-tensors scheme, if
    any."""
    scheme = refuse_quantized_config(model_dir)
    if scheme is not None:
        return scheme
    dtypes: dict[str, str] = {}
    for path in weight_files(Path(model_dir)):
        dtypes.update(safetensors_dtypes(path))
    refuse_quantized_tensors(dtypes)
    return None


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's stored dtype, from the file's JSON header (8-byte little-endian length,
    then the header; the tensor data is not read)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a safetensors header of {length} bytes is not plausible")
        header: dict[str, Any] = json.loads(f.read(length))
    return {name: str(entry["dtype"]) for name, entry in header.items() if name != "__metadata__"}
