"""LoRA adapters (`gpu_worker.lora`): greedy output through the engine equals transformers with
the PEFT adapter merged (`merge_and_unload`), token for token, with four adapters and the base
model mixed in one batch; one prompt's KV is never shared between adapters."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.batcher.test_e2e import NUM_NEW as BF16_NUM_NEW
from tests.batcher.test_speculation import drafting
from tests.gpu_worker.lora_adapters import ATTENTION, MLP, merged_model, write_adapter
from tests.gpu_worker.test_parity import (
    GREEDY_WITH_LOGPROBS,
    NUM_NEW,
    generate_greedy,
    prompts,
)
from tests.gpu_worker.test_parity_bf16 import assert_within_tolerance
from tests.quantized_mode import as_reference
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.offline import OfflineEngine
from tgq.batcher.request import StoppingParams
from tgq.devtools.random_lora import write_random_adapter as write_random_adapter_without_peft
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

pytest.importorskip("peft")

# name -> (rank, alpha, use_rslora, targets): ranks up to 64, some parts of a fused linear only
ADAPTERS: dict[str, tuple[int, int, bool, tuple[str, ...]]] = {
    "r4-all": (4, 8, False, ATTENTION + MLP),
    "r8-qv-up": (8, 16, False, ("q_proj", "v_proj", "up_proj")),
    "r16-rslora": (16, 32, True, ATTENTION + MLP),
    "r64-mlp": (64, 16, False, (*MLP, "o_proj")),
}


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny random Llama and four random PEFT adapters for it, saved by peft."""
    root = tmp_path_factory.mktemp("lora")
    base = write_model(root / "base", make_config("LlamaForCausalLM"), seed=7)
    adapters = {
        name: write_adapter(
            base, root / name, rank=rank, alpha=alpha, targets=targets, use_rslora=rslora, seed=seed
        )
        for seed, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items())
    }
    return base, adapters


@functools.cache
def _merged(base: Path, adapter: Path | None, quantize: str | None) -> Any:
    """`quantize`: the adapter over the base's weights as tgq's `--quantize` holds them (the
    adapter's terms stay unquantized, as in tgq)."""
    return merged_model(base, adapter, functools.partial(as_reference, method=quantize))


def reference(
    base: Path,
    adapters: dict[str, Path],
    name: str | None,
    prompt: list[int],
    quantize: str | None = None,
) -> Any:
    model = _merged(base, None if name is None else adapters[name], quantize)
    return generate_greedy(model, prompt).token_ids


def lora_engine(
    base: Path, adapters: dict[str, Path], quantize: str | None = None
) -> OfflineEngine:
    config = RunnerConfig(
        str(base),
        num_blocks=256,
        block_size=16,
        quantize=quantize,
        lora_adapters=tuple((name, str(path)) for name, path in adapters.items()),
    )
    return OfflineEngine(ModelRunner(config))


@pytest.mark.parametrize(("chunk_size", "quantize"), [(None, None), (7, None), (None, "int8")])
def test_four_adapters_and_the_base_in_one_batch_equal_merged_peft(
    lora_model: tuple[Path, dict[str, Path]], chunk_size: int | None, quantize: str | None
) -> None:
    base, adapters = lora_model
    names: list[str | None] = [None, *ADAPTERS]
    batch = prompts(2 * len(names), 512, 5, (5, 40))
    chosen = [names[index % len(names)] for index in range(len(batch))]
    results = lora_engine(base, adapters, quantize).generate(
        batch, max_new_tokens=NUM_NEW, chunk_size=chunk_size, adapters=chosen
    )
    for result, prompt, name in zip(results, batch, chosen, strict=True):
        assert result.token_ids == reference(base, adapters, name, prompt, quantize), name


def test_one_prompt_on_two_adapters_shares_no_kv(
    lora_model: tuple[Path, dict[str, Path]],
) -> None:
    base, adapters = lora_model
    engine = lora_engine(base, adapters)
    [prompt] = prompts(1, 512, 6, (40, 40))  # two full blocks before the last token
    [first] = engine.generate([prompt], max_new_tokens=NUM_NEW, adapters=["r4-all"])
    names: list[str | None] = ["r8-qv-up", None, "r4-all"]
    results = engine.generate([prompt] * 3, max_new_tokens=NUM_NEW, adapters=names)
    assert [r.num_cached_tokens for r in results] == [0, 0, 32]
    assert first.token_ids == results[2].token_ids
    assert results[0].token_ids != results[1].token_ids  # else these adapters show nothing
    for result, name in zip(results, names, strict=True):
        assert result.token_ids == reference(base, adapters, name, prompt), name
    engine.engine.scheduler.check_integrity()


def test_an_unknown_adapter_is_rejected_and_the_engine_goes_on(
    lora_model: tuple[Path, dict[str, Path]],
) -> None:
    base, adapters = lora_model
    engine = lora_engine(base, adapters)
    [prompt] = prompts(1, 512, 7, (8, 8))
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        engine.generate([prompt], max_new_tokens=2, adapters=["nope"])
    [result] = engine.generate([prompt], max_new_tokens=NUM_NEW, adapters=["r64-mlp"])
    assert result.token_ids == reference(base, adapters, "r64-mlp", prompt)


def test_bf16_on_the_cpu_kernels_is_what_merged_peft_would_pick(
    lora_model: tuple[Path, dict[str, Path]],
) -> None:
    """bf16 (packed linears and recorded decode steps where this CPU has the kernels): each
    token within bf16's tolerance of transformers' bf16 model with the adapter merged,
    teacher-forced (tests/gpu_worker/test_parity_bf16.py); base rows alone run as without
    adapters, bit for bit."""
    base, adapters = lora_model
    names: list[str | None] = [None, *ADAPTERS]
    batch = prompts(2 * len(names), 512, 8, (5, 40))
    chosen = [names[index % len(names)] for index in range(len(batch))]

    def bf16_engine(served: dict[str, Path]) -> OfflineEngine:
        config = RunnerConfig(
            str(base), dtype="bfloat16", num_blocks=256, block_size=16,
            lora_adapters=tuple((name, str(path)) for name, path in served.items()),
        )  # fmt: skip
        return OfflineEngine(ModelRunner(config))

    engine = bf16_engine(adapters)
    results = engine.generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=BF16_NUM_NEW, adapters=chosen
    )
    for result, name in zip(results, chosen, strict=True):
        adapter = None if name is None else adapters[name]
        reference_model = merged_model(base, adapter).to(torch.bfloat16)
        assert_within_tolerance(base, [result], reference_model)
    assert isinstance(engine.runner, ModelRunner)
    replay = engine.runner.loaded.model.replay
    if replay is not None:  # decode steps with adapter rows replayed too (the slots an input)
        assert not replay.refusals
        keys = cast(list[tuple[int, object, int]], replay.keys)
        assert any(num_inputs == 1 for _, _, num_inputs in keys)
    base_only = engine.generate(batch, GREEDY_WITH_LOGPROBS, max_new_tokens=BF16_NUM_NEW)
    plain = bf16_engine({}).generate(batch, GREEDY_WITH_LOGPROBS, max_new_tokens=BF16_NUM_NEW)
    assert [(r.token_ids, r.logprobs) for r in base_only] == [
        (r.token_ids, r.logprobs) for r in plain
    ]


def test_the_devtools_adapter_is_peft_format(lora_model: tuple[Path, dict[str, Path]]) -> None:
    """`devtools.random_lora` (the benchmark's adapters, written without peft) loads in peft,
    and tgq's output with it equals transformers with it merged."""
    base, _ = lora_model
    path = write_random_adapter_without_peft(base, base.parent / "devtools-r8", rank=8, std=0.05)
    adapters = {"devtools": path}
    [prompt] = prompts(1, 512, 9, (20, 20))
    [result] = lora_engine(base, adapters).generate(
        [prompt], max_new_tokens=NUM_NEW, adapters=["devtools"]
    )
    assert result.token_ids == reference(base, adapters, "devtools", prompt)


def test_speculation_verifies_drafts_under_each_rows_adapter(
    lora_model: tuple[Path, dict[str, Path]],
) -> None:
    """n-gram drafts every step (prompts that repeat themselves), verified on the adapter rows
    of their sequence: the same tokens as merged peft."""
    base, adapters = lora_model
    names: list[str | None] = [None, *ADAPTERS]
    patterns = prompts(len(names), 512, 10, (6, 6))
    batch = [pattern * 4 for pattern in patterns]
    runner = lora_engine(base, adapters).runner
    assert isinstance(runner, ModelRunner)
    config = SchedulerConfig(speculate=3, speculative_max_batch_tokens=4096)
    engine = drafting(LLMEngine(runner, config, model=runner.model_config))
    stopping = StoppingParams(max_new_tokens=NUM_NEW)
    results = engine.generate(batch, stopping=stopping, adapters=names)
    assert engine.scheduler.speculation is not None
    assert engine.scheduler.speculation.stats.num_proposed > 0
    for result, prompt, name in zip(results, batch, names, strict=True):
        assert result.token_ids == reference(base, adapters, name, prompt), name
