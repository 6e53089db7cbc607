"""Checkpoints of integer weights in groups (`gpu_worker.grouped`): GPTQ (with and without
act-order, 4 and 8 bits), AWQ (GEMM layout) and compressed-tensors `pack-quantized`.

- Each format's reading equals a decoder written here from the format's description, value by
  value with shifts and masks on Python ints, bit for bit, on random words with odd shapes and
  group sizes; `pack-quantized` checkpoints written by the real compressed-tensors library
  dequantize to the library's own decompression bit for bit.
- Generation in fp32 equals transformers on the same model with each weight replaced by its exact
  dequantized value (GPTQ, AWQ), or running the checkpoint through the library
  (`pack-quantized`), token for token with logprobs within 1e-4, under chunked prefill, the
  prefix cache and preemption; in bf16 within the bf16 tolerance on the 4-bit kernel and on
  torch.
- What tgq cannot run is refused, naming it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.batcher.test_e2e import (
    BLOCK_SIZE,
    GREEDY_LOGPROBS,
    STOPPING,
    _loaded,
    make_engine,
    mixed_prompts,
)
from tests.gpu_worker.test_compressed import stored, transformers_model
from tests.gpu_worker.test_parity import assert_matches, generate_greedy
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tests.kernels.markers import requires_kernels
from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.devtools.grouped_checkpoint import AWQ_ORDER, dequantized_dir, write_grouped
from tgq.gpu_worker.grouped import read_grouped
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.quantization import (
    GroupedScheme,
    QuantizedCheckpointError,
    grouped_scheme,
    refuse_quantized_config,
)
from tgq.gpu_worker.weights import Checkpoint
from tgq.kernels import cpu_ops

CPU = torch.device("cpu")
GROUP = 32  # the tiny models' inputs are 64 and 128 wide


def random_words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """int32 words with every bit random (the sign bit too)."""
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def field(word: int, bits: int, index: int) -> int:
    """Value `index` of a 32-bit word holding 32 // bits values, lowest bits first."""
    return ((word & 0xFFFFFFFF) >> (bits * index)) & ((1 << bits) - 1)


def read(tmp_path: Path, tensors: dict[str, torch.Tensor], scheme: GroupedScheme, k: int) -> Any:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with Checkpoint.open(tmp_path) as checkpoint:
        return read_grouped(checkpoint, "layer.", scheme, k)


@pytest.mark.parametrize(("bits", "n", "k", "group", "v1"), [
    (4, 24, 40, 8, True), (4, 8, 64, 64, False), (8, 12, 36, 12, True), (4, 16, 24, -1, True),
])  # fmt: skip
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reads_as_its_description(
    bits: int, n: int, k: int, group: int, v1: bool, act_order: bool, tmp_path: Path
) -> None:
    """qweight [K / f, N]: w's value (k, n) is field k % f of word (k / f, n); qzeros [G, N / f]:
    zero (g, n) is field n % f of word (g, n / f), plus 1 in format v1; scales [G, N];
    g_idx [K]; w = (q - zero) * scale."""
    gen = torch.Generator().manual_seed(bits * 1000 + k)
    f, size = 32 // bits, k if group == -1 else group
    groups = -(-k // size)
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    tensors = {
        "layer.qweight": random_words((k // f, n), gen),
        "layer.qzeros": random_words((groups, n // f), gen),
        "layer.scales": (torch.randn(groups, n, generator=gen)).half(),
        "layer.g_idx": g_idx.to(torch.int32),
    }
    scheme = GroupedScheme("gptq", bits, group, True, act_order, zero_offset=1 if v1 else 0)
    ours = read(tmp_path, tensors, scheme, k).dequantize()
    qweight, qzeros = tensors["layer.qweight"].tolist(), tensors["layer.qzeros"].tolist()
    scales = tensors["layer.scales"].double()
    for col in range(n):
        for row in range(k):
            g = int(g_idx[row])
            q = field(qweight[row // f][col], bits, row % f)
            zero = field(qzeros[g][col // f], bits, col % f) + (1 if v1 else 0)
            assert ours[col, row].item() == (q - zero) * scales[g, col].item()


@pytest.mark.parametrize(("n", "k", "group"), [(16, 40, 8), (8, 64, 32), (24, 16, -1)])
def test_awq_reads_as_its_description(n: int, k: int, group: int, tmp_path: Path) -> None:
    """qweight [K, N / 8] and qzeros [G, N / 8]: column n is field AWQ_ORDER.index(n % 8) of word
    n / 8 (AutoAWQ's GEMM order 0, 2, 4, 6, 1, 3, 5, 7); scales [G, N]; groups in K's order;
    w = (q - zero) * scale."""
    gen = torch.Generator().manual_seed(k)
    groups = 1 if group == -1 else -(-k // group)
    tensors = {
        "layer.qweight": random_words((k, n // 8), gen),
        "layer.qzeros": random_words((groups, n // 8), gen),
        "layer.scales": torch.randn(groups, n, generator=gen).half(),
    }
    ours = read(tmp_path, tensors, GroupedScheme("awq", 4, group, False, False), k).dequantize()
    qweight, qzeros = tensors["layer.qweight"].tolist(), tensors["layer.qzeros"].tolist()
    for col in range(n):
        where = AWQ_ORDER.index(col % 8)
        for row in range(k):
            g = 0 if group == -1 else row // group
            q = field(qweight[row][col // 8], 4, where)
            zero = field(qzeros[g][col // 8], 4, where)
            expected = (q - zero) * tensors["layer.scales"][g, col].double().item()
            assert ours[col, row].item() == expected


@pytest.mark.parametrize(("bits", "n", "k", "group", "symmetric"), [
    (4, 24, 40, 8, True), (4, 16, 64, 32, False), (8, 12, 36, 12, False), (4, 8, 20, -1, True),
])  # fmt: skip
def test_pack_quantized_reads_as_its_description(
    bits: int, n: int, k: int, group: int, symmetric: bool, tmp_path: Path
) -> None:
    """weight_packed [N, ceil(K / f)]: value (n, k) is field k % f of word (n, k / f), stored
    plus 2^(bits - 1); weight_zero_point [ceil(N / f), G] packed along N the same way (without
    it, zero 2^(bits - 1)); weight_scale [N, G]; w = (q - zero) * scale."""
    gen = torch.Generator().manual_seed(bits * 100 + k)
    f = 32 // bits
    groups = 1 if group == -1 else -(-k // group)
    tensors = {
        "layer.weight_packed": random_words((n, -(-k // f)), gen),
        "layer.weight_scale": torch.randn(n, groups, generator=gen).bfloat16(),
        "layer.weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["layer.weight_zero_point"] = random_words((-(-n // f), groups), gen)
    scheme = GroupedScheme("compressed-tensors", bits, group, symmetric, False)
    ours = read(tmp_path, tensors, scheme, k).dequantize()
    packed = tensors["layer.weight_packed"].tolist()
    for row in range(n):
        for col in range(k):
            g = 0 if group == -1 else col // group
            q = field(packed[row][col // f], bits, col % f)
            zero = 1 << (bits - 1)
            if not symmetric:
                zero = field(int(tensors["layer.weight_zero_point"][row // f, g]), bits, row % f)
            expected = (q - zero) * tensors["layer.weight_scale"][row, g].double().item()
            assert ours[row, col].item() == expected


@pytest.fixture(scope="module")
def checkpoints(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("grouped")

    @functools.cache
    def build(variant: str, fmt: str) -> Path:
        out = root / f"{variant}-{fmt}"
        if fmt.startswith("INT4"):
            return write_compressed(model_dirs[variant], out, fmt)
        return write_grouped(model_dirs[variant], out, fmt, GROUP)

    return build


@pytest.mark.parametrize("scheme", ["INT4_G32", "INT4_G32_ASYM"])
def test_pack_quantized_is_the_librarys_decompression_bit_for_bit(
    scheme: str, checkpoints: Any
) -> None:
    """Each of qkv_proj's parts (fused by tgq from q/k/v) and down_proj, dequantized exactly and
    rounded once to the checkpoint's dtype, equals the library's decompression."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    model_dir = checkpoints("llama3-gqa", scheme)
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    library_scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    tensors = stored(model_dir)
    loaded = load_model(str(model_dir), device=CPU, dtype="float32")
    assert loaded.quantize == "compressed-tensors"
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Linear)}

    def theirs(name: str) -> torch.Tensor:
        state = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(name)}
        return PackedQuantizationCompressor.decompress(state, library_scheme)["weight"]

    prefix = "model.layers.0"
    qkv = linears[f"{prefix}.self_attn.qkv_proj"]
    parts = [theirs(f"{prefix}.self_attn.{p}_proj") for p in "qkv"]
    assert torch.equal(dequantized(qkv).to(parts[0].dtype), torch.cat(parts))
    down = theirs(f"{prefix}.mlp.down_proj")
    assert torch.equal(dequantized(linears[f"{prefix}.mlp.down_proj"]).to(down.dtype), down)
    assert linears[f"{prefix}.mlp.down_proj"].weight.dtype == torch.uint8  # held as 4-bit values


def dequantized(linear: Linear) -> torch.Tensor:
    g, zero, scale = linear.weight_g_idx, linear.weight_zero, linear.weight_scale
    assert g is not None and zero is not None and scale is not None
    zero, scale = zero[:, g], scale[:, g]
    return (linear.weight.float() - zero) * scale


@functools.cache
def dequantized_transformers(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dequantized_dir(model_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


# (format, variant): each format on a family with fused q/k/v in tgq, q/k/v biases, or a
# checkpoint that stores them fused (Phi-3: its qkv_proj's rows split into tgq's parts).
CASES = [
    ("gptq", "llama3-gqa"),
    ("gptq-act-order", "phi3-partial-window"),
    ("awq", "qwen2-bias"),
    ("INT4_G32", "phi3-partial-window"),
]


@pytest.mark.parametrize(("fmt", "variant"), CASES)
def test_fp32_is_transformers_on_the_dequantized_weights(
    fmt: str, variant: str, checkpoints: Any
) -> None:
    """32 mixed prompts at 16 tokens a step, again from the prefix cache, and through a pool small
    enough to preempt: the same tokens, logprobs within 1e-4."""
    model_dir, batch = checkpoints(variant, fmt), mixed_prompts()
    if fmt.startswith("INT4"):
        reference = transformers_model(model_dir, torch.float32)  # the library's own forward
    else:
        reference = dequantized_transformers(model_dir)

    def run(engine: Any) -> Any:
        results = engine.generate(batch, GREEDY_LOGPROBS, STOPPING)
        engine.scheduler.kv.check_integrity()
        for ours in results:
            expected = generate_greedy(reference, ours.prompt_token_ids, len(ours.token_ids))
            assert_matches(ours, expected)
        return results

    engine = make_engine(model_dir, max_batch_prefill_tokens=16, max_batch_size=16)
    assert all(m.is_quantized for m in quantized_linears(engine)) and quantized_linears(engine)
    run(engine)
    again = run(engine)
    assert all(
        r.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for p, r in zip(batch, again, strict=True)
    )
    tight = make_engine(model_dir, num_blocks=24, max_batch_prefill_tokens=64, max_batch_size=32)
    run(tight)
    assert tight.scheduler.num_preemptions > 0


def quantized_linears(engine: Any) -> list[Linear]:
    model = engine.runner.loaded.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.is_grouped]


@pytest.mark.parametrize("fmt", ["gptq-act-order", "awq", "INT4_G32"])
@pytest.mark.parametrize(
    "kernel",
    [pytest.param(True, id="kernel", marks=requires_kernels), pytest.param(False, id="torch")],
)
def test_bf16_is_within_the_bf16_tolerance_on_the_kernel_and_on_torch(
    fmt: str, kernel: bool, checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 4-bit kernels on every CPU that runs the kernels (a failed build fails here; act-order:
    the inputs permuted into group order), torch's path (any CPU) when the kernel is reported
    missing; against transformers on the dequantized weights in bf16."""
    if not kernel:
        monkeypatch.setattr(cpu_ops, "has_int4_linear", lambda: False)
    model_dir = checkpoints("llama3-gqa", fmt)
    _loaded.cache_clear()  # the monkeypatch must reach the load
    engine = make_engine(
        model_dir, dtype="bfloat16", max_batch_prefill_tokens=16, max_batch_size=16
    )
    _loaded.cache_clear()
    linears = quantized_linears(engine)
    assert linears and all(m.on_int4_kernel == kernel for m in linears)
    results = engine.generate(mixed_prompts(), GREEDY_LOGPROBS, STOPPING)
    engine.scheduler.kv.check_integrity()
    from transformers import AutoModelForCausalLM

    reference_dir = dequantized_dir(model_dir) if not fmt.startswith("INT4") else None
    if reference_dir is None:  # the library's decompression as a bf16 model's weights
        reference = transformers_model(model_dir, torch.bfloat16)
    else:
        reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.bfloat16)
        reference.generation_config.eos_token_id = None
    assert_within_tolerance(model_dir, results, reference.eval())


@pytest.mark.parametrize(("section", "message"), [
    ({"bits": 3, "group_size": 128}, "this one has 3 bits"),
    ({"bits": 4, "group_size": 0}, "this one has group_size 0"),
    ({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "this one has checkpoint_format 'marlin'"),
    ({"bits": 4, "group_size": 128, "lm_head": True}, "this one has a quantized lm_head"),
    ({"bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}},
     "this one has per-module overrides (dynamic)"),
])  # fmt: skip
def test_gptq_configs_tgq_cannot_run_are_refused(section: dict[str, Any], message: str) -> None:
    with pytest.raises(QuantizedCheckpointError) as caught:
        grouped_scheme("gptq", section)
    assert str(caught.value).endswith(message)


def test_awq_configs_tgq_cannot_run_are_refused() -> None:
    for section, message in (
        ({"bits": 8, "group_size": 128}, "this one has 8 bits"),
        ({"bits": 4, "group_size": 128, "version": "GEMV"}, "this one has version 'gemv'"),
        ({"bits": 4, "group_size": 128, "zero_point": False}, "no zero points (zero_point false)"),
    ):
        with pytest.raises(QuantizedCheckpointError) as caught:
            grouped_scheme("awq", section)
        assert str(caught.value).endswith(message)
    scheme = grouped_scheme("awq", {"bits": 4, "group_size": 64, "version": "gemm"})
    assert scheme == GroupedScheme("awq", 4, 64, symmetric=False, act_order=False)


def test_a_quantized_lm_head_and_differing_g_idx_are_refused(
    checkpoints: Any, tmp_path: Path
) -> None:
    source = checkpoints("llama3-gqa", "gptq-act-order")
    tensors = stored(source)
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    lm_head = {
        **tensors,
        "lm_head.qweight": tensors["model.layers.0.mlp.down_proj.qweight"].clone(),
    }
    save_file(lm_head, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizedCheckpointError, match=r"tensor 'lm_head\.qweight' quantizes a"):
        load_model(str(tmp_path), device=CPU, dtype="float32")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    shuffled = {**tensors, name: tensors[name].flip(0).contiguous()}
    save_file(shuffled, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizedCheckpointError, match="whose g_idx differ: they share one input"):
        load_model(str(tmp_path), device=CPU, dtype="float32")
    assert isinstance(refuse_quantized_config(source), GroupedScheme)
