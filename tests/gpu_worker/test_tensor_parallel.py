"""Tensor parallelism on CPU (gloo), for real: `ShardedRunner` starts two `gpu_worker.rank`
processes, each loading its slice of the checkpoint, and the scheduler drives them as one
runner. Greedy output equals one process's token for token (fp32) for GQA whose KV heads split
across the ranks, for a single KV head replicated on both, and for Qwen2 (q/k/v biases) with a
vocabulary that does not split evenly and tied embeddings; with `--quantize` (each rank its
slice), and in the quantized mode of tests/quantized_mode.py (TGQ_TEST_QUANTIZE) everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.api.stack import write_text_model
from tests.batcher.test_speculation import drafting
from tests.batcher.test_speculation_model import ReplayOracle
from tests.gpu_worker.test_kv_fp8 import with_kv_scales
from tests.gpu_worker.test_parity import prompts
from tests.quantized_mode import QUANTIZE
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.grammar import GrammarSpec
from tgq.batcher.grammar_compiler import GrammarCompiler
from tgq.batcher.ranks import ShardConfig, ShardedRunner
from tgq.batcher.request import StoppingParams
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.config import ModelConfig, model_eos_token_ids
from tgq.gpu_worker.loader import load_model, weight_bytes
from tgq.gpu_worker.parallel import TensorParallel
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import block_size_rule, cpu_ops

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 96
BLOCK_SIZE = 8
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": make_config("LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "llama-one-kv-head": make_config(
        "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1
    ),
    "qwen2-bias-odd-vocab-tied": make_config(
        "Qwen2ForCausalLM", vocab_size=509, tie_word_embeddings=True
    ),
    # offset norms around each sublayer, GeGLU, soft caps (the logits capped before the gather)
    "gemma2-gqa-capped": make_config(
        "Gemma2ForCausalLM",
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # experts sliced per rank like dense MLPs, the router whole on each; a shared expert and gate
    "qwen2moe-shared": make_config(
        "Qwen2MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2
    ),
    "mixtral-top2": make_config("MixtralForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    # q/k norms per head, top-k of many experts renormalised (norm_topk_prob)
    "qwen3moe-topk-norm": make_config(
        "Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2
    ),
    # offset q/k norms, a rope per layer type
    "gemma3-gqa-local-rope": make_config(
        "Gemma3ForCausalLM",
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        rope_local_base_freq=100.0,
    ),
    # fused q/k/v and gate/up checkpoint tensors, each rank reading its parts' slices; partial
    # rotary; longrope past 32 tokens (sequences that grow past it restart)
    "phi3-fused-gqa-longrope": make_config(
        "Phi3ForCausalLM",
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=32,
        max_position_embeddings=256,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.2, 1.4, 1.6],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
        },
    ),
}


def generate(
    runner: Any, batch: list[list[int]], model_dir: Path
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy, then seeded sampling (rank 0 samples from the gathered logits): the tokens; and
    greedy with the prompts' logprobs (rank 0 scores the gathered logits of every prompt row):
    those logprobs."""
    engine = LLMEngine(runner, model=ModelConfig.from_dir(model_dir))
    stopping = StoppingParams(max_new_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7)
    outputs = [
        *engine.generate(batch, stopping=stopping),
        *engine.generate(batch, seeded, stopping=stopping),
    ]
    scored = engine.generate(batch, SamplingParams(prompt_logprobs=2), stopping=stopping)
    prompt = [[lp for lp in output.prompt_logprobs if lp is not None] for output in scored]
    return [output.token_ids for output in outputs], prompt


Check = Callable[[ModelRunner, ShardedRunner], None]


def one_and_two_ranks(model_dir: Path, check: Check | None = None, **options: Any) -> None:
    """The same prompts on one process and on two ranks, with the same `options` (fields of
    both RunnerConfig and ShardConfig): the same tokens, prompt logprobs within 1e-4; then
    `check(single, sharded)` before the ranks close."""
    batch = prompts(6, 500, 11, (3, 40))
    single = ModelRunner(
        RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **options)
    )
    expected = generate(single, batch, model_dir)
    sharded = ShardedRunner(
        ShardConfig(
            str(model_dir), 2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, threads_per_rank=1,
            **options,
        )
    )  # fmt: skip
    try:
        tokens, prompt_logprobs = generate(sharded, batch, model_dir)
        assert tokens == expected[0]
        for ours, alone in zip(prompt_logprobs, expected[1], strict=True):
            assert ours == pytest.approx(alone, abs=1e-4)
        assert sharded.num_steps > 0
        if check is not None:
            check(single, sharded)
    finally:
        sharded.close()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_ranks_generate_what_one_process_does(name: str, tmp_path: Path) -> None:
    one_and_two_ranks(write_model(tmp_path / name, CONFIGS[name], seed=3), quantize=QUANTIZE)


@pytest.mark.parametrize(("name", "method"), [("llama-gqa", "int8"), ("qwen2moe-shared", "fp8")])
def test_two_ranks_quantize_their_slices_as_one_process_does(
    name: str, method: str, tmp_path: Path
) -> None:
    """`--quantize` on two ranks: each quantizes its slice, the row-parallel o_proj and down_proj
    (an MoE's experts' too) with the whole rows' scales (all-reduced), so the tokens equal one
    quantized process's (fp32; that one is transformers on the dequantized weights,
    tests/gpu_worker/test_quantize.py) and prompt logprobs are within 1e-4. The ranks report
    the method and their weights' bytes."""

    def check(single: ModelRunner, sharded: ShardedRunner) -> None:
        assert sharded.served.quantize == method
        held = sharded.served.weight_bytes
        assert held is not None and held < 0.6 * weight_bytes(single.loaded.model)

    one_and_two_ranks(write_model(tmp_path / name, CONFIGS[name], seed=3), check, quantize=method)


def test_two_ranks_apply_a_checkpoints_kv_cache_scales_as_one_process_does(tmp_path: Path) -> None:
    """An FP8 cache with a checkpoint's calibrated per-layer scales (per tensor: the same on
    each rank, over its KV heads): the tokens equal one process's, prompt logprobs within 1e-4."""
    model_dir = write_model(tmp_path / "llama", CONFIGS["llama-gqa"], seed=3)

    def check(single: ModelRunner, sharded: ShardedRunner) -> None:
        assert single.kv_scales is not None

    one_and_two_ranks(with_kv_scales(model_dir, tmp_path / "scaled"), check, kv_cache_dtype="fp8")


def test_two_ranks_follow_a_grammar_as_one_process_does(tmp_path: Path) -> None:
    """The masks travel to the ranks in the plan (base64 on the pipe); rank 0 samples under
    them: seeded constrained sampling gives the single process's tokens."""
    model_dir = write_text_model(tmp_path / "text")
    tokenizer = (model_dir / "tokenizer.json").read_text()
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6}}}
    )
    batch = prompts(4, 500, 12, (3, 30))
    eos = model_eos_token_ids(str(model_dir))

    def constrained(runner: Any) -> list[list[int]]:
        engine = LLMEngine(runner, None, None, eos, GrammarCompiler(tokenizer, eos))
        sampling = SamplingParams(temperature=1.2, seed=5)
        results = engine.generate(batch, sampling, StoppingParams(40), grammar=spec)
        assert all(r.finish_detail == "grammar complete" for r in results)
        return [r.token_ids for r in results]

    single = ModelRunner(
        RunnerConfig(
            str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, quantize=QUANTIZE
        )
    )
    expected = constrained(single)
    config = ShardConfig(
        str(model_dir), 2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, threads_per_rank=1,
        quantize=QUANTIZE,
    )  # fmt: skip
    sharded = ShardedRunner(config)
    try:
        assert constrained(sharded) == expected
    finally:
        sharded.close()


def test_a_rank_holds_its_slice_of_every_weight(tmp_path: Path) -> None:
    """Column-parallel rows, row-parallel columns and vocabulary rows of rank 1 of 2 are the
    checkpoint's, read without a process group (no collective runs while loading)."""
    model_dir = write_model(tmp_path / "m", CONFIGS["llama-gqa"], seed=3)
    cpu = torch.device("cpu")
    whole: Any = load_model(str(model_dir), device=cpu).model
    half: Any = load_model(str(model_dir), device=cpu, tp=TensorParallel(1, 2)).model
    layer, whole_layer = half.model.layers[0], whole.model.layers[0]
    q_rows, kv_rows = 2 * 16, 1 * 16  # 2 of 4 heads, 1 of 2 KV heads, head_dim 16
    qkv, whole_qkv = layer.self_attn.qkv_proj.weight, whole_layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q_rows], whole_qkv[q_rows : 2 * q_rows])
    assert torch.equal(qkv[q_rows : q_rows + kv_rows], whole_qkv[64 + kv_rows : 64 + 2 * kv_rows])
    o, whole_o = layer.self_attn.o_proj.weight, whole_layer.self_attn.o_proj.weight
    assert torch.equal(o, whole_o[:, q_rows : 2 * q_rows])
    down, whole_down = layer.mlp.down_proj.weight, whole_layer.mlp.down_proj.weight
    assert torch.equal(down, whole_down[:, 64:])
    assert torch.equal(half.lm_head.weight, whole.lm_head.weight[256:])
    num_half = sum(p.numel() for p in half.parameters())
    num_whole = sum(p.numel() for p in whole.parameters())
    assert num_half < 0.52 * num_whole  # only the norms are replicated


def test_a_rank_loading_holds_about_its_slice(tmp_path: Path) -> None:
    """Peak private memory while loading: one rank of two stays near half of what one process
    loading the whole model takes (only its slices are read and allocated)."""
    config = make_config("LlamaForCausalLM", "medium", num_hidden_layers=4, dtype="bfloat16")
    model_dir = write_model(tmp_path / "m", config, dtype=torch.bfloat16)

    def load(rank: int, world_size: int) -> dict[str, int]:
        command = [sys.executable, "-m", "tests.gpu_worker.rank_memory", str(model_dir)]
        done = subprocess.run(
            [*command, str(rank), str(world_size)], cwd=ROOT, capture_output=True, check=True
        )
        measured: dict[str, int] = json.loads(done.stdout)
        return measured

    whole, half = load(0, 1), load(1, 2)
    print(f"peak private MB while loading: whole {whole['peak_anon_bytes'] / 2**20:.0f},"
          f" rank 1 of 2 {half['peak_anon_bytes'] / 2**20:.0f}")  # fmt: skip
    assert whole["peak_anon_bytes"] > 0.9 * whole["param_bytes"]  # the measure sees a load
    assert half["param_bytes"] < 0.51 * whole["param_bytes"]
    assert half["peak_anon_bytes"] < 0.6 * whole["peak_anon_bytes"]


@pytest.mark.parametrize("custom_kernels", [True, False])
def test_ranks_report_their_block_size_and_kernels(custom_kernels: bool, tmp_path: Path) -> None:
    """No block size given: the ranks take their backend's default and the batcher schedules
    with what they report; custom_kernels=False reaches every rank (torch attention, plain
    torch ops)."""
    model_dir = write_model(tmp_path / "m", CONFIGS["llama-gqa"], seed=3)
    config = ShardConfig(
        str(model_dir), 2, dtype="bfloat16", num_blocks=NUM_BLOCKS, threads_per_rank=1,
        custom_kernels=custom_kernels,
    )  # fmt: skip
    sharded = ShardedRunner(config)
    try:
        assert sharded.block_size == block_size_rule(sharded.served.attention).default == 16
        if custom_kernels:
            expected = "cpu" if cpu_ops.is_available() else "torch"
            assert sharded.served.attention == expected
        else:
            assert (sharded.served.attention, sharded.served.num_cpu_kernel_modules) == ("torch", 0)
    finally:
        sharded.close()


STOPPING = StoppingParams(max_new_tokens=12, ignore_eos=True)


def _one_process_outputs(
    tmp_path: Path,
) -> tuple[Path, ModelConfig, list[list[int]], list[SamplingParams], list[list[list[int]]]]:
    """A model, six prompts, greedy and seeded sampling, and one process's outputs of each
    without speculation."""
    model_dir = write_model(tmp_path / "llama", CONFIGS["llama-gqa"], seed=3)
    batch = prompts(6, 500, 11, (3, 40))
    model = ModelConfig.from_dir(model_dir)
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, seed=7)]
    single = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    plain = LLMEngine(single, model=model)
    expected = [[r.token_ids for r in plain.generate(batch, kind, STOPPING)] for kind in kinds]
    return model_dir, model, batch, kinds, expected


def test_two_ranks_verify_drafts_as_one_process_does(tmp_path: Path) -> None:
    """Speculation on two ranks: rank 0 samples every draft's row, both ranks keep the same
    accepted prefix and give back the same blocks; greedy and seeded outputs equal one process's
    without speculation."""
    model_dir, model, batch, kinds, expected = _one_process_outputs(tmp_path)
    oracle = ReplayOracle(seed=3)
    for outputs in expected:
        for prompt, output in zip(batch, outputs, strict=True):
            oracle.learn(prompt, output)
    sharded = ShardedRunner(
        ShardConfig(
            str(model_dir), 2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, threads_per_rank=1
        )
    )
    try:
        config = SchedulerConfig(speculate=3, speculative_max_batch_tokens=64)
        engine = drafting(LLMEngine(sharded, config, model=model, proposer=oracle))
        for kind, outputs in zip(kinds, expected, strict=True):
            assert [r.token_ids for r in engine.generate(batch, kind, STOPPING)] == outputs
        stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
        assert stats.num_accepted > 0 and stats.num_accepted < stats.num_proposed
    finally:
        sharded.close()


def test_two_ranks_verify_a_draft_models_guesses(tmp_path: Path) -> None:
    """`--speculative-model` with `--num-shard 2`: rank 0 runs the whole draft model and sends
    its guesses to rank 1; the target as its own draft guesses every greedy token, and the
    outputs (greedy and seeded) equal one process's without speculation."""
    model_dir, model, batch, kinds, expected = _one_process_outputs(tmp_path)
    sharded = ShardedRunner(
        ShardConfig(
            str(model_dir), 2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, threads_per_rank=1,
            speculative_model=str(model_dir),
        )
    )  # fmt: skip
    try:
        config = SchedulerConfig(
            speculate=3, speculative_method="draft", speculative_max_batch_tokens=64
        )
        engine = drafting(LLMEngine(sharded, config, model=model))
        stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
        for kind, outputs in zip(kinds, expected, strict=True):
            assert [r.token_ids for r in engine.generate(batch, kind, STOPPING)] == outputs
            if kind.is_greedy:  # the same model guesses the same argmax (sampled rows differ)
                assert stats.acceptance_rate > 0.9
    finally:
        sharded.close()
