"""Speculative decoding in the scheduler, with the strict fake runner: outputs equal the solo
runs whatever the drafts, the KV accounting holds after every step of a long randomized run with
rollbacks, the draft budget and limits; and the proposers' lookups."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from tests.batcher.fake_runner import VOCAB_SIZE, FakeRunner, solo_output
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine, RequestOutput
from tgq.batcher.kv_manager import KVManager
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.speculation import (
    EXPLORE_EVERY,
    DraftChoice,
    NgramIndex,
    NgramProposer,
    Speculation,
    SuffixProposer,
)
from tgq.gpu_worker.plan import accepted_length


class AlwaysDraft(DraftChoice):
    """Drafts at every load, whatever this machine's timings (tests of what drafts do, not of
    whether a step gets them)."""

    def drafts_pay(self, rows: int) -> bool:
        return True


def drafting(engine: LLMEngine) -> LLMEngine:
    """`engine` with drafts up to its caps every step (`AlwaysDraft`)."""
    assert engine.scheduler.speculation is not None
    engine.scheduler.speculation.choice = AlwaysDraft()
    return engine


class OracleProposer:
    """Guesses the fake model's true continuation, then corrupts it from a random position on
    (or not at all), so every acceptance length from 0 to k occurs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.finished: list[str] = []

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        truth = solo_output(list(token_ids), max_tokens)
        cut = self.rng.randint(0, max_tokens)
        wrong = [(t + 1) % VOCAB_SIZE for t in truth[cut:]]
        return (truth[:cut] + wrong)[: self.rng.randint(0, max_tokens)]

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.finished.append(request_id)


def make_engine(proposer: Any, num_blocks: int = 256, **limits: Any) -> LLMEngine:
    config = SchedulerConfig(
        **{"max_batch_prefill_tokens": 64, "max_batch_size": 8, "speculate": 4, **limits}
    )
    return drafting(LLMEngine(FakeRunner(num_blocks, 4), config, proposer=proposer))


def step_checked(engine: LLMEngine) -> list[RequestOutput]:
    outputs = engine.step()
    engine.scheduler.check_integrity()
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    for request in engine.scheduler.running:  # both sides hold the same blocks
        assert runner.sequences[request.request_id].block_ids == request.block_ids
    return outputs


def test_ten_thousand_steps_with_rollbacks_keep_the_kv_accounting_and_the_outputs() -> None:
    """Requests of both priorities arrive and some are aborted while others run with random
    drafts, in a pool that forces preemption; KV integrity after each of 10,000 steps."""
    rng = random.Random(29)
    proposer = OracleProposer(rng)
    engine = make_engine(proposer, num_blocks=65, max_batch_total_tokens=256)
    expected: dict[str, list[int]] = {}
    generated: dict[str, list[int]] = {}
    finish_reasons: dict[str, str] = {}
    num_steps = 0
    while num_steps < 10_000:
        if len(engine.scheduler.requests) < 12:
            prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 60))]
            max_new = rng.randint(1, 40)
            priority = rng.choice(list(Priority))
            request_id = engine.add_request(
                prompt, stopping=StoppingParams(max_new_tokens=max_new), priority=priority
            )
            expected[request_id], generated[request_id] = solo_output(prompt, max_new), []
        if rng.random() < 0.01 and engine.scheduler.requests:
            engine.abort(rng.choice(sorted(engine.scheduler.requests)))
        for output in step_checked(engine):
            generated[output.request_id] += output.new_token_ids
            if output.is_finished:
                finish_reasons[output.request_id] = output.finish_reason or ""
        num_steps += 1
    while engine.has_unfinished:
        for output in step_checked(engine):
            generated[output.request_id] += output.new_token_ids
            if output.is_finished:
                finish_reasons[output.request_id] = output.finish_reason or ""
    for request_id, tokens in expected.items():
        if finish_reasons[request_id] == "abort":
            assert generated[request_id] == tokens[: len(generated[request_id])]
        else:
            assert generated[request_id] == tokens, request_id
    stats = engine.scheduler.speculation.stats  # type: ignore[union-attr]
    histogram = stats.acceptance_counts
    assert stats.num_verified > 1000 and histogram[0] > 0 and histogram[10] > 0
    assert 0 < stats.num_accepted < stats.num_proposed
    assert engine.scheduler.num_preemptions > 0
    assert "abort" in finish_reasons.values()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert sorted(proposer.finished) == sorted(expected)  # every request's state dropped


def test_a_step_gets_drafts_only_within_its_token_budget() -> None:
    """Decoding requests share `speculative_max_batch_tokens`: past it, no drafts; a chunk
    never drafts past its request's last token."""
    engine = make_engine(OracleProposer(random.Random(1)), speculative_max_batch_tokens=10)
    engine.scheduler.speculation.proposer.rng = _AlwaysFull()  # type: ignore[union-attr]
    for index in range(8):
        engine.add_request([index + 1] * 5, stopping=StoppingParams(max_new_tokens=3))
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    while engine.has_unfinished:
        step_checked(engine)
        plan = runner.plans[-1]
        if any(chunk.draft_token_ids for chunk in plan.chunks):
            assert plan.num_tokens <= 10
    drafted = [len(c.draft_token_ids) for p in runner.plans for c in p.chunks]
    assert max(drafted) == 1  # max_new_tokens 3: the first token, one draft, the token after it


class _AlwaysFull(random.Random):
    """`OracleProposer` with every draft true and as long as allowed."""

    def randint(self, a: int, b: int) -> int:
        return b


def test_an_opted_out_request_gets_no_drafts() -> None:
    engine = make_engine(OracleProposer(random.Random(2)))
    engine.add_request([1, 2, 3], stopping=StoppingParams(max_new_tokens=20), speculate=False)
    engine.generate([[4, 5, 6]], stopping=StoppingParams(max_new_tokens=20))
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    chunks = [c for plan in runner.plans for c in plan.chunks]
    assert not any(c.draft_token_ids for c in chunks if c.request_id == "req-0")
    assert any(c.draft_token_ids for c in chunks if c.request_id == "req-1")


def test_accepted_length_is_the_matching_prefix() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_length([5], [4, 5]) == 0
    assert accepted_length([], [3]) == 0


def test_trim_gives_back_the_tail_blocks_and_keeps_cached_ones() -> None:
    kv = KVManager(10, 4)
    assert kv.grow_blocks("a", 13) == [1, 2, 3, 4]
    kv.cache_blocks("a", list(range(13)), 8)
    assert kv.trim("a", 9) == [1, 2, 3]
    assert kv.num_free_blocks == 6
    with pytest.raises(ValueError, match="would drop cached blocks"):
        kv.trim("a", 4)
    kv.check_integrity()


def brute_force_follow(token_ids: list[int], n_range: range, max_tokens: int) -> list[int]:
    for n in reversed(n_range):
        tail = token_ids[-n:]
        for end in range(len(token_ids) - 1, n - 1, -1):
            if len(token_ids) >= n and token_ids[end - n : end] == tail:
                return token_ids[end : end + max_tokens]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_lookup_matches_a_scan_as_the_sequence_grows(seed: int) -> None:
    rng = random.Random(seed)
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(200):
        got = proposer.propose("r", tokens, 5, 4)
        assert got == brute_force_follow(tokens, range(1, 4), 4)
        tokens.append(rng.randrange(6))


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    #           the quoted span: 7 8 9 10 11, then the output starts quoting it
    tokens = [1, 7, 8, 9, 10, 11, 2, 3, 8, 9, 4, 7, 8, 9]
    assert proposer.propose("r", tokens, 11, 3) == [10, 11, 2]
    assert proposer.propose("s", [1, 2, 3], 3, 3) == []


def test_suffix_proposer_learns_from_finished_outputs() -> None:
    proposer = SuffixProposer(min_n=2, max_n=4, max_groups=3, max_group_tokens=64)
    template = list(range(100, 120))
    proposer.finish("a", [*template, 1, *[50, 51, 52, 53, 54, 55]], len(template) + 1)
    proposer.finish("b", [*range(300, 320), 50, 51, 60, 61, 62], 20)
    # Its group's outputs first: they share the template; the pool of every request's outputs
    # only where its group's guess is shorter.
    assert proposer.propose("c", [*template, 2, 50, 51], len(template) + 1, 3) == [52, 53, 54]
    assert proposer.propose("d", [*range(200, 220), 50, 51], 20, 3) == [60, 61, 62]
    assert proposer.propose("e", [*range(200, 220), 51, 50], 20, 3) == []
    for index in range(40):  # bounded: groups and tokens per group
        proposer.finish(str(index), [*template, *range(index, index + 5)], len(template))
        proposer.finish(f"x{index}", [index + 1000, 1, 2, 3], 1)
    assert len(proposer._groups) == 3 and proposer.num_group_tokens <= 3 * 64


def test_suffix_proposer_learns_from_running_outputs() -> None:
    """Lines of one batch that run together: one guesses what another, further along, wrote
    after the same tokens, before either finishes; the pool is bounded."""
    proposer = SuffixProposer(min_n=2, max_n=4, max_live_ngrams=40)
    first = [10, 11, 12, 1, 70, 71, 72, 73]  # prompt [10, 11, 12], output from 1 on
    second = [20, 21, 22, 2]
    assert proposer.propose("a", first, 3, 3) == []
    assert proposer.propose("b", second, 3, 3) == []
    second += [70, 71]
    assert proposer.propose("b", second, 3, 3) == [72, 73]  # "a" wrote 72 73 after 70 71
    first += [74, 75]  # "a" goes on: the guess follows its output as it grows
    assert proposer.propose("b", second, 3, 4) == [72, 73, 74, 75]
    assert proposer.propose("c", [5, 6, 11, 12], 2, 3) == []  # prompt n-grams are not pooled
    for index in range(20):  # bounded: the pool empties past its cap
        proposer.propose(f"x{index}", [40, 41, *range(100 + index * 5, 105 + index * 5)], 2, 2)
        assert proposer.num_live_ngrams <= 40 + 3  # the cap, plus one request's new ones
    proposer.finish("a", first, 3)
    assert "a" not in proposer._live_indexed


def test_draft_length_follows_the_acceptance_rate() -> None:
    speculation = Speculation(NgramProposer(), max_drafts=5, max_batch_tokens=32)
    assert speculation.num_drafts("r") == 5
    for _ in range(10):
        speculation.record("r", 5, 0)
    assert speculation.num_drafts("r") == 1  # never zero: it may recover
    for _ in range(10):
        speculation.record("r", 1, 1)
    assert speculation.num_drafts("r") >= 4
    assert speculation.stats.acceptance_counts[0] == 10


def test_ngram_index_indexes_each_end_once() -> None:
    index = NgramIndex(1, 2)
    index.extend([1, 2, 1, 2], 3)
    index.extend([1, 2, 1, 2], 4)
    assert index.ends == {(1,): [1, 3], (2,): [2]}


def test_drafts_go_where_their_steps_keep_more_tokens_per_second() -> None:
    """Each load level learns on its own: both choices are tried first, the faster one is
    taken, and the slower one again every `EXPLORE_EVERY` steps (so a change is seen)."""
    choice = DraftChoice()
    speeds = {(1, True): 900.0, (1, False): 500.0, (64, True): 1500.0, (64, False): 2000.0}
    taken: dict[int, list[bool]] = {1: [], 64: []}
    for _ in range(400):
        for rows in (1, 64):
            drafted = choice.drafts_pay(rows)
            taken[rows].append(drafted)
            choice.record(rows, drafted, 100, 100 / speeds[rows, drafted])
    assert taken[1][:6].count(True) == 3 and taken[64][:6].count(False) == 3  # tried both
    late_one, late_many = taken[1][40:], taken[64][40:]  # steps 41 to 400 of each level
    num_explored = sum(1 for step in range(41, 401) if step % EXPLORE_EVERY == 0)
    assert late_one.count(False) == num_explored  # drafts, bar exploration
    assert late_many.count(True) == num_explored  # none, bar exploration
    rates = choice.rates()
    assert rates[1, True] == pytest.approx(900) and rates[7, False] == pytest.approx(2000)


def test_draft_room_is_none_where_drafts_do_not_pay_and_capped_where_they_do() -> None:
    speculation = Speculation(NgramProposer(), max_drafts=4, max_batch_tokens=128)
    speculation.choice = AlwaysDraft()
    assert speculation.draft_room(4, 4096) == 124
    assert speculation.draft_room(4, 10) == 10
    assert speculation.draft_room(128, 4096) == 0

    class Never(DraftChoice):
        def drafts_pay(self, rows: int) -> bool:
            return False

    speculation.choice = Never()
    assert speculation.draft_room(4, 4096) == 0
