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
does.

Integer weights in groups of input columns, w = (q - zero) * scale with a scale and zero point per
(output row, group) (`GroupedScheme`, read by `gpu_worker.grouped`): GPTQ (4 or 8 bits, with or
without act-order, formats v1 and v2), AWQ (4 bits, GEMM layout) and compressed-tensors'
`pack-quantized` (4 or 8 bits, symmetric or with zero points, per group or channel).

Anything else a checkpoint declares (FP8 blocks, bitsandbytes, AWQ's GEMV layout, GPTQ's Marlin
format, ...) is refused with what it uses. Two signs are read: `config.json`'s
`quantization_config`, and, for checkpoints without one, a `.weight` tensor whose stored dtype
(from the safetensors headers, no tensor data) is not a float type: loading the integers as if
they were the weights and ignoring their scales would serve garbage.
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


def check_quantize(method: str) -> None:
    """A QuantizeError naming what is wrong with `--quantize method` (any number of ranks: each
    quantizes its slice, the row-parallel ones with the whole rows' scales)."""
    if method not in QUANTIZE_METHODS:
        raise QuantizeError(
            f"--quantize {method!r} is not supported (supported: {', '.join(QUANTIZE_METHODS)})"
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


def refuse_quantized_config(model_dir: str | Path) -> StoredScheme | None:
    """The config check alone (the api has the model's config and tokenizer, not its weights):
    None for an unquantized checkpoint, the scheme of a quantized one tgq runs (compressed-tensors,
    GPTQ, AWQ), or a QuantizedCheckpointError naming the method or the part of the scheme it
    cannot run."""
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
    if method in GROUPED_METHODS:
        return grouped_scheme(method, config[key])
    raise QuantizedCheckpointError(
        f"quantized checkpoints are not supported yet: this one uses quant_method {method!r}"
        f" (config.json {key})"
    )


COMPRESSED_TENSORS = "compressed-tensors"


def check_stored_quantization(
    scheme: StoredScheme | None, quantize: str | None, world_size: int
) -> None:
    """A checkpoint stored quantized loads as stored: on one rank, without `--quantize`."""
    if scheme is not None and (quantize is not None or world_size > 1):
        raise QuantizedCheckpointError(
            f"this {stored_method(scheme)} checkpoint is quantized already: it loads on one rank"
            f" (--num-shard 1) without --quantize"
        )


def stored_method(scheme: StoredScheme) -> str:
    """What `/info` and the start-up log call a stored scheme: "compressed-tensors", "gptq",
    "awq"."""
    return COMPRESSED_TENSORS if isinstance(scheme, CompressedScheme) else scheme.method


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


def compressed_scheme(section: Mapping[str, Any]) -> StoredScheme | None:
    """config.json's compressed-tensors section -> the scheme of its linears (None where it
    declares KV-cache scales alone), or a QuantizedCheckpointError saying which part of it tgq
    cannot run."""

    def refuse(what: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(
            "compressed-tensors checkpoints are supported with 8-bit symmetric weights (a scale"
            " per channel or per tensor) and inputs unquantized or 8-bit (dynamic per token or"
            f" per tensor, or static per tensor), or with {PACK_QUANTIZED} 4- or 8-bit weights"
            f" (a scale per group or channel) and unquantized inputs: this one has {what}"
        )

    _check_kv_cache_scheme(section.get("kv_cache_scheme"), refuse)
    if not section.get("config_groups") and section.get("kv_cache_scheme"):
        for key in ("sparsity_config", "transform_config"):
            if section.get(key):
                raise refuse(f"a {key}")
        return None  # KV-cache scales alone: the weights are stored unquantized
    formats = {section.get("format")} | {
        group.get("format") for group in (section.get("config_groups") or {}).values()
    }
    unknown = sorted(str(f) for f in formats - {None} - COMPRESSED_FORMATS - {PACK_QUANTIZED})
    if unknown:
        raise refuse(f"format {unknown[0]!r}")
    if PACK_QUANTIZED in formats:
        if formats - {None, PACK_QUANTIZED}:
            raise refuse(f"formats {sorted(str(f) for f in formats - {None})} together")
        return _packed_scheme(section, refuse)
    for key in ("sparsity_config", "transform_config"):
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


def _check_kv_cache_scheme(scheme: Any, refuse: _Refuse) -> None:
    """A compressed-tensors `kv_cache_scheme` tgq reads: FP8 with one static scale per tensor,
    stored as each attention's `k_scale` and `v_scale` (`declares_kv_scales`)."""
    if not scheme:
        return
    if not isinstance(scheme, Mapping):
        raise refuse(f"a kv_cache_scheme of {scheme!r}")
    what = {
        f"{scheme.get('num_bits')} bits of type {scheme.get('type')!r}": (
            scheme.get("num_bits") != 8 or scheme.get("type") != "float"
        ),
        f"scales per {scheme.get('strategy')}": scheme.get("strategy") != "tensor",
        "asymmetric values": scheme.get("symmetric", True) is not True,
        "dynamic scales": bool(scheme.get("dynamic")),
    }
    for name, refused in what.items():
        if refused:
            raise refuse(
                f"a kv_cache_scheme of {name} (tgq reads FP8 KV caches with a static scale per"
                " tensor)"
            )


def declares_kv_scales(model_dir: str | Path) -> bool:
    """Whether the checkpoint's config.json declares calibrated KV-cache scales (a
    compressed-tensors `kv_cache_scheme`, checked by `refuse_quantized_config`): each attention
    layer's `k_scale` and `v_scale`, which an FP8 cache (`--kv-cache-dtype fp8`) applies."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return False
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    if quantization_method(config) != COMPRESSED_TENSORS:
        return False
    section = next(config[key] for key in CONFIG_KEYS if config.get(key) is not None)
    return bool(section.get("kv_cache_scheme"))


PACK_QUANTIZED = "pack-quantized"


def _packed_scheme(section: Mapping[str, Any], refuse: _Refuse) -> GroupedScheme:
    """A `pack-quantized` checkpoint's one weight-only scheme (`gpu_worker.grouped` reads it)."""
    for key in ("sparsity_config", "transform_config"):
        if section.get(key):
            raise refuse(f"a {key}")
    schemes = set()
    for group in (section.get("config_groups") or {}).values():
        if group.get("input_activations") or group.get("output_activations"):
            raise refuse(f"{PACK_QUANTIZED} weights with quantized activations")
        args = group.get("weights") or {}
        bits, strategy = args.get("num_bits"), args.get("strategy")
        if bits not in (4, 8) or args.get("type") != "int":
            raise refuse(f"{PACK_QUANTIZED} weights of {bits} bits of type {args.get('type')!r}")
        if strategy not in ("group", "channel") or args.get("block_structure"):
            raise refuse(f"{PACK_QUANTIZED} weights quantized per {strategy}")
        group_size = int(args.get("group_size") or -1) if strategy == "group" else -1
        if args.get("actorder") not in (None, "group", "weight", "static"):
            raise refuse(f"weights with actorder {args['actorder']!r}")
        symmetric = bool(args.get("symmetric", True))
        act_order = args.get("actorder") == "group"
        schemes.add(GroupedScheme(COMPRESSED_TENSORS, bits, group_size, symmetric, act_order))
    if len(schemes) != 1:
        raise refuse(f"{len(schemes)} different schemes in its config_groups")
    return schemes.pop()


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


GPTQ, AWQ = "gptq", "awq"
GROUPED_METHODS = (GPTQ, AWQ)
# GPTQ's checkpoint formats: v1 (AutoGPTQ's, what transformers writes) stores each zero point
# minus 1; v2 (GPTQModel's own) stores it as it is.
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


@dataclass(frozen=True, slots=True)
class GroupedScheme:
    """Integer weights quantized in groups of input columns, each group of each output row with
    its own scale and zero point, w = (q - zero) * scale; inputs stay in the model's dtype. GPTQ,
    AWQ (GEMM layout) and compressed-tensors' `pack-quantized` checkpoints
    (`gpu_worker.grouped` reads their tensors)."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int  # 4, or 8 (GPTQ, compressed-tensors)
    group_size: int  # input columns a group; -1: the whole row
    symmetric: bool  # compressed-tensors: zero points stored (asymmetric) or not
    act_order: bool  # the columns' groups come from a stored g_idx (GPTQ's desc_act)
    zero_offset: int = 0  # added to each stored zero point (GPTQ v1: 1)


StoredScheme = CompressedScheme | GroupedScheme


def grouped_scheme(method: str, section: Mapping[str, Any]) -> GroupedScheme:
    """config.json's GPTQ or AWQ `quantization_config` -> the scheme, or a
    QuantizedCheckpointError saying what tgq cannot run."""

    def refuse(what: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(
            f"{method} checkpoints are supported with 4-bit weights ({GPTQ}: 4 or 8 bits) in"
            f" groups, {GPTQ} in its gptq or gptq_v2 format, {AWQ} in its gemm layout with zero"
            f" points: this one has {what}"
        )

    bits = section.get("bits", section.get("w_bit"))
    if bits not in ((4, 8) if method == GPTQ else (4,)):
        raise refuse(f"{bits} bits")
    group_size = section.get("group_size", section.get("q_group_size", -1))
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise refuse(f"group_size {group_size!r}")
    if method == AWQ:
        version = str(section.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"version {version!r}")
        if not section.get("zero_point", True):
            raise refuse("no zero points (zero_point false)")
        return GroupedScheme(AWQ, 4, group_size, symmetric=False, act_order=False)
    fmt = str(section.get("checkpoint_format", "gptq"))
    if fmt not in GPTQ_ZERO_OFFSETS:
        raise refuse(f"checkpoint_format {fmt!r}")
    if section.get("lm_head"):
        raise refuse("a quantized lm_head")
    if section.get("dynamic"):
        raise refuse("per-module overrides (dynamic)")
    return GroupedScheme(
        GPTQ,
        bits,
        group_size,
        symmetric=bool(section.get("sym", True)),
        act_order=bool(section.get("desc_act", False)),
        zero_offset=GPTQ_ZERO_OFFSETS[fmt],
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


def refuse_quantized_checkpoint(model_dir: str | Path) -> StoredScheme | None:
    """Both checks on a model directory: its config.json, then (for a checkpoint that declares
    no scheme tgq runs) its weight files' headers. Returns the stored scheme, if any."""
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
