"""The engine's stopping and text output: the model's EOS ids (generation_config extras included),
streamed text deltas, stop strings across token boundaries, held-back text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.batcher import tokenizer_zoo
from tests.batcher.test_speculation import drafting
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine, RequestOutput
from tgq.batcher.request import StoppingParams
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.plan import (
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
    accepted_length,
)

PROMPT_TEXT = "The answer is"
OUTPUT_TEXT = " forty-two, said the computer. 你好 — café ✓ and then nothing more at all"


class ScriptedRunner:
    """Emits a fixed token sequence to every sequence, one token per completed chunk."""

    def __init__(self, script: list[int], num_blocks: int = 64, block_size: int = 4) -> None:
        self.script = script
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_outputs: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}
        self.sampling: dict[str, SamplingParams] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for new in plan.new_sequences:
            self.sampling[new.request_id] = new.sampling
            self.num_tokens[new.request_id] = len(new.token_ids)
            self.num_outputs.setdefault(new.request_id, len(new.token_ids) - new.num_prompt_tokens)
        sampled = []
        for chunk in plan.chunks:
            drafts, request_id = chunk.draft_token_ids, chunk.request_id
            end = chunk.num_computed_tokens + chunk.num_new_tokens
            if end == self.num_tokens[request_id] + len(drafts):
                first = self.num_outputs[request_id]
                rows = self.script[first : first + len(drafts) + 1]
                kept = rows[: accepted_length(drafts, rows) + 1]  # as the model runner keeps
                self.num_outputs[request_id] += len(kept)
                self.num_tokens[request_id] += len(kept)
                sampled += [SampledToken(request_id, token_id) for token_id in kept]
        return StepResult(sampled)


class ScriptGuesser:
    """A speculative proposer that always guesses the script right."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        done = len(token_ids) - num_prompt_tokens
        return self.script[done : done + max_tokens]

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass


def script_for(tokenizer_name: str) -> tuple[list[int], list[int]]:
    """The prompt's token ids, and those of OUTPUT_TEXT following it."""
    tokenizer = tokenizer_zoo.load(tokenizer_name)
    prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False).ids
    both = tokenizer.encode(PROMPT_TEXT + OUTPUT_TEXT, add_special_tokens=False).ids
    return prompt, both[len(prompt) :]


def continuation(tokenizer_name: str, num_tokens: int | None = None) -> str:
    """What a full decode says the first `num_tokens` output tokens add to the prompt's text."""
    tokenizer = tokenizer_zoo.load(tokenizer_name)
    prompt, script = script_for(tokenizer_name)
    return tokenizer.decode(prompt + script[:num_tokens])[len(tokenizer.decode(prompt)) :]


def run(
    tokenizer_name: str,
    stop_strings: tuple[str, ...],
    max_new_tokens: int | None = None,
    min_tokens: int = 0,
    speculate: int = 0,
) -> tuple[list[RequestOutput], str]:
    """Streams OUTPUT_TEXT's tokens through an engine: the request's events and the text their
    deltas add up to. `speculate`: up to that many drafts a step, always right, so an event
    carries several tokens and a stop string may complete inside one."""
    prompt, script = script_for(tokenizer_name)
    decoder = HFTokenDecoder(tokenizer_zoo.load(tokenizer_name))
    config = SchedulerConfig(speculate=speculate)
    guesser = ScriptGuesser(script) if speculate else None
    engine = LLMEngine(ScriptedRunner(script), config, decoder=decoder, proposer=guesser)
    if speculate:
        drafting(engine)
    stopping = StoppingParams(
        max_new_tokens=max_new_tokens or len(script), stop_strings=stop_strings
    )
    engine.add_request(prompt, SamplingParams(min_tokens=min_tokens), stopping)
    events = list(engine.stream())
    assert events[-1].is_finished
    return events, "".join(event.new_text for event in events)


@pytest.mark.parametrize("tokenizer_name", ["bpe", "mistral"])
def test_streamed_text_is_the_decoded_output_when_no_stop_string_matches(
    tokenizer_name: str,
) -> None:
    events, text = run(tokenizer_name, ("nothing less",))  # "nothing " is held, then released
    assert text == continuation(tokenizer_name)
    assert all("\ufffd" not in event.new_text for event in events)  # multibyte never split
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("speculate", [0, 5])
@pytest.mark.parametrize("tokenizer_name", ["bpe", "mistral"])
@pytest.mark.parametrize("stop", ["said the", "é ✓", "computer."])
def test_a_stop_string_across_tokens_stops_the_request_before_it(
    tokenizer_name: str, stop: str, speculate: int
) -> None:
    events, text = run(tokenizer_name, (stop, "never there"), speculate=speculate)
    full = continuation(tokenizer_name)
    assert text == full[: full.index(stop)]
    final = events[-1]
    assert (final.finish_reason, final.finish_detail) == ("stop", f"stop string {stop!r}")
    num_tokens = sum(len(event.new_token_ids) for event in events)
    assert num_tokens < len(script_for(tokenizer_name)[1])  # it stopped generating, too
    assert (max(len(event.new_token_ids) for event in events) > 1) == (speculate > 0)


def test_a_stop_string_completed_by_the_last_allowed_token_reports_stop() -> None:
    num_script = len(script_for("bpe")[1])
    needed = next(n for n in range(1, num_script + 1) if "said" in continuation("bpe", n))
    events, text = run("bpe", ("said",), max_new_tokens=needed)
    assert events[-1].finish_reason == "stop"
    assert text == continuation("bpe")[: continuation("bpe").index("said")]


@pytest.mark.parametrize("speculate", [0, 5])
def test_a_stop_string_complete_before_min_tokens_does_not_stop(speculate: int) -> None:
    """vLLM's rule: the first "the" ends within `min_tokens`, so only the one in "then" stops."""
    full = continuation("bpe")
    first = next(n for n in range(1, 40) if "the" in continuation("bpe", n))
    events, text = run("bpe", ("the",), min_tokens=first + 1, speculate=speculate)
    assert text == full[: full.index("the", full.index("the") + 1)]
    assert events[-1].finish_reason == "stop"


def test_eos_and_stop_tokens_do_not_stop_before_min_tokens() -> None:
    """The engine hands the sampler the ids to mask (EOS and stop tokens); one sampled anyway
    (here a scripted runner) does not end the request before `min_tokens`."""
    eos, stop_token = 2, 9
    runner = ScriptedRunner([5, eos, stop_token, 6, 7, stop_token, eos])
    engine = LLMEngine(runner, eos_token_ids=frozenset({eos}))
    stopping = StoppingParams(max_new_tokens=7, stop_token_ids=frozenset({stop_token}))
    request_id = engine.add_request([1, 3], SamplingParams(min_tokens=4), stopping)
    events = list(engine.stream())
    assert [t for e in events for t in e.new_token_ids] == [5, eos, stop_token, 6, 7, stop_token]
    assert (events[-1].finish_reason, events[-1].finish_detail) == ("stop", "stop token 9")
    assert runner.sampling[request_id].min_tokens_stop_ids == (eos, stop_token)


def test_min_tokens_never_outlasts_max_new_tokens() -> None:
    engine = LLMEngine(ScriptedRunner([2] * 8), eos_token_ids=frozenset({2}))
    engine.add_request([1, 3], SamplingParams(min_tokens=6), StoppingParams(max_new_tokens=3))
    events = list(engine.stream())
    assert [t for e in events for t in e.new_token_ids] == [2, 2, 2]
    assert events[-1].finish_reason == "length"


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    engine = LLMEngine(ScriptedRunner([5, 6, 7]))
    with pytest.raises(ValueError, match="stop strings need an engine with a tokenizer"):
        engine.add_request([1, 2], stopping=StoppingParams(stop_strings=("x",)))


def test_the_models_eos_ids_include_generation_config_extras(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eos_ids = model_eos_token_ids(tmp_path)
    assert eos_ids == {2, 7, 9}
    engine = LLMEngine(ScriptedRunner([5, 6, 9, 8]), eos_token_ids=eos_ids)
    [result] = engine.generate([[1, 2, 3]], stopping=StoppingParams(max_new_tokens=4))
    assert (result.token_ids, result.finish_reason, result.finish_detail) == (
        [5, 6, 9],
        "stop",
        "eos token",
    )
    explicit = StoppingParams(max_new_tokens=4, eos_token_ids=frozenset({6}))
    [result] = engine.generate([[1, 2, 3]], stopping=explicit)  # a request's own ids win
    assert result.token_ids == [5, 6]
