"""Quantized checkpoints tgq cannot run are refused with the method they use, before any weight is
read: by their config.json's `quantization_config`, or, without one, by weights stored as float8
or integers (read from the safetensors headers). The batcher exits with the message. (The
compressed-tensors schemes tgq runs, and its refusals of the others: test_compressed.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.quantization import QuantizedCheckpointError, quantization_method
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
FP8_MESSAGE = (
    "quantized checkpoints are not supported yet: this one uses quant_method 'fp8'"
    " (config.json quantization_config)"
)


def quantized_copy(source: Path, target: Path, section: dict[str, Any], key: str) -> Path:
    """`source` with `section` as config.json's `key`, and weights that are not a safetensors
    file at all: a load that read them would fail otherwise than with the refusal."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, key: section}))
    (target / "model.safetensors").write_bytes(b"\xff" * 64)
    return target


@pytest.mark.parametrize(
    ("section", "key", "method"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
         "quantization_config", "fp8"),
        ({"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4}}},
         "quantization_config", "hqq"),
        ({"quant_method": "eetq", "weights": "int8"}, "quantization_config", "eetq"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
         "quantization_config", "bitsandbytes"),
        ({"load_in_8bit": True}, "quantization_config", "bitsandbytes"),  # before quant_method
        ({"format": "int-quantized"}, "compression_config", "unknown (compression_config without"
                                                            " quant_method)"),
    ],
)  # fmt: skip
def test_a_quantization_config_is_refused_naming_its_method(
    section: dict[str, Any], key: str, method: str, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    model_dir = quantized_copy(model_dirs["llama3-gqa"], tmp_path / "quantized", section, key)
    assert quantization_method({key: section}) == method
    with pytest.raises(QuantizedCheckpointError) as caught:
        ModelRunner(RunnerConfig(str(model_dir), num_blocks=8))
    assert str(caught.value) == (
        f"quantized checkpoints are not supported yet: this one uses quant_method {method!r}"
        f" (config.json {key})"
    )


def test_an_unquantized_config_names_no_method(model_dirs: dict[str, Path]) -> None:
    config = json.loads((model_dirs["llama3-gqa"] / "config.json").read_text())
    assert quantization_method(config) is None


@pytest.mark.parametrize(
    ("dtype", "stored"), [(torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")]
)
def test_quantized_weights_without_a_config_are_refused(
    dtype: torch.dtype, stored: str, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    """As FP8 checkpoints store them: each projection's weight in float8 (or int8), its scale
    beside it, and config.json silent about it."""
    model_dir = tmp_path / "fp8"
    shutil.copytree(model_dirs["llama3-gqa"], model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    projections = [name for name in tensors if name.endswith("proj.weight")]
    for name in projections:
        tensors[f"{name}_scale"] = tensors[name].abs().amax().reshape(1).float()
        tensors[name] = tensors[name].clamp(-1, 1).to(dtype)
    save_file(tensors, model_dir / "model.safetensors")
    first = sorted(projections)[0]
    with pytest.raises(QuantizedCheckpointError) as caught:
        load_model(str(model_dir), device=CPU)
    assert str(caught.value) == (
        f"quantized checkpoints are not supported yet: tensor {first!r} is stored as {stored}"
        f" ({len(projections)} weights are not float16, bfloat16 or float32); scale tensors"
        f" such as '{first}_scale' are stored beside it"
    )


def test_the_batcher_exits_with_the_message(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    section = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    model_dir = quantized_copy(
        model_dirs["llama3-gqa"], tmp_path / "fp8", section, "quantization_config"
    )
    done = subprocess.run(
        [sys.executable, "-m", "tgq.batcher", "--model-id", str(model_dir),
         "--redis-prefix", "test-quantized"],
        check=False, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"batcher: {FP8_MESSAGE}"
