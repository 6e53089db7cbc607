"""Speculative decoding under structured output: drafts are checked against the request's
grammar before they are verified (only the prefix it allows in a row is sent), and each verifying
row samples under the grammar's state after the drafts before it, so the outputs equal those
without speculation, token for token (greedy, through the greedy head and the sampler, and
seeded sampling), under chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from tests.api.stack import write_text_model
from tests.batcher.test_speculation import drafting
from tests.batcher.test_speculation_model import ReplayOracle
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.batcher.grammar import GrammarKind, GrammarSpec
from tgq.batcher.grammar_compiler import Constraint, GrammarCompiler
from tgq.batcher.request import StoppingParams
from tgq.batcher.speculation import NgramProposer, Proposer
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.loader import LoadedModel, load_model
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(600)
BLOCK_SIZE = 8
SCHEMA = GrammarSpec.json_schema(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {"type": "array", "items": {"enum": ["a", "bb", "red"]}, "maxItems": 3},
            "n": {"type": "integer", "minimum": 0, "maximum": 900},
        },
        "required": ["name", "tags", "n"],
    }
)
REGEX = GrammarSpec(GrammarKind.REGEX, "(ab|cd)x")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("speculation-grammar"))


@functools.cache
def _loaded(model_dir: Path) -> LoadedModel:
    return load_model(str(model_dir), device=torch.device("cpu"))


def compiler_of(model_dir: Path) -> GrammarCompiler:
    eos = model_eos_token_ids(str(model_dir))
    return GrammarCompiler((model_dir / "tokenizer.json").read_text(), eos)


def constraint(compiler: GrammarCompiler, spec: GrammarSpec) -> Constraint:
    return compiler.take(spec, compiler.compile(spec))


def ids_of(model_dir: Path, text: str) -> list[int]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def test_only_the_drafts_the_grammar_allows_in_a_row_are_draftable(model_dir: Path) -> None:
    compiler = compiler_of(model_dir)
    grammar = constraint(compiler, REGEX)
    a, b, x = ids_of(model_dir, "abx")
    (c,) = ids_of(model_dir, "c")
    (eos,) = compiler.eos_token_ids
    assert grammar.num_draftable([a, b, x]) == 3
    assert grammar.num_draftable([a, c, x]) == 1  # "ac" is not a prefix of the language
    assert grammar.num_draftable([x, a]) == 0
    assert grammar.num_draftable([a, b, eos]) == 2  # drafts end before an EOS
    assert grammar.num_draftable([a, compiler.vocab_size + 3, b]) == 1  # past the tokenizer
    assert grammar.num_draftable([]) == 0
    assert grammar.error is None  # nothing was consumed: the state is where it was
    grammar.consume(a)
    assert grammar.num_draftable([b, x]) == 2 and grammar.num_draftable([a]) == 0


def test_masks_along_the_drafts_are_each_states_mask(model_dir: Path) -> None:
    """Row i's mask is the mask after drafts[:i], as consuming them one by one gives; the
    state is left before the drafts."""
    compiler = compiler_of(model_dir)
    drafts = ids_of(model_dir, '{"name":"ab","tags":["bb"')
    along = constraint(compiler, SCHEMA)
    assert along.num_draftable(drafts) == len(drafts)
    masks = compiler.masks_along(along, drafts)
    stepwise = constraint(compiler, SCHEMA)
    expected = []
    for token_id in [*drafts, None]:
        expected += compiler.masks([stepwise])
        if token_id is not None:
            stepwise.consume(token_id)
    assert masks == b"".join(expected)
    assert compiler.masks([along]) == expected[:1]  # rolled back
    assert len(set(expected)) > 3  # the states differ: a row under the wrong mask would show


class CountingProposer:
    """Another proposer's guesses, counted (to see how many the grammar cut)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.num_proposed = 0

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        drafts = self.inner.propose(request_id, token_ids, num_prompt_tokens, max_tokens)
        self.num_proposed += len(drafts)
        return drafts

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.inner.finish(request_id, token_ids, num_prompt_tokens)


def make_engine(model_dir: Path, proposer: Proposer | None, **limits: Any) -> LLMEngine:
    eos = model_eos_token_ids(str(model_dir))
    num_blocks = limits.pop("num_blocks")
    config = RunnerConfig(str(model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE)
    if proposer is not None:
        limits |= {"speculate": 4, "speculative_max_batch_tokens": 4096}
    engine = LLMEngine(
        ModelRunner(config, _loaded(model_dir)),
        SchedulerConfig(**limits),
        HFTokenDecoder.from_file(str(model_dir / "tokenizer.json")),
        eos,
        compiler_of(model_dir),
        proposer=proposer,
    )
    return engine if proposer is None else drafting(engine)


SAMPLING = [
    SamplingParams(),  # greedy head
    SamplingParams(logprobs=True, top_n_logprobs=2),  # greedy through the sampler
    SamplingParams(temperature=1.5, seed=5),
    SamplingParams(temperature=0.9, top_k=30, seed=9, repetition_penalty=1.2),
]


def prompts_of(model_dir: Path) -> list[list[int]]:
    shared = ids_of(model_dir, "The dictionary maps every key to a value and the list " * 4)[:24]
    tails = [ids_of(model_dir, f" record {i}: name and tags and count {i * 7}") for i in range(8)]
    return [shared + tail for tail in tails] * 2  # the second time with prefix hits


def run(engine: LLMEngine, prompts: list[list[int]], spec: GrammarSpec) -> list[RequestResult]:
    sampling = [SAMPLING[index % len(SAMPLING)] for index in range(len(prompts))]
    results = engine.generate(prompts, sampling, StoppingParams(max_new_tokens=40), grammar=spec)
    engine.scheduler.check_integrity()
    return results


@pytest.mark.parametrize("spec", [SCHEMA, GrammarSpec(GrammarKind.REGEX, "[a-d ]{4,30}x")],
                         ids=["json_schema", "regex"])  # fmt: skip
@pytest.mark.parametrize(
    "limits",
    [
        {"max_batch_prefill_tokens": 16, "max_batch_size": 16, "num_blocks": 512},  # chunked
        {"max_batch_prefill_tokens": 64, "max_batch_size": 16, "num_blocks": 30},  # preemption
    ],
    ids=["chunked", "preempted"],
)
def test_constrained_outputs_equal_the_run_without_speculation(
    spec: GrammarSpec, limits: dict[str, int], model_dir: Path
) -> None:
    prompts = prompts_of(model_dir)
    reference = run(make_engine(model_dir, None, **limits), prompts, spec)
    oracle = ReplayOracle(seed=len(limits) + limits["num_blocks"])
    for prompt, result in zip(prompts, reference, strict=True):
        oracle.learn(prompt, result.token_ids)
    counting = CountingProposer(oracle)
    engine = make_engine(model_dir, counting, **limits)
    ours = run(engine, prompts, spec)
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.finish_reason == theirs.finish_reason
    stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
    assert stats.num_accepted > 20
    assert stats.num_proposed < counting.num_proposed  # the grammar cut the corrupted guesses
    if limits["num_blocks"] < 512:
        assert engine.scheduler.num_preemptions > 0
    ngram = run(make_engine(model_dir, NgramProposer(1, 3), **limits), prompts, spec)
    assert [r.token_ids for r in ngram] == [r.token_ids for r in reference]
