"""Greedy generation through the paged runner equals transformers `generate`, token for token
(with TGQ_TEST_QUANTIZE, the runner `--quantize`d against transformers on the dequantized weights:
tests/quantized_mode.py)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import VARIANTS
from tests.quantized_mode import QUANTIZE, as_reference
from tgq.batcher.engine import RequestResult
from tgq.batcher.offline import OfflineEngine
from tgq.batcher.request import FinishReason
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

NUM_NEW = 12
LOGPROB_TOL = 1e-4
GREEDY_WITH_LOGPROBS = SamplingParams(logprobs=True)


@functools.cache
def _hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly NUM_NEW tokens
    return as_reference(model.eval())


def hf_generate(model_dir: Path, prompt: list[int], num_new: int = NUM_NEW) -> RequestResult:
    return generate_greedy(_hf_model(model_dir), prompt, num_new)


def generate_greedy(model: Any, prompt: list[int], num_new: int = NUM_NEW) -> RequestResult:
    """A transformers model's greedy `generate` of `num_new` tokens, with their logprobs."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        do_sample=False,
        max_new_tokens=num_new,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs: list[float | None] = [
        torch.log_softmax(step[0].float(), -1)[token].item()
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return RequestResult(
        request_id="transformers",
        prompt_token_ids=prompt,
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=FinishReason.LENGTH,
    )


def engine(model_dir: Path, block_size: int = 16, backend: str = "auto") -> OfflineEngine:
    config = RunnerConfig(
        str(model_dir), num_blocks=128, block_size=block_size, attention_backend=backend,
        quantize=QUANTIZE,
    )  # fmt: skip
    return OfflineEngine(ModelRunner(config))


def prompts(count: int, vocab: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def assert_matches(ours: RequestResult, reference: RequestResult) -> None:
    assert ours.token_ids == reference.token_ids
    torch.testing.assert_close(
        torch.tensor(ours.logprobs), torch.tensor(reference.logprobs), atol=LOGPROB_TOL, rtol=0
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_single_sequence(variant: str, model_dirs: dict[str, Path]) -> None:
    prompt = prompts(1, 512, 1, (21, 21))[0]
    [ours] = engine(model_dirs[variant]).generate(
        [prompt], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW
    )
    assert_matches(ours, hf_generate(model_dirs[variant], prompt))


@pytest.mark.parametrize("backend", ["torch", "auto"])  # the oracle, and what runs here
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batch_of_mixed_lengths(variant: str, backend: str, model_dirs: dict[str, Path]) -> None:
    batch = prompts(8, 512, 2, (1, 40))
    results = engine(model_dirs[variant], backend=backend).generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW
    )
    for ours, prompt in zip(results, batch, strict=True):
        assert_matches(ours, hf_generate(model_dirs[variant], prompt))


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize(
    "variant",
    [
        "llama3-gqa",
        "mistral-window",
        "qwen3-qknorm",
        "gemma2-capped-window",
        "gemma3-local-rope",
        "phi3-partial-window",
        "mixtral-top2",
        "qwen2moe-shared-dense-layer",
        "qwen3moe-top3-norm",
    ],
)
def test_chunked_prefill(variant: str, chunk_size: int, model_dirs: dict[str, Path]) -> None:
    batch = prompts(3, 512, 3, (30, 90))
    results = engine(model_dirs[variant]).generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW, chunk_size=chunk_size
    )
    for ours, prompt in zip(results, batch, strict=True):
        assert_matches(ours, hf_generate(model_dirs[variant], prompt))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefix_blocks_reused(variant: str, model_dirs: dict[str, Path]) -> None:
    shared = prompts(1, 512, 4, (40, 40))[0]
    first, second = [*shared, 7, 8, 9], [*shared, 10, 11]
    eng = engine(model_dirs[variant], block_size=8)
    eng.generate([first], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW)
    [ours] = eng.generate([second], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW)
    assert ours.num_cached_tokens == 40  # five full blocks of the shared prefix
    assert_matches(ours, hf_generate(model_dirs[variant], second))


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_dynamic_rope_past_the_original_length(chunk_size: int | None, tmp_path: Path) -> None:
    """Decoding across `max_position_embeddings` re-bases the rope per token, and a prompt past
    it rotates every token for the prompt's length, as HF does; in chunks alike."""
    config = make_config(
        "LlamaForCausalLM",
        max_position_embeddings=24,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    model_dir = write_model(tmp_path / "dynamic", config)
    batch = [prompts(1, 512, 5, (20, 20))[0], prompts(1, 512, 6, (30, 30))[0]]
    results = engine(model_dir).generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=16, chunk_size=chunk_size
    )
    for ours, prompt in zip(results, batch, strict=True):
        # A fresh reference each time: HF's dynamic rope keeps the longest length it has seen
        # and rotates a later, shorter prompt past the original length for that one.
        _hf_model.cache_clear()
        assert_matches(ours, hf_generate(model_dir, prompt, num_new=16))


LONGROPE: dict[str, Any] = {
    "original_max_position_embeddings": 32,
    "max_position_embeddings": 256,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.5 + 0.5 * i for i in range(8)],
    },
}


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = make_config("Phi3ForCausalLM", **LONGROPE)
    return write_model(tmp_path_factory.mktemp("longrope") / "phi3", config, seed=7)


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_longrope_switches_to_its_long_factors_as_transformers_does(
    chunk_size: int | None, longrope_dir: Path
) -> None:
    """Phi-3's longrope past `original_max_position_embeddings` (32): a prompt past it computes
    every token with the long factors; a sequence that grows past it is computed again, every
    token long (HF's Phi-3 drops its cache there). Both equal transformers token for token,
    batched together, in chunks or not, and the recompute is not a preemption."""
    batch = [prompts(1, 512, 8, (21, 21))[0], prompts(1, 512, 9, (40, 40))[0]]
    results = engine(longrope_dir).generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=24, chunk_size=chunk_size
    )
    for ours, prompt in zip(results, batch, strict=True):
        assert_matches(ours, hf_generate(longrope_dir, prompt, num_new=24))
        assert ours.num_preemptions == 0


def test_longrope_prefix_cache_keeps_short_and_long_keys_apart(longrope_dir: Path) -> None:
    """One prefix rotated with the short factors (a sequence within 32 tokens) and with the long
    ones (past them) is two cache entries: a long prompt never reuses short blocks, and does
    reuse long ones."""
    shared = prompts(1, 512, 10, (24, 24))[0]
    short, long, longer = [*shared, 3, 4], [*shared, *range(5, 21)], [*shared, *range(5, 25)]
    eng = engine(longrope_dir, block_size=8)
    [first] = eng.generate([short], GREEDY_WITH_LOGPROBS, max_new_tokens=4)  # 30 tokens
    assert first.num_cached_tokens == 0
    [second] = eng.generate([long], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW)
    assert second.num_cached_tokens == 0  # the short entries do not serve a long prompt
    assert_matches(second, hf_generate(longrope_dir, long))
    [third] = eng.generate([longer], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW)
    assert third.num_cached_tokens == 40  # the long prompt's five full blocks
    assert_matches(third, hf_generate(longrope_dir, longer))


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_sliding_window_on_the_upper_layers_only(architecture: str, tmp_path: Path) -> None:
    """`use_sliding_window` with `max_window_layers`: layer 0 attends fully, layer 1 to the last
    8 positions; prompts and decodes run well past the window, prefilled in chunks."""
    config = make_config(
        architecture, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    model_dir = write_model(tmp_path / architecture, config, seed=3)
    batch = prompts(2, 512, 6, (20, 40))
    results = engine(model_dir).generate(
        batch, GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW, chunk_size=7
    )
    for ours, prompt in zip(results, batch, strict=True):
        assert_matches(ours, hf_generate(model_dir, prompt))


@pytest.mark.parametrize(
    "variant", ["mixtral-top2", "qwen2moe-shared-dense-layer", "qwen3moe-top3-norm"]
)
def test_moe_routes_every_token_as_transformers_does(
    variant: str, model_dirs: dict[str, Path]
) -> None:
    """Each sparse layer's top-k experts for every token of a prompt (prefill) and of the
    generated tokens (decode) are transformers' own, in order."""
    from tgq.gpu_worker.layers.moe import SparseMoE

    prompt = prompts(1, 512, 11, (30, 30))[0]
    hf = _hf_model(model_dirs[variant])
    theirs: list[torch.Tensor] = []
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    hooks = [
        router.register_forward_hook(lambda _m, _i, out: theirs.append(out[2]))
        for router in routers
    ]
    try:
        reference = hf_generate(model_dirs[variant], prompt)
    finally:
        for hook in hooks:
            hook.remove()
    ours: list[torch.Tensor] = []
    route = SparseMoE.route

    def recorded(self: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, weights = route(self, x)
        ours.append(experts)
        return experts, weights

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SparseMoE, "route", recorded)
        [result] = engine(model_dirs[variant]).generate(
            [prompt], GREEDY_WITH_LOGPROBS, max_new_tokens=NUM_NEW
        )
    assert_matches(result, reference)
    # One call per sparse layer per forward: the prompt's, then each decode step's.
    assert len(ours) == len(theirs) == len(routers) * NUM_NEW
    for mine, their in zip(ours, theirs, strict=True):
        assert torch.equal(mine, their.reshape(mine.shape))


def hf_prompt_logprobs(
    model_dir: Path, prompt: list[int], top: int
) -> tuple[list[float | None], list[list[int]]]:
    """transformers' log_softmax over one forward of the prompt: each token's logprob after the
    tokens before it (None for the first), and the `top` most likely ids at each position."""
    with torch.inference_mode():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    scores = torch.log_softmax(logits, dim=-1)
    chosen = [None, *scores[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()]
    ids = [[], *scores[:-1].topk(top, dim=-1).indices.tolist()] if top else []
    return chosen, ids


PROMPT_LOGPROBS = SamplingParams(logprobs=True, prompt_logprobs=3)


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
@pytest.mark.parametrize("variant", ["llama3-gqa", "gemma2-capped-window", "mixtral-top2"])
def test_prompt_logprobs_equal_transformers(
    variant: str, chunk_size: int | None, model_dirs: dict[str, Path]
) -> None:
    """`prompt_logprobs`: each prompt token's logprob equals transformers' log_softmax within
    1e-4 (fp32), prefilled whole or in chunks, beside requests that do not ask; the top-n ids
    at each position are transformers' too. A second request with the same prompt is served
    from the prefix cache for the plain one and still computes every position for the other."""
    batch = prompts(3, 512, 12, (20, 40))
    eng = engine(model_dirs[variant], block_size=8)
    params = [PROMPT_LOGPROBS, GREEDY_WITH_LOGPROBS, PROMPT_LOGPROBS]
    for attempt in range(2):
        results = eng.generate(batch, params, max_new_tokens=4, chunk_size=chunk_size)
        for result, prompt, param in zip(results, batch, params, strict=True):
            if param.prompt_logprobs is None:
                assert result.prompt_logprobs == []
                assert attempt == 0 or result.num_cached_tokens > 0
                continue
            chosen, top_ids = hf_prompt_logprobs(model_dirs[variant], prompt, 3)
            assert result.num_cached_tokens == 0
            assert result.prompt_logprobs[0] is None and chosen[0] is None
            torch.testing.assert_close(
                torch.tensor(result.prompt_logprobs[1:]),
                torch.tensor(chosen[1:]),
                atol=LOGPROB_TOL,
                rtol=0,
            )
            ours = [[t.token_id for t in tops] for tops in result.prompt_top_logprobs]
            assert ours == top_ids
