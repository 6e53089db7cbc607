"""The runner's step contract: seeded sampling whatever the batch, penalties as in HF, plan
validation, and the wire form of a plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.gpu_worker.test_parity import hf_generate
from tests.kernels.markers import requires_kernels
from tgq.batcher.engine import RequestResult
from tgq.batcher.offline import OfflineEngine
from tgq.gpu_worker.layers.moe import FUSED, ONE_BY_ONE, SparseMoE
from tgq.gpu_worker.layers.norm import OffsetRMSNorm, RMSNorm
from tgq.gpu_worker.models import decoder
from tgq.gpu_worker.plan import (
    NewSequence,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    plan_from_wire,
    to_wire,
)
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import block_size_rule, cpu_ops
from tgq.kernels.cpu_paged import CpuPagedAttention
from tgq.kernels.greedy_head import GreedyHead

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5]
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, top_n_logprobs=3)


def engine(model_dir: Path) -> OfflineEngine:
    return OfflineEngine(ModelRunner(RunnerConfig(str(model_dir), num_blocks=128)))


def test_seeded_sampling_ignores_the_rest_of_the_batch(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["llama3-gqa"]
    [alone] = engine(model_dir).generate([PROMPT], SEEDED, max_new_tokens=20)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(),
    ]
    batch = [[3, 4, 5], PROMPT[:4], [*PROMPT, 1, 2], PROMPT]
    mixed = engine(model_dir).generate(batch, [*others, SEEDED], max_new_tokens=20, chunk_size=5)
    assert mixed[-1].token_ids == alone.token_ids
    [reseeded] = engine(model_dir).generate(
        [PROMPT],
        SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1235),
        max_new_tokens=20,
    )
    assert reseeded.token_ids != alone.token_ids


def test_top_logprobs_are_reported_in_order(model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(RunnerConfig(str(model_dirs["qwen2-bias"]), num_blocks=16))
    plan = StepPlan(
        new_sequences=[NewSequence("a", PROMPT, len(PROMPT), SEEDED, [1])],
        chunks=[ScheduledChunk("a", 0, len(PROMPT))],
    )
    [token] = runner.execute(plan).sampled
    assert len(token.top_logprobs) == 3
    values = [t.logprob for t in token.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert token.logprob is not None and token.logprob <= values[0]


def test_greedy_repetition_penalty_matches_transformers(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["mistral-window"]
    params = SamplingParams(repetition_penalty=1.5)
    [ours] = engine(model_dir).generate([PROMPT], params, max_new_tokens=12)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        torch.tensor([PROMPT]),
        do_sample=False,
        max_new_tokens=12,
        repetition_penalty=1.5,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.int64),
        pad_token_id=0,
    )
    assert ours.token_ids == out[0, len(PROMPT) :].tolist()
    assert ours.token_ids != hf_generate(model_dir, PROMPT).token_ids  # the penalty mattered


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (ScheduledChunk("ghost", 0, 1), "chunk for unknown sequence 'ghost'"),
        (ScheduledChunk("a", 0, 10), r"chunk \[0, 10\) is outside its 9 tokens"),
        (ScheduledChunk("a", 0, 0), r"chunk \[0, 0\) is outside its 9 tokens"),
    ],
)
def test_bad_chunks_are_refused(
    model_dirs: dict[str, Path], chunk: ScheduledChunk, message: str
) -> None:
    runner = ModelRunner(RunnerConfig(str(model_dirs["llama3-gqa"]), num_blocks=16))
    new = NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [1])
    with pytest.raises(ValueError, match=message):
        runner.execute(StepPlan(new_sequences=[new], chunks=[chunk]))


@pytest.mark.parametrize(
    ("new", "chunks", "message"),
    [
        (
            NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [0]),
            [ScheduledChunk("a", 0, 9)],
            r"block ids must be in \[1, 16\), got \[0\]",
        ),
        (
            NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [1]),
            [ScheduledChunk("a", 0, 9, [16])],
            r"block ids must be in \[1, 16\), got \[16\]",
        ),
        (
            NewSequence("a", PROMPT, 0, SamplingParams(), [1]),
            [ScheduledChunk("a", 0, 9)],
            "0 prompt tokens out of 9 tokens",
        ),
        (
            NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [1]),
            [ScheduledChunk("a", 0, 4), ScheduledChunk("a", 4, 5)],
            "a sequence is scheduled twice in one step",
        ),
    ],
)
def test_bad_plans_are_refused(
    model_dirs: dict[str, Path], new: NewSequence, chunks: list[ScheduledChunk], message: str
) -> None:
    runner = ModelRunner(RunnerConfig(str(model_dirs["llama3-gqa"]), num_blocks=16))
    with pytest.raises(ValueError, match=message):
        runner.execute(StepPlan(new_sequences=[new], chunks=chunks))


def test_a_refused_plan_changes_nothing(model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(RunnerConfig(str(model_dirs["llama3-gqa"]), num_blocks=16))
    running = NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [1])
    runner.execute(StepPlan(new_sequences=[running], chunks=[ScheduledChunk("a", 0, 9)]))
    bad = StepPlan(
        new_sequences=[NewSequence("b", PROMPT, len(PROMPT), SamplingParams(), [2])],
        chunks=[ScheduledChunk("b", 0, 9), ScheduledChunk("a", 10, 1, [3])],  # "a" has 10 tokens
        finished_request_ids=["a"],
    )
    with pytest.raises(ValueError, match="chunk for unknown sequence 'a'"):
        runner.execute(bad)
    assert set(runner.sequences) == {"a"}  # neither "b" registered nor "a" dropped
    assert runner.sequences["a"].block_ids == [1]
    [token] = runner.execute(StepPlan(chunks=[ScheduledChunk("a", 9, 1, [3])])).sampled
    assert token.request_id == "a"


def test_too_few_blocks_are_refused(model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(RunnerConfig(str(model_dirs["llama3-gqa"]), num_blocks=16, block_size=4))
    new = NewSequence("a", PROMPT, len(PROMPT), SamplingParams(), [1, 2])
    with pytest.raises(ValueError, match="2 blocks cannot hold 9 tokens"):
        runner.execute(StepPlan(new_sequences=[new], chunks=[ScheduledChunk("a", 0, 9)]))


def test_plan_round_trips_through_json() -> None:
    plan = StepPlan(
        new_sequences=[NewSequence("a", PROMPT, 5, SEEDED, [3, 4])],
        chunks=[ScheduledChunk("a", 0, 9), ScheduledChunk("b", 30, 1, [7])],
        finished_request_ids=["c"],
        token_masks={"b": bytes([0xFF, 0x00, 0x81, 0x7F])},
    )
    assert plan_from_wire(json.loads(json.dumps(to_wire(plan)))) == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"typical_p": 1.5}, r"typical_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"top_n_logprobs": -1}, "top_n_logprobs must be >= 0"),
    ],
)
def test_sampling_params_are_validated(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the CPU kernels' MLP
def test_a_long_prefill_through_the_mlp_in_row_passes_is_unchanged(
    dtype: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the MLP runs over a bounded number of rows at a time (its activation stays off
    fresh mmap'd pages); rows are independent, so tokens and logprobs are bit-identical."""
    model_dir = model_dirs["llama3-gqa"]
    prompt = [(17 * i) % 250 + 3 for i in range(40)]

    def generate() -> tuple[list[int], list[float | None]]:
        runner = ModelRunner(RunnerConfig(str(model_dir), dtype=dtype, num_blocks=64))
        sampling = SamplingParams(logprobs=True)
        [out] = OfflineEngine(runner).generate([prompt], sampling, max_new_tokens=3)
        return out.token_ids, out.logprobs

    whole = generate()
    intermediate = json.loads((model_dir / "config.json").read_text())["intermediate_size"]
    monkeypatch.setattr(decoder, "CPU_MLP_PASS_BYTES", 7 * 2 * intermediate * 2)  # 7 bf16 rows
    passes: list[int] = []
    rows = decoder.MLP._rows

    def counted(mlp: decoder.MLP, x: torch.Tensor) -> torch.Tensor:
        passes.append(x.shape[0])
        return rows(mlp, x)

    monkeypatch.setattr(decoder.MLP, "_rows", counted)
    assert generate() == whole
    assert max(passes) < len(prompt) and sum(passes) > len(prompt)  # the prompt went in passes


@requires_kernels
@pytest.mark.parametrize("name", ["llama3-gqa", "llama2-tied-linear"])
def test_greedy_rows_through_the_greedy_head_are_unchanged(
    name: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bf16 on this CPU the rows that need only an argmax (greedy, no penalties, no logprobs)
    take it from the int8-screened head; every row of a mixed batch gets the same tokens and
    logprobs as with the head switched off, and only the argmax-only rows go through it. (Without
    AVX512_BF16 the head holds each row to its logits computed alone, the full head to those of
    its batch: the same tokens unless a row's two best logits sit within the rounding of one
    fp32 sum of each other across a bf16 boundary, which these prompts are not.)"""
    prompts = [PROMPT, PROMPT[:4], [5, 6, 7, 8, 9, 10, 11], PROMPT[2:], [3, 3, 3]]
    params = [
        SamplingParams(),
        SamplingParams(logprobs=True),
        SEEDED,
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),
    ]
    screened_rows: list[int] = []
    argmax = GreedyHead.argmax

    def counted(head: GreedyHead, x: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
        screened_rows.append(x.shape[0])
        return argmax(head, x, masks)

    monkeypatch.setattr(GreedyHead, "argmax", counted)

    def generate(
        batch: list[SamplingParams], screened: bool
    ) -> list[tuple[list[int], list[float | None]]]:
        runner = ModelRunner(RunnerConfig(str(model_dirs[name]), dtype="bfloat16", num_blocks=128))
        model = runner.loaded.model
        assert model.greedy_head is not None
        if not screened:
            model.greedy_head = None
        out = OfflineEngine(runner).generate(prompts[: len(batch)], batch, max_new_tokens=6)
        return [(g.token_ids, g.logprobs) for g in out]

    assert generate(params, screened=True) == generate(params, screened=False)
    assert screened_rows and set(screened_rows) == {2}  # rows 0 and 4, every step
    screened_rows.clear()
    greedy = [SamplingParams()] * 3
    assert generate(greedy, screened=True) == generate(greedy, screened=False)
    assert set(screened_rows) == {3}


@requires_kernels
def test_the_greedy_head_can_be_switched_off(model_dirs: dict[str, Path]) -> None:
    """`RunnerConfig(greedy_head=False)` (the batcher's --no-greedy-head) builds no screen; the
    batcher's flag reaches the runner's config."""
    from tgq.batcher.__main__ import parse_args

    def head(enabled: bool) -> object:
        config = RunnerConfig(
            str(model_dirs["llama3-gqa"]), dtype="bfloat16", num_blocks=8, greedy_head=enabled
        )
        return ModelRunner(config).loaded.model.greedy_head

    assert isinstance(head(True), GreedyHead)
    assert head(False) is None
    assert parse_args(["--model-id", "m"]).greedy_head is True
    assert parse_args(["--model-id", "m", "--no-greedy-head"]).greedy_head is False


@requires_kernels
@pytest.mark.parametrize(
    "name",
    [
        "llama3-gqa",
        "llama2-tied-linear",
        "mistral-window",
        "qwen2-bias",
        "qwen3-qknorm",
        "phi3-partial-window",
        "gemma3-local-rope",  # two ropes: both are inputs of the recording
    ],
)
def test_decode_steps_replayed_from_their_recording_are_unchanged(
    name: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 decode-only steps on the CPU kernels run as the ops recorded from the first step of
    their batch size (kernels.replay; GQA, tied embeddings, a sliding window, qkv bias, q/k
    norms): tokens and logprobs are those of the modules' forward, and steps with prefill
    chunks run the modules."""
    prompts = [PROMPT, PROMPT[:4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    params = [SamplingParams(logprobs=True), SEEDED, SamplingParams()]
    as_python: list[int] = []  # the row count of each step whose layers ran as Python
    layers = decoder.DecoderForCausalLM._layers

    def counted(model: decoder.DecoderForCausalLM, x: torch.Tensor, *args: Any) -> torch.Tensor:
        as_python.append(x.shape[0])
        return layers(model, x, *args)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "_layers", counted)

    def generate(replay: bool) -> list[tuple[list[int], list[float | None]]]:
        runner = ModelRunner(RunnerConfig(str(model_dirs[name]), dtype="bfloat16", num_blocks=128))
        model = runner.loaded.model
        assert model.replay is not None
        # The own decode kernel at every batch size: a batch size whose measured pick here is
        # torch's gather + SDPA is not replayed (see test_choice), which is not this test's
        # subject.
        assert isinstance(runner.backend, CpuPagedAttention)
        runner.backend.decode_choices = None
        if not replay:
            model.replay = None
        out = OfflineEngine(runner).generate(prompts, params, max_new_tokens=12, chunk_size=5)
        if model.replay is not None:  # 9, 4 and 11 tokens, 5 a step: the first steps mix both
            keys = cast(list[tuple[int, object, int]], model.replay.keys)
            assert keys and not model.replay.refusals
            assert {rows for rows, _, _ in keys} <= {1, 2, 3}
        return [(g.token_ids, g.logprobs) for g in out]

    replayed = generate(replay=True)
    steps_replaying = len(as_python)
    assert replayed == generate(replay=False)
    # All three decode together for several steps: one of them ran as Python, to record.
    assert as_python[:steps_replaying].count(3) == 1 and as_python[steps_replaying:].count(3) > 2


@requires_kernels
def test_partial_rotary_rotates_in_torch_not_in_the_fused_kernel(
    model_dirs: dict[str, Path],
) -> None:
    """The CPU kernel `rotary_qk_` rotates whole heads in place on the fused qkv; with partial
    rotary (Phi) the attention modules keep torch's rotation, the other kernels still switch,
    and bf16 greedy tokens follow the fp32 reference's first token."""
    runner = ModelRunner(
        RunnerConfig(str(model_dirs["phi3-partial-window"]), dtype="bfloat16", num_blocks=128)
    )
    attentions = [m for m in runner.loaded.model.modules() if isinstance(m, decoder.Attention)]
    assert attentions and not any(m.use_cpu_kernel or m.has_cpu_kernel for m in attentions)
    mlps = [m for m in runner.loaded.model.modules() if isinstance(m, decoder.MLP)]
    assert all(m.use_cpu_kernel for m in mlps)
    full = ModelRunner(RunnerConfig(str(model_dirs["llama3-gqa"]), dtype="bfloat16", num_blocks=8))
    assert all(
        m.use_cpu_kernel for m in full.loaded.model.modules() if isinstance(m, decoder.Attention)
    )


@requires_kernels
def test_gemma2_runs_on_the_cpu_kernels_and_replays_its_soft_capped_decode_steps(
    model_dirs: dict[str, Path],
) -> None:
    """bf16 Gemma 2 on the CPU kernels: its offset norms on their own kernel, GeGLU on the fused
    activation kernel, its soft-capped decode attention on the own kernel (the cap passed on),
    so decode steps are replayed where this CPU picked the own decode kernel; tokens and
    logprobs are bit-identical to the same steps without replay. Greedy rows keep the greedy
    head (a final cap keeps the argmax)."""

    def generate(replay: bool) -> tuple[ModelRunner, list[RequestResult], list[float]]:
        runner = ModelRunner(
            RunnerConfig(str(model_dirs["gemma2-capped-window"]), dtype="bfloat16", num_blocks=128)
        )
        if not replay:
            runner.loaded.model.replay = None
        caps: list[float] = []
        kernel = cpu_ops.paged_decode_attention

        def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
            caps.append(kwargs["softcap"])
            return kernel(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_ops, "paged_decode_attention", spy)
            out = OfflineEngine(runner).generate(
                [PROMPT, [4, 8, 15, 16, 23, 42]], SamplingParams(logprobs=True), max_new_tokens=6
            )
        return runner, out, caps

    runner, replayed, caps = generate(replay=True)
    model = runner.loaded.model
    mlps = [m for m in model.modules() if isinstance(m, decoder.MLP)]
    assert mlps and all(m.use_cpu_kernel and m.activation == "gelu_pytorch_tanh" for m in mlps)
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, OffsetRMSNorm)]
    assert len(norms) == 4 * 2 + 1 and all(m.use_cpu_kernel for m in norms)
    assert all(m.use_cpu_kernel for m in model.modules() if isinstance(m, decoder.Attention))
    assert model.replay is not None
    assert model.greedy_head is not None
    backend = runner.backend
    assert isinstance(backend, CpuPagedAttention)
    own_decode = not backend._torch_decode(2)
    assert bool(model.replay.keys) == own_decode
    assert set(caps) == ({2.0} if own_decode else set())
    _, plain, _ = generate(replay=False)
    for a, b in zip(replayed, plain, strict=True):
        assert len(a.token_ids) == 6
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@requires_kernels
@pytest.mark.parametrize("family", ["qwen3moe-top3-norm", "mixtral-top2"])
def test_moe_models_run_their_experts_in_one_call_and_replay_decode_steps(
    model_dirs: dict[str, Path], family: str
) -> None:
    """bf16 MoE on the CPU kernels: each expert's linears and SiLU run on the kernels; with
    AVX512_BF16 a decode step can run all experts of a layer in one call (where measured faster;
    here forced), and the steps are replayed (the experts' choice happens inside the call, so
    the recorded ops hold for any tokens). Tokens and logprobs are bit-identical to the experts
    run one by one without replay. Greedy tokens come from the greedy head."""

    def generate(one_by_one: bool) -> tuple[ModelRunner, list[RequestResult]]:
        runner = ModelRunner(
            RunnerConfig(str(model_dirs[family]), dtype="bfloat16", num_blocks=128)
        )
        model = runner.loaded.model
        for moe in model.modules():
            if isinstance(moe, SparseMoE):  # whatever this CPU measured faster
                moe.use_thresholds([(moe.max_fused_tokens(), ONE_BY_ONE if one_by_one else FUSED)])
        if one_by_one:
            model.replay = None
        prompts = [PROMPT, [5, 9, 2, 7, 7, 1], [3] * 11]
        out = OfflineEngine(runner).generate(
            prompts, SamplingParams(logprobs=True), max_new_tokens=6
        )
        return runner, out

    runner, fused = generate(one_by_one=False)
    model = runner.loaded.model
    experts = [m for m in model.modules() if isinstance(m, decoder.MLP)]
    assert experts and all(m.use_cpu_kernel for m in experts)
    assert model.greedy_head is not None
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if cpu_ops.has_avx512_bf16():
        assert all(m.fused_gate_up is not None for m in blocks)
        assert model.experts_choices is not None
        assert {m.rows for m in model.experts_choices.measured} <= {1, 4, 16, 64, 256}
        assert model.replay is not None and model.replay.keys
    else:
        assert all(m.fused_gate_up is None for m in blocks) and model.replay is None
    _, one_by_one = generate(one_by_one=True)
    for a, b in zip(fused, one_by_one, strict=True):
        assert len(a.token_ids) == 6
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_the_block_size_follows_the_attention_backend(model_dirs: dict[str, Path]) -> None:
    """No block size: the backend's default (kernels registry); one it cannot read is refused
    with its rule."""
    model_dir = str(model_dirs["llama3-gqa"])
    runner = ModelRunner(RunnerConfig(model_dir, num_blocks=8))
    assert runner.block_size == block_size_rule(runner.backend.name).default == 16
    assert ModelRunner(RunnerConfig(model_dir, num_blocks=8, block_size=4)).block_size == 4
    with pytest.raises(ValueError) as caught:
        ModelRunner(RunnerConfig(model_dir, num_blocks=8, block_size=0, attention_backend="torch"))
    assert str(caught.value) == (
        "attention backend 'torch' needs a KV block size that is a multiple of 1"
        " (its default: 16), got 0"
    )


_NEVER_BUILT = """
import sys, torch
from tgq.batcher.offline import OfflineEngine
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.gpu_worker.sampling import apply_token_masks
from tgq.kernels import cpu_ops
config = RunnerConfig(sys.argv[1], dtype="bfloat16", num_blocks=16, custom_kernels=False)
out = OfflineEngine(ModelRunner(config)).generate([[5, 6, 7]], max_new_tokens=3)
masked = apply_token_masks(torch.zeros(1, 64), [b"\\x01" + bytes(7)], custom_kernels=False)
assert len(out[0].token_ids) == 3 and int(masked.isfinite().sum()) == 1
print(cpu_ops._library._checked)
"""


def test_custom_kernels_off_never_builds_them(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """With the custom kernels off, a bf16 model loads, decodes greedily and masks a grammar's
    tokens without the C++ kernels ever being built or even looked for (in a fresh process and
    an empty kernel cache)."""
    done = subprocess.run(
        [sys.executable, "-c", _NEVER_BUILT, str(model_dirs["llama3-gqa"])],
        env={**os.environ, "TGQ_KERNEL_CACHE": str(tmp_path / "kernels")},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
    assert not (tmp_path / "kernels").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_custom_kernels_off_runs_plain_torch_ops(dtype: str, model_dirs: dict[str, Path]) -> None:
    """`custom_kernels=False` (--disable-custom-kernels): the torch attention backend, no module
    on the C++ CPU kernels, no greedy head, no decode path; in fp32 (where both paths are
    token-exact with transformers) the same greedy tokens as with the kernels."""
    prompts = [PROMPT, PROMPT[:4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]

    def run(custom_kernels: bool) -> tuple[ModelRunner, list[list[int]]]:
        config = RunnerConfig(
            str(model_dirs["llama3-gqa"]), dtype=dtype, num_blocks=64, custom_kernels=custom_kernels
        )
        runner = ModelRunner(config)
        out = OfflineEngine(runner).generate(prompts, max_new_tokens=12, chunk_size=5)
        return runner, [g.token_ids for g in out]

    (default, tokens), (plain, plain_tokens) = run(True), run(False)
    model = plain.loaded.model
    assert (plain.backend.name, plain.loaded.num_cpu_kernel_modules) == ("torch", 0)
    assert model.greedy_head is None and model.replay is None
    assert default.backend.name == ("cpu" if cpu_ops.is_available() else "torch")
    if dtype == "bfloat16" and cpu_ops.is_available():
        assert default.loaded.num_cpu_kernel_modules > 0
    if dtype == "float32":
        assert plain_tokens == tokens
    with pytest.raises(ValueError, match="custom kernels are disabled"):
        ModelRunner(
            RunnerConfig(
                str(model_dirs["llama3-gqa"]), attention_backend="cpu", custom_kernels=False
            ),
            loaded=plain.loaded,
        )
