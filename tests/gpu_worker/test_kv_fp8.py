"""`--kv-cache-dtype fp8`: the paged KV cache holds each key and value as one FP8 E4M3 byte
(x / scale saturated to +-448; scale 1, or each layer's calibrated scales from a compressed-tensors
checkpoint's `kv_cache_scheme`), and attention reads them back. Checked against transformers whose
attention sees every key and value rounded through E4M3 the same way: token for token with
logprobs within 1e-4 in fp32 under chunked prefill, the prefix cache and preemption, and within
the bf16 tolerance in bf16 on the CPU kernels and on the torch backend."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.batcher.test_e2e import BLOCK_SIZE, GREEDY_LOGPROBS, STOPPING, make_engine, mixed_prompts
from tests.gpu_worker.test_compressed import ACTIVATION_LOGPROB_TOL
from tests.gpu_worker.test_parity import assert_matches, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.gpu_worker.loader import KV_SCALE_NAMES
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels.interface import UNIT_SCALES, KvScales
from tgq.kernels.kv_write import FP8_CACHE_DTYPES, to_fp8

ATTENTION, EAGER_ATTENTION = "fp8_kv_sdpa", "fp8_kv_eager"
# GQA with a sliding window, and soft caps (Gemma 2: its own attention path).
VARIANTS = ("mistral-window", "gemma2-capped-window")


def _register_reference_attention() -> None:
    """transformers' own attention over keys and values rounded through E4M3 first: SDPA with
    its masks (sliding windows included), or Gemma 2's eager attention (its soft caps), which
    SDPA cannot do."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    def rounded(forward: Any) -> Any:
        def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
            scales = getattr(module, "kv_scales", UNIT_SCALES)  # `scaled_reference_model`'s
            fp8 = getattr(module, "kv_dtype", torch.float8_e4m3fn)
            key, value = (
                to_fp8(t, scale, fp8).to(t.dtype) * scale
                for t, scale in ((key, scales.k), (value, scales.v))
            )
            return forward(module, query, key, value, *args, **kw)

        return attention

    for name, forward, mask in (
        (ATTENTION, sdpa_attention_forward, sdpa_mask),
        (EAGER_ATTENTION, eager_attention_forward, eager_mask),
    ):
        AttentionInterface.register(name, rounded(forward))
        AttentionMaskInterface.register(name, mask)


def reference_model(
    model_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype = torch.float8_e4m3fn
) -> Any:
    """transformers over keys and values rounded through `kv_dtype` at scale 1."""
    return scaled_reference_model(model_dir, dtype, (UNIT_SCALES,) * 2, kv_dtype)


@functools.cache
def reference_output(
    model_dir: Path, prompt: tuple[int, ...], num_new: int, kv_dtype: torch.dtype
) -> Any:
    """Each prompt's reference once: the prefix-cache and preemption runs repeat them."""
    model = reference_model(model_dir, torch.float32, kv_dtype)
    return generate_greedy(model, list(prompt), num_new)


def kv_scales(engine: LLMEngine) -> tuple[KvScales, ...] | None:
    assert isinstance(engine.runner, ModelRunner)
    return engine.runner.kv_scales


def cache_dtypes(engine: Any) -> set[torch.dtype]:
    return {t.dtype for pair in engine.runner.kv_caches for t in pair}


KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# E4M3 on both variants; E5M2 on the windowed one (its reading differs only in the byte decoding).
@pytest.mark.parametrize(
    ("variant", "kv"), [(v, "fp8") for v in VARIANTS] + [("mistral-window", "fp8_e5m2")]
)
def test_fp32_is_transformers_over_fp8_keys_and_values(
    variant: str, kv: str, model_dirs: dict[str, Path]
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, and through a pool
    small enough to preempt; E4M3 (`fp8`) and E5M2 caches."""
    model_dir, batch, kv_dtype = model_dirs[variant], mixed_prompts(), KV_DTYPES[kv]

    def run(engine: Any) -> Any:
        assert cache_dtypes(engine) == {kv_dtype}
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        for ours in results:
            prompt, num_new = tuple(ours.prompt_token_ids), len(ours.token_ids)
            assert_matches(ours, reference_output(model_dir, prompt, num_new, kv_dtype))
        return results

    engine = make_engine(
        model_dir, kv_cache_dtype=kv, max_batch_prefill_tokens=16, max_batch_size=16
    )
    run(engine)
    again = run(engine)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    tight = make_engine(
        model_dir, 24, kv_cache_dtype=kv, max_batch_prefill_tokens=64, max_batch_size=32
    )
    run(tight)
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("variant", ["llama3-gqa", "gemma2-capped-window"])
@pytest.mark.parametrize("custom_kernels", [True, False], ids=["cpu", "torch"])
def test_bf16_is_within_the_bf16_tolerance(
    variant: str, custom_kernels: bool, model_dirs: dict[str, Path]
) -> None:
    """The CPU backend (its kernels where they read FP8 caches) and the torch backend."""
    model_dir = model_dirs[variant]
    run_in_bf16(model_dir, "fp8", custom_kernels, reference_model(model_dir, torch.bfloat16))


def run_in_bf16(
    model_dir: Path, kv_cache_dtype: str, custom_kernels: bool, reference: Any
) -> ModelRunner:
    """Mixed prompts at 16 tokens a step, the model in bf16 with an FP8 cache, on the CPU
    backend or torch's: within the bf16 tolerance of `reference`. Returns the runner."""
    config = RunnerConfig(
        str(model_dir), dtype="bfloat16", num_blocks=512, block_size=BLOCK_SIZE,
        kv_cache_dtype=kv_cache_dtype, custom_kernels=custom_kernels,
    )  # fmt: skip
    runner = ModelRunner(config)
    engine = LLMEngine(
        runner,
        SchedulerConfig(max_batch_prefill_tokens=16, max_batch_size=16),
        model=runner.model_config,
    )
    assert runner.backend.name == ("cpu" if custom_kernels else "torch")
    assert cache_dtypes(engine) == {runner.kv_dtype} and runner.kv_dtype in FP8_CACHE_DTYPES
    results = engine.generate(mixed_prompts(), GREEDY_LOGPROBS, STOPPING)
    engine.scheduler.kv.check_integrity()
    assert_within_tolerance(model_dir, results, reference)
    return runner


def test_an_fp8_cache_holds_twice_the_blocks_of_bf16(model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs["llama3-gqa"])
    sizes = {}
    for kv in ("auto", "fp8"):
        config = RunnerConfig(
            model_dir, dtype="bfloat16", kv_cache_bytes=64 << 20, kv_cache_dtype=kv
        )
        sizes[kv] = ModelRunner(config).num_blocks
    assert sizes["fp8"] == 2 * sizes["auto"]
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16' is not supported"):
        ModelRunner(RunnerConfig(model_dir, num_blocks=8, kv_cache_dtype="fp16"))


# Calibrated scales (a compressed-tensors checkpoint's `kv_cache_scheme`): per layer, not powers
# of two (so every value rounds differently than at scale 1); layer 1's are coarse, so its small
# keys and values fall to E4M3's subnormals or zero.
LAYER_SCALES = tuple(
    KvScales(*(float(torch.tensor(x, dtype=torch.float32)) for x in pair))  # as stored
    for pair in ((0.0037, 0.0051), (0.9, 0.6))
)
KV_CACHE_SCHEME = {  # as llm-compressor writes it
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
    "group_size": None,
}  # fmt: skip


def with_kv_scales(model_dir: Path, out: Path, names: tuple[str, str] = KV_SCALE_NAMES[0]) -> Path:
    """`model_dir`'s checkpoint with `LAYER_SCALES` stored as compressed-tensors stores them
    (one-element fp32 tensors under `names`, a `kv_cache_scheme` beside the checkpoint's own
    compressed-tensors scheme, or alone with no weight groups)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    section = config.get("quantization_config") or {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
    }
    config["quantization_config"] = {**section, "kv_cache_scheme": KV_CACHE_SCHEME}
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    for index, scales in enumerate(LAYER_SCALES):
        for name, value in zip(names, (scales.k, scales.v), strict=True):
            tensors[f"model.layers.{index}.{name}"] = torch.tensor([value])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@functools.cache
def scaled_reference_model(
    model_dir: Path,
    dtype: torch.dtype,
    scales: tuple[KvScales, ...] | None = None,
    kv_dtype: torch.dtype = torch.float8_e4m3fn,
) -> Any:
    """transformers' model of `model_dir` whose attention rounds keys and values through
    `kv_dtype` at each layer's `scales` (default `LAYER_SCALES`; the checkpoint's own config
    keeps transformers from quantizing)."""
    from transformers import AutoModelForCausalLM

    _register_reference_attention()
    eager = "gemma2" in model_dir.name
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=EAGER_ATTENTION if eager else ATTENTION
    )
    model.generation_config.eos_token_id = None
    for layer, layer_scales in zip(model.model.layers, scales or LAYER_SCALES, strict=True):
        layer.self_attn.kv_scales = layer_scales
        layer.self_attn.kv_dtype = kv_dtype
    return model.eval()


@pytest.mark.parametrize("names", KV_SCALE_NAMES, ids=["attention", "projections"])
def test_a_checkpoints_calibrated_scales_are_read_and_applied(
    names: tuple[str, str], model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """fp32, the torch path (fp32 queries): token for token with transformers over keys and
    values rounded at each layer's scale, mixed prompts at 16 tokens a step and again from the
    prefix cache; unlike the same weights at scale 1."""
    model_dir = model_dirs["mistral-window"]
    scaled = with_kv_scales(model_dir, tmp_path / "scaled", names)
    reference = scaled_reference_model(model_dir, torch.float32)
    engine = make_engine(
        scaled, kv_cache_dtype="fp8", max_batch_prefill_tokens=16, max_batch_size=16
    )
    assert kv_scales(engine) == LAYER_SCALES
    batch = mixed_prompts()[:12]
    for _ in range(2):
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        for ours in results:
            assert_matches(
                ours, generate_greedy(reference, ours.prompt_token_ids, len(ours.token_ids))
            )
    assert sum(r.num_cached_tokens for r in results) > 0
    unit = make_engine(model_dir, kv_cache_dtype="fp8").generate(batch, GREEDY_LOGPROBS, STOPPING)
    drift = max(
        abs(a - b)
        for ours, theirs in zip(results, unit, strict=True)
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=False)
        if a is not None and b is not None
    )
    assert drift > 1e-3


@pytest.mark.parametrize("custom_kernels", [True, False], ids=["cpu", "torch"])
def test_calibrated_scales_in_bf16_are_within_the_bf16_tolerance(
    custom_kernels: bool, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The CPU kernels (decode and prefill read the scales: heads of 32, which their FP8 reading
    serves) and the torch backend."""
    model_dir = model_dirs["qwen3-qknorm"]
    scaled = with_kv_scales(model_dir, tmp_path / "scaled")
    reference = scaled_reference_model(model_dir, torch.bfloat16)
    assert run_in_bf16(scaled, "fp8", custom_kernels, reference).kv_scales == LAYER_SCALES


def test_scales_are_unused_beside_a_cache_of_the_models_dtype(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`--kv-cache-dtype auto` keeps the model's dtype: the checkpoint's scales change nothing."""
    model_dir = model_dirs["llama3-gqa"]
    scaled = make_engine(with_kv_scales(model_dir, tmp_path / "scaled"))
    assert kv_scales(scaled) is None and cache_dtypes(scaled) == {torch.float32}
    batch = mixed_prompts()[:8]
    ours = scaled.generate(batch, GREEDY_LOGPROBS, STOPPING)
    plain = make_engine(model_dir).generate(batch, GREEDY_LOGPROBS, STOPPING)
    assert [(r.token_ids, r.logprobs) for r in ours] == [(r.token_ids, r.logprobs) for r in plain]


def test_missing_or_bad_scales_are_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = with_kv_scales(model_dirs["llama3-gqa"], tmp_path / "scaled")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.self_attn.v_scale"
    for value, message in (
        (None, f"checkpoint declares a kv_cache_scheme but has no tensor {name!r}"),
        (
            torch.tensor([0.0]),
            f"checkpoint tensor {name!r} is not one finite scale > 0 (shape (1,))",
        ),
        (torch.ones(2), f"checkpoint tensor {name!r} is not one finite scale > 0 (shape (2,))"),
    ):
        changed = {k: v for k, v in tensors.items() if k != name}
        if value is not None:
            changed[name] = value
        save_file(changed, model_dir / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError) as caught:
            ModelRunner(RunnerConfig(str(model_dir), num_blocks=8, kv_cache_dtype="fp8"))
        assert str(caught.value) == message


def test_calibrated_scales_beside_fp8_weights_and_inputs(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An FP8-dynamic checkpoint written by compressed-tensors, plus KV-cache scales: both load;
    fp32, within the quantized-inputs tolerance of transformers running the checkpoint with
    keys and values rounded at each layer's scale."""
    weights = write_compressed(model_dirs["llama3-gqa"], tmp_path / "fp8", "FP8_DYNAMIC")
    engine = make_engine(
        with_kv_scales(weights, tmp_path / "fp8-kv"), kv_cache_dtype="fp8",
        max_batch_prefill_tokens=16, max_batch_size=16,
    )  # fmt: skip
    assert kv_scales(engine) == LAYER_SCALES
    assert engine.runner.loaded.quantize == "compressed-tensors"  # type: ignore[attr-defined]
    results = engine.generate(mixed_prompts()[:12], GREEDY_LOGPROBS, STOPPING)
    reference = scaled_reference_model(weights, torch.float32)
    assert_within_tolerance(weights, results, reference, ACTIVATION_LOGPROB_TOL)


@pytest.mark.parametrize("custom_kernels", [True, False], ids=["cpu", "torch"])
def test_e5m2_in_bf16_is_within_the_bf16_tolerance(
    custom_kernels: bool, model_dirs: dict[str, Path]
) -> None:
    """The CPU kernels (heads of 32: their decode and prefill read E5M2) and the torch backend."""
    model_dir = model_dirs["qwen3-qknorm"]
    reference = reference_model(model_dir, torch.bfloat16, torch.float8_e5m2)
    assert run_in_bf16(model_dir, "fp8_e5m2", custom_kernels, reference).kv_dtype == (
        torch.float8_e5m2
    )
