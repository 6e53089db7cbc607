"""Scheduler behaviour with the strict fake runner: budgets, chunking, priorities, preemption,
prefix hits, abort and rejection; KV integrity after every step."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.batcher.fake_runner import VOCAB_SIZE, FakeRunner, solo_output
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine, RequestOutput
from tgq.batcher.request import FinishReason, Priority, Request, RequestStatus, StoppingParams


def make_engine(num_blocks: int = 256, block_size: int = 4, **limits: Any) -> LLMEngine:
    config = SchedulerConfig(**{"max_batch_prefill_tokens": 64, "max_batch_size": 8, **limits})
    return LLMEngine(FakeRunner(num_blocks, block_size), config)


def run(engine: LLMEngine) -> list[RequestOutput]:
    """Step to the end, checking the budgets and the KV accounting after every step."""
    outputs = []
    runner, config = engine.runner, engine.scheduler.config
    assert isinstance(runner, FakeRunner)
    while engine.has_unfinished:
        outputs += engine.step()
        engine.scheduler.check_integrity()
        if runner.plans:
            plan = runner.plans[-1]
            assert plan.num_tokens <= config.max_batch_prefill_tokens
            assert len(runner.sequences) <= config.max_batch_size
            assert len(engine.scheduler.running) <= config.max_batch_size
            kv = engine.scheduler.kv
            num_held_tokens = (kv.num_usable_blocks - kv.num_free_blocks) * kv.block_size
            assert num_held_tokens <= engine.scheduler.max_batch_total_tokens
    stats, plans = engine.scheduler.step_stats, [p for p in runner.plans if p.num_tokens]
    assert (stats.num_steps, stats.num_tokens) == (len(plans), sum(p.num_tokens for p in plans))
    assert stats.max_tokens == max((p.num_tokens for p in plans), default=0)
    return outputs


def stopping(max_new_tokens: int) -> StoppingParams:
    return StoppingParams(max_new_tokens=max_new_tokens)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_workload_respects_budgets_and_matches_solo_runs(seed: int) -> None:
    """Requests of both priorities arrive (and some are aborted) while others run, in a pool
    that forces preemption."""
    rng = random.Random(seed)
    engine = make_engine(num_blocks=65, block_size=4, max_batch_total_tokens=256)
    expected: dict[str, list[int]] = {}
    outputs: list[RequestOutput] = []
    for _ in range(40):
        prompt = random_prompt(rng, rng.randint(1, 120))
        max_new = rng.randint(1, 30)
        priority = rng.choice(list(Priority))
        request_id = engine.add_request(prompt, stopping=stopping(max_new), priority=priority)
        expected[request_id] = solo_output(prompt, max_new)
        if rng.random() < 0.2:
            engine.abort(rng.choice(sorted(expected)))
        for _ in range(3):
            outputs += engine.step()
            engine.scheduler.check_integrity()
    outputs += run(engine)
    assert engine.scheduler.num_preemptions > 0
    generated: dict[str, list[int]] = {request_id: [] for request_id in expected}
    for output in outputs:
        generated[output.request_id].extend(output.new_token_ids)
    finish_reasons = {o.request_id: o.finish_reason for o in outputs if o.is_finished}
    assert finish_reasons.keys() == expected.keys()
    for request_id, tokens in expected.items():
        if finish_reasons[request_id] == "abort":
            assert generated[request_id] == tokens[: len(generated[request_id])]
        else:
            assert generated[request_id] == tokens
    assert "abort" in finish_reasons.values()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_generate_matches_solo_runs_under_preemption() -> None:
    rng = random.Random(8)
    prompts = [random_prompt(rng, rng.randint(1, 60)) for _ in range(24)]
    engine = make_engine(num_blocks=33, block_size=4, max_batch_prefill_tokens=32)
    results = engine.generate(prompts, stopping=stopping(20))
    assert engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [solo_output(p, 20) for p in prompts]
    assert all(r.finish_reason == "length" for r in results)
    engine.scheduler.check_integrity()


def test_long_prompt_is_chunked_while_others_decode() -> None:
    rng = random.Random(9)
    engine = make_engine(num_blocks=3000, block_size=4, max_batch_prefill_tokens=512)
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    short_ids = [engine.add_request(random_prompt(rng, 8), stopping=stopping(40)) for _ in range(3)]
    engine.step()
    long_id = engine.add_request(random_prompt(rng, 10_000), stopping=stopping(4))
    run(engine)
    long_chunks = [
        c.num_new_tokens for p in runner.plans for c in p.chunks if c.request_id == long_id
    ]
    prefill_steps = [
        plan
        for plan in runner.plans
        for c in plan.chunks
        if c.request_id == long_id and c.num_new_tokens > 1
    ]
    assert sum(long_chunks[: len(prefill_steps)]) == 10_000
    assert len(prefill_steps) >= 10_000 // 512
    for plan in prefill_steps[:-1]:  # every step but the last chunk's is full
        decoding = {c.request_id for c in plan.chunks if c.num_new_tokens == 1}
        assert decoding == set(short_ids)
        assert plan.num_tokens == 512


def test_a_bulk_prefill_does_not_delay_an_interactive_request() -> None:
    rng = random.Random(12)
    engine = make_engine(num_blocks=3000, block_size=4, max_batch_prefill_tokens=512)
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    bulk_id = engine.add_request(random_prompt(rng, 10_000), priority=Priority.BULK)
    engine.step()
    interactive_id = engine.add_request(random_prompt(rng, 300), stopping=stopping(2))
    engine.step()
    chunks = {c.request_id: c.num_new_tokens for c in runner.plans[-1].chunks}
    assert chunks == {bulk_id: 1, interactive_id: 300}
    engine.step()
    chunks = {c.request_id: c.num_new_tokens for c in runner.plans[-1].chunks}
    assert chunks == {interactive_id: 1, bulk_id: 511}


def test_interactive_preempts_bulk_for_a_batch_slot_and_finishes_first() -> None:
    rng = random.Random(10)
    engine = make_engine(max_batch_size=2, max_batch_prefill_tokens=16)
    bulk_ids = [
        engine.add_request(random_prompt(rng, 8), stopping=stopping(30), priority=Priority.BULK)
        for _ in range(2)
    ]
    for _ in range(3):
        engine.step()
    interactive_id = engine.add_request(random_prompt(rng, 8), stopping=stopping(5))
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {bulk_ids[0], interactive_id}
    order = [o.request_id for o in run(engine) if o.is_finished]
    assert order[0] == interactive_id
    assert engine.scheduler.num_preemptions == 1


def test_bulk_waits_for_interactive_under_the_same_load() -> None:
    rng = random.Random(11)
    engine = make_engine(max_batch_size=2)
    bulk_id = engine.add_request(random_prompt(rng, 8), priority=Priority.BULK)
    interactive_ids = [engine.add_request(random_prompt(rng, 8)) for _ in range(2)]
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == set(interactive_ids)
    order = [o.request_id for o in run(engine) if o.is_finished]
    assert order[-1] == bulk_id


def test_preemption_takes_the_lowest_priority_then_the_newest() -> None:
    # 9 usable blocks of 4 tokens; each request's 8-token prompt takes 2, each grows by 1 block.
    engine = make_engine(num_blocks=10, block_size=4, max_batch_total_tokens=36)
    ids = [
        engine.add_request([i] * 8, stopping=stopping(12), priority=priority)
        for i, priority in enumerate([Priority.BULK, Priority.INTERACTIVE, Priority.INTERACTIVE])
    ]
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    preempted: list[str] = []
    while engine.scheduler.has_unfinished:
        scheduled = engine.scheduler.schedule()
        preempted += scheduled.preempted_request_ids
        engine.scheduler.update(scheduled, runner.execute(scheduled.to_plan()))
        engine.scheduler.check_integrity()
    assert preempted[:2] == [ids[0], ids[2]]


def test_full_prefix_hit_computes_exactly_one_token() -> None:
    engine = make_engine(block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks and the last token
    [first] = engine.generate([prompt], stopping=stopping(3))
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    num_plans = len(runner.plans)
    [second] = engine.generate([prompt], stopping=stopping(3))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 12)
    first_chunk = next(c for p in runner.plans[num_plans:] for c in p.chunks)
    assert (first_chunk.num_computed_tokens, first_chunk.num_new_tokens) == (12, 1)
    assert second.token_ids == first.token_ids == solo_output(prompt, 3)
    kv = engine.scheduler.kv
    assert (kv.num_prefix_hit_tokens, kv.num_prefix_query_tokens) == (12, 26)


def test_prefix_cache_off_computes_everything() -> None:
    engine = make_engine(block_size=4, enable_prefix_cache=False)
    prompt = list(range(1, 14))
    engine.generate([prompt], stopping=stopping(3))
    [second] = engine.generate([prompt], stopping=stopping(3))
    assert second.num_cached_tokens == 0


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "decoding"])
def test_abort_frees_blocks_within_a_step(when: str) -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_batch_prefill_tokens=16)
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    other_id = engine.add_request(list(range(40)), stopping=stopping(50))
    engine.step()  # the other request takes the whole first step
    request_id = engine.add_request(list(range(1, 41)), stopping=stopping(50))
    num_steps = {"waiting": 0, "mid-prefill": 2, "decoding": 6}[when]
    for _ in range(num_steps):
        engine.step()
    held = len(engine.scheduler.kv.block_ids(request_id))
    assert (held > 0) == (when != "waiting")
    free_before = engine.scheduler.kv.num_free_blocks
    engine.abort(request_id)
    assert engine.scheduler.kv.num_free_blocks == free_before + held
    outputs = engine.step()
    assert RequestOutput(request_id, [], [], [], FinishReason.ABORT, "aborted") in outputs
    assert (request_id in runner.plans[-1].finished_request_ids) == (when != "waiting")
    assert request_id not in runner.sequences
    engine.abort(request_id)  # already gone: nothing happens
    run(engine)
    assert other_id not in runner.sequences


def test_a_request_that_can_never_fit_is_rejected_with_its_reason() -> None:
    # 42 KV tokens make 10 blocks of 4: the 41 KV tokens of 38 + 4 would need 11.
    engine = make_engine(num_blocks=20, block_size=4, max_batch_total_tokens=42)
    [too_long, too_many_blocks, fits] = engine.generate(
        [[1] * 40, [1] * 38, [1] * 36], stopping=stopping(4)
    )
    assert too_long.finish_reason == "rejected"
    assert too_long.finish_detail == (
        "prompt (40 tokens) + max_new_tokens (4) = 44 exceeds max_batch_total_tokens (42)"
    )
    assert too_many_blocks.finish_detail == "needs 11 KV blocks of 4 tokens, the pool has 10"
    assert fits.finish_reason == "length"


@pytest.mark.parametrize(
    ("case", "num_tokens", "reason"),
    [
        ("length", 6, "length"),
        ("eos", 3, "stop"),
        ("stop_token", 3, "stop"),
        ("ignored_eos", 6, "length"),
    ],
)
def test_token_level_stopping(case: str, num_tokens: int, reason: str) -> None:
    prompt = [3, 1, 4, 1, 5]
    full = solo_output(prompt, 6)
    third = frozenset({full[2], VOCAB_SIZE + 1})  # an extra EOS id alongside
    params = {
        "length": StoppingParams(6),
        "eos": StoppingParams(6, eos_token_ids=third),
        "stop_token": StoppingParams(6, stop_token_ids=third),
        "ignored_eos": StoppingParams(6, eos_token_ids=third, ignore_eos=True),
    }[case]
    [result] = make_engine().generate([prompt], stopping=params)
    assert result.token_ids == full[:num_tokens]
    assert result.finish_reason == reason


def test_status_transitions_are_checked() -> None:
    request = Request("r", [1, 2], 2)
    with pytest.raises(ValueError, match="WAITING -> PREEMPTED is not allowed"):
        request.transition(RequestStatus.PREEMPTED)
    request.transition(RequestStatus.RUNNING)
    request.transition(RequestStatus.FINISHED_LENGTH)
    assert request.is_finished and request.finish_reason == "length"
    with pytest.raises(ValueError, match="FINISHED_LENGTH -> RUNNING"):
        request.transition(RequestStatus.RUNNING)


def test_new_requests_join_a_busy_batch_only_in_groups_or_after_waiting() -> None:
    """TGI's waiting_served_ratio / max_waiting_tokens."""
    engine = make_engine(max_batch_size=16, max_batch_prefill_tokens=64, max_waiting_tokens=5)
    for i in range(10):
        engine.add_request([i + 1] * 4, stopping=stopping(40))
    engine.step()
    late_id = engine.add_request([9] * 4, stopping=stopping(2))
    num_steps = 0
    while late_id not in {r.request_id for r in engine.scheduler.running}:
        engine.step()
        num_steps += 1
    # floor(0.3 * 10) = 3 > 1 could join: 5 (max_waiting_tokens) steps run without it.
    assert num_steps == 6
    for _ in range(3):
        engine.add_request([7] * 4, stopping=stopping(2))
    engine.step()
    assert not engine.scheduler.waiting  # three at once may join


def test_an_interactive_request_skips_the_admission_gate() -> None:
    engine = make_engine(max_batch_size=16, max_batch_prefill_tokens=64)
    for i in range(10):
        engine.add_request([i + 1] * 4, stopping=stopping(40), priority=Priority.BULK)
    engine.step()
    engine.add_request([9] * 4, stopping=stopping(2))
    engine.step()
    assert not engine.scheduler.waiting
