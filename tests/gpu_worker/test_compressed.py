"""compressed-tensors checkpoints, written by the real `compressed-tensors` library on this CPU
(`devtools.compressed_checkpoint`): tgq's 8-bit weights are the library's own decompression bit
for bit, and its input quantization the library's own, value for value; generation matches
transformers running the checkpoint through the library's forward token for token in fp32, under
chunked prefill, the prefix cache and preemption (logprobs within 1e-4) for weight-only schemes,
within ACTIVATION_LOGPROB_TOL where inputs are quantized; and within the bf16 tolerance in bf16 on
the 8-bit kernel and on torch. What tgq cannot run is refused naming it."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.batcher.test_e2e import GREEDY_LOGPROBS, STOPPING, _loaded, make_engine, mixed_prompts
from tests.gpu_worker.test_parity import assert_matches, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tests.kernels.markers import EIGHT_BIT_KERNELS, requires_vnni_w8a8, use_eight_bit_kernel
from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.gpu_worker.layers.activation_quant import ActivationQuant
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.quantization import (
    CompressedScheme,
    QuantArgs,
    QuantizedCheckpointError,
    compressed_scheme,
)

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
# Dense, with q/k/v biases, and with checkpoints that store q/k/v and gate/up fused.
FAMILIES = ("llama3-gqa", "qwen2-bias", "phi3-partial-window")
SCHEMES = ("FP8_DYNAMIC", "FP8", "W8A8", "FP8_WEIGHT_ONLY", "INT8_WEIGHT_ONLY")
# Rounding each input to 8 bits is a step function: where two fp32 computations of the same
# input differ in the last bits (tgq sums (x @ q^T) * scale, the library x @ (q * scale)^T, and
# the attention kernels differ likewise), an element can land on the neighbouring 8-bit value, a
# change of 1/256 of the row's largest value instead of 1e-7; on a random-weight model's near
# ties that can flip a greedy pick. So where inputs are quantized, each token tgq picks must be
# within this of transformers' best, teacher-forced on tgq's tokens, and its logprob within this
# of transformers' (measured: up to 3.5e-3), instead of the same tokens.
ACTIVATION_LOGPROB_TOL = 0.01


@pytest.fixture(scope="module")
def compressed(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("compressed")

    @functools.cache
    def build(variant: str, scheme: str) -> Path:
        return write_compressed(model_dirs[variant], root / f"{variant}-{scheme}", scheme)

    return build


@functools.cache
def transformers_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def stored(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_weights_are_the_librarys_decompression_bit_for_bit(
    scheme: str, compressed: Any
) -> None:
    """Each of qkv_proj's parts (fused by tgq from q/k/v) and each other projection: q * scale
    as tgq holds it equals compressed-tensors' `dequantize` of the stored tensors."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model_dir = compressed("llama3-gqa", scheme)
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    tensors = stored(model_dir)
    loaded = load_model(str(model_dir), device=CPU, dtype="float32")
    assert loaded.quantize == "compressed-tensors"
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Linear)}
    qkv, down = (
        linears["model.layers.0.self_attn.qkv_proj"],
        linears["model.layers.0.mlp.down_proj"],
    )
    assert qkv.weight_scale is not None and down.weight_scale is not None
    ours = qkv.weight.float() * qkv.weight_scale[:, None]
    prefix = "model.layers.0.self_attn"
    parts = [
        dequantize(
            tensors[f"{prefix}.{p}.weight"], tensors[f"{prefix}.{p}.weight_scale"], args=args
        )
        for p in ("q_proj", "k_proj", "v_proj")
    ]
    assert torch.equal(ours, torch.cat(parts))
    name = "model.layers.0.mlp.down_proj"
    theirs = dequantize(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], args=args)
    assert torch.equal(down.weight.float() * down.weight_scale[:, None], theirs)
    assert down.weight.dtype == tensors[f"{name}.weight"].dtype  # held as stored: 8 bits


# Every scheme on these; FP8-dynamic also on soft-capped and mixture-of-experts families (the
# library quantizes their attention and dense linears; experts stored stacked stay float).
CASES = [(s, v) for s in SCHEMES for v in FAMILIES] + [
    ("FP8_DYNAMIC", v) for v in ("gemma2-capped-window", "mixtral-top2", "qwen3moe-top3-norm")
]


@pytest.mark.parametrize(("scheme", "variant"), CASES)
def test_fp32_is_transformers_running_the_checkpoint(
    scheme: str, variant: str, compressed: Any
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, and through a pool
    small enough to preempt: weight-only, the same tokens with logprobs within 1e-4; with
    inputs quantized, within ACTIVATION_LOGPROB_TOL."""
    model_dir, batch = compressed(variant, scheme), mixed_prompts()
    reference = transformers_model(model_dir, torch.float32)

    def run(engine: Any) -> None:
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        if not scheme.endswith("WEIGHT_ONLY"):
            assert_within_tolerance(model_dir, results, reference, ACTIVATION_LOGPROB_TOL)
            return
        for ours in results:
            assert_matches(
                ours, generate_greedy(reference, ours.prompt_token_ids, len(ours.token_ids))
            )

    chunked = make_engine(model_dir, max_batch_prefill_tokens=16, max_batch_size=16)
    model = chunked.runner.loaded.model  # type: ignore[attr-defined]
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.is_quantized]
    assert len(quantized) >= 2 * model.config.num_layers  # attention's at least
    run(chunked)
    run(chunked)  # prefix-cache hits
    tight = make_engine(model_dir, num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    run(tight)
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W8A8", "INT8_WEIGHT_ONLY"])
@pytest.mark.parametrize("kernel", EIGHT_BIT_KERNELS)
def test_bf16_is_within_the_bf16_tolerance_on_the_kernel_and_on_torch(
    scheme: str, kernel: str, compressed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each 8-bit kernel this CPU runs, and torch's path (any CPU). On the avx512 kernel, layers
    whose int8 weights use -128 decode it from its own code (a uint8 packing)."""
    run_in_bf16(scheme, kernel, compressed, monkeypatch)


@requires_vnni_w8a8
def test_int8_w8a8_as_integers_is_within_the_bf16_tolerance(
    compressed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """INT8 W8A8 layers on the VNNI kernel: the codes' products summed exactly in int32."""
    run_in_bf16("W8A8", "vnni", compressed, monkeypatch)


def run_in_bf16(scheme: str, kernel: str, compressed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama3-gqa in `scheme`, bf16, on `kernel` (`use_eight_bit_kernel`): mixed prompts at 16
    tokens a step within the bf16 tolerance of transformers running the checkpoint."""
    use_eight_bit_kernel(kernel, monkeypatch)
    model_dir = compressed("llama3-gqa", scheme)
    _loaded.cache_clear()  # the monkeypatch must reach the load
    engine = make_engine(
        model_dir, dtype="bfloat16", max_batch_prefill_tokens=16, max_batch_size=16
    )
    _loaded.cache_clear()
    model = engine.runner.loaded.model  # type: ignore[attr-defined]
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.is_quantized]
    assert len(linears) == 4 * model.config.num_layers
    if kernel == "vnni":
        assert all(m.on_vnni_kernel for m in linears)
    else:
        assert all(m.matmul.packed == (kernel != "torch") for m in linears)  # type: ignore[attr-defined]
    if kernel == "avx512" and scheme != "FP8_DYNAMIC":  # int8: most layers hold a -128
        assert any(m.weight.dtype == torch.uint8 for m in linears)
    results = engine.generate(mixed_prompts(), GREEDY_LOGPROBS, STOPPING)
    reference = transformers_model(model_dir, torch.bfloat16)
    assert_within_tolerance(model_dir, results, reference)


def test_int8_checkpoints_use_minus_128(compressed: Any) -> None:
    """The library's int8 scale is max |w| / 127.5: a row whose largest weight is negative
    stores -128 (which the test above runs on the kernel)."""
    model_dir = compressed("llama3-gqa", "W8A8")
    loaded = load_model(str(model_dir), device=CPU, dtype="bfloat16", cpu_kernels=False)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear) and m.is_quantized]
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert any(bool((m.weight == -128).any()) for m in linears)


def test_activation_quantization_is_the_librarys_fake_quantize() -> None:
    """Per token (dynamic), per tensor (dynamic) and static, int8 and FP8, in fp32 and bf16:
    the values compressed-tensors' own `forward_quantize` gives a [1, T, K] input."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.quant_config import QuantizationStatus

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=gen) * torch.rand(7, 1, generator=gen) * 5
    x[3] = 0  # an all-zero row: the dtype's epsilon as its scale
    for dtype in (torch.float32, torch.bfloat16):
        for kind, qdtype in (("int", torch.int8), ("float", torch.float8_e4m3fn)):
            for strategy, dynamic in (("token", True), ("tensor", True), ("tensor", False)):
                args = QuantizationArgs(
                    num_bits=8, type=kind, strategy=strategy, symmetric=True, dynamic=dynamic
                )
                module = torch.nn.Module()
                module.quantization_status = QuantizationStatus.FROZEN
                static = torch.tensor([0.021])
                module.input_scale = static
                theirs = forward_quantize(module, x.to(dtype)[None], "input", args)[0]
                ours = ActivationQuant(
                    qdtype, per_token=strategy == "token", static_scale=None if dynamic else static
                )(x.to(dtype))
                assert ours.dtype == dtype
                assert torch.equal(ours, theirs.to(dtype)), (dtype, kind, strategy, dynamic)


def test_config_parsing_names_what_it_cannot_run() -> None:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}

    def section(**group: Any) -> dict[str, Any]:
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], **group}},
        }

    assert compressed_scheme(
        section(weights=weights, input_activations=inputs)
    ) == CompressedScheme(QuantArgs("float", "channel", False), QuantArgs("float", "token", True))
    weight_only = compressed_scheme(section(weights=weights))
    assert isinstance(weight_only, CompressedScheme) and weight_only.activations is None
    # KV-cache scales (static, per tensor, FP8) beside the weights' scheme, or alone
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert compressed_scheme({**section(weights=weights), "kv_cache_scheme": kv}) == weight_only
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": kv}
    assert compressed_scheme(kv_only) is None
    refusals = {
        "weights of 4 bits of type 'int'": section(
            weights={**weights, "num_bits": 4, "type": "int"}
        ),
        "weights quantized per group": section(
            weights={**weights, "strategy": "group", "group_size": 128}
        ),
        "weights quantized per block": section(
            weights={**weights, "strategy": "block", "block_structure": [128, 128]}
        ),
        "asymmetric weights": section(weights={**weights, "symmetric": False}),
        "static per-token inputs": section(
            weights=weights, input_activations={**inputs, "dynamic": False}
        ),
        "quantized output activations": section(weights=weights, output_activations=inputs),
        "pack-quantized weights of 8 bits of type 'float'": {
            **section(weights=weights),
            "format": "pack-quantized",
        },
        "format 'marlin-24'": {**section(weights=weights), "format": "marlin-24"},
        **{
            f"a kv_cache_scheme of {what} (tgq reads FP8 KV caches with a static scale per"
            " tensor)": {**section(weights=weights), "kv_cache_scheme": {**kv, **change}}
            for what, change in (
                ("8 bits of type 'int'", {"type": "int"}),
                ("4 bits of type 'float'", {"num_bits": 4}),
                ("scales per channel", {"strategy": "channel"}),
                ("asymmetric values", {"symmetric": False}),
                ("dynamic scales", {"dynamic": True}),
            )
        },
        "no config_groups": {"quant_method": "compressed-tensors", "format": "float-quantized"},
    }
    for what, config in refusals.items():
        with pytest.raises(QuantizedCheckpointError) as caught:
            compressed_scheme(config)
        assert str(caught.value).endswith(f": this one has {what}"), str(caught.value)


def test_a_quantized_lm_head_and_quantize_on_top_are_refused(
    compressed: Any, tmp_path: Path
) -> None:
    model_dir = tmp_path / "head"
    shutil.copytree(compressed("llama3-gqa", "FP8_DYNAMIC"), model_dir)
    path = model_dir / "model.safetensors"
    tensors = stored(model_dir)
    tensors["lm_head.weight_scale"] = torch.ones(tensors["lm_head.weight"].shape[0], 1)
    from safetensors.torch import save_file

    save_file(tensors, path)
    with pytest.raises(QuantizedCheckpointError, match=r"tensor 'lm_head\.weight_scale' quantizes"):
        load_model(str(model_dir), device=CPU)
    plain = compressed("llama3-gqa", "FP8")
    with pytest.raises(QuantizedCheckpointError, match="is quantized already"):
        load_model(str(plain), device=CPU, quantize="int8")


def test_the_batcher_exits_on_a_compressed_checkpoint_across_ranks(compressed: Any) -> None:
    """Before any rank starts: the ranks would each load it, and tgq keeps it on one."""
    model_dir = compressed("llama3-gqa", "FP8_DYNAMIC")
    done = subprocess.run(
        [sys.executable, "-m", "tgq.batcher", "--model-id", str(model_dir), "--num-shard", "2",
         "--redis-prefix", "test-compressed"],
        check=False, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "batcher: this compressed-tensors checkpoint is quantized already: it loads on one rank"
        " (--num-shard 1) without --quantize"
    )
