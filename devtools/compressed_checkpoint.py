"""compressed-tensors checkpoints written by the real `compressed-tensors` library from a float
checkpoint, as llm-compressor writes them: the scheme applied to every Linear but the lm_head,
weight scales from each weight's min and max (llm-compressor's default observer, through the
library's `calculate_qparams`), static input scales from the inputs of a calibration pass, then
the library's compressor and its config. Tests and benchmarks load them with tgq and with
transformers (which runs them through the library's own forward).

    python -m tgq.devtools.compressed_checkpoint MODEL_DIR OUT_DIR FP8_DYNAMIC
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch

# The library's preset schemes tgq runs (W4A16: int4 in groups of 128, `pack-quantized`), and
# weight-only schemes of its own arguments: 8-bit per channel, 4-bit in groups of 32 (small
# models' inputs), symmetric or with zero points.
SCHEMES = (
    "FP8_DYNAMIC",
    "FP8",
    "W8A8",
    "W4A16",
    "FP8_WEIGHT_ONLY",
    "INT8_WEIGHT_ONLY",
    "INT4_G32",
    "INT4_G32_ASYM",
)
CALIBRATION_TOKENS = 64


def scheme_for(name: str) -> Any:
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    if name.endswith("_WEIGHT_ONLY"):
        kind = "float" if name.startswith("FP8") else "int"
        weights = QuantizationArgs(num_bits=8, type=kind, strategy="channel", symmetric=True)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    if name.startswith("INT4_G32"):
        weights = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=32, symmetric="ASYM" not in name
        )
        return QuantizationScheme(targets=["Linear"], weights=weights)
    return preset_name_to_scheme(name, ["Linear"])


def _weight_qparams(w: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's scales and zero points from its min and max per channel, group or tensor."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        groups = w.reshape(w.shape[0], -1, args.group_size)
        return calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)  # [N, G]
    if args.strategy == "channel":
        return calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    return calculate_qparams(w.amin(), w.amax(), args)


def write_compressed(model_dir: Path, out_dir: Path, scheme_name: str) -> Path:
    """`model_dir`'s model in `scheme_name` (one of SCHEMES) saved to `out_dir` with its
    tokenizer files, in the checkpoint's dtype (the scales too, as llm-compressor keeps them);
    returns `out_dir`. An `out_dir` with weights already is taken as written."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    input_amax = _calibrate(model)
    config = QuantizationConfig(
        config_groups={"group_0": scheme_for(scheme_name)}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or not hasattr(module, "weight_scale"):
                continue
            scale, zero = _weight_qparams(module.weight, scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if not scheme.weights.symmetric:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            inputs = scheme.input_activations
            if inputs is not None and not inputs.dynamic:
                amax = input_amax[name]
                scale, _ = calculate_qparams(-amax, amax, inputs)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
    # Weight-only int8 would be packed into int32 words by default ("pack-quantized"): stored
    # as int8 values instead, the format tgq's 8-bit kernel takes as it is.
    fmt = "int-quantized" if scheme_name == "INT8_WEIGHT_ONLY" else None
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, out_dir / path.name)
    return out_dir


def _calibrate(model: Any) -> dict[str, torch.Tensor]:
    """Each Linear's largest |input| over a pass of a fixed token sequence."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
            value = args[0].detach().abs().amax()
            amax[name] = torch.maximum(amax.get(name, value), value)

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    vocab = model.config.vocab_size
    ids = torch.arange(CALIBRATION_TOKENS)[None] * 7919 % vocab
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return amax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("scheme", choices=SCHEMES)
    args = parser.parse_args()
    print(write_compressed(args.model_dir, args.out_dir, args.scheme))


if __name__ == "__main__":
    main()
