"""The structured-output benchmark's own code on the api's tiny model: its schemas are ones the
api accepts, and each measurement runs and sees what it claims to (masks only where a grammar is,
every burst request answered)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_structured as structured
from bench.structured_schemas import LONG_TEXT_SCHEMA, SCHEMAS, WORKLOAD_SCHEMA
from tgq.batcher.grammar import GrammarSpec, check

PROMPT = list(range(5, 21))


@pytest.fixture(scope="module")
def bench(text_model_dir: Path) -> structured.Bench:
    return structured.Bench.load(text_model_dir)


def test_the_twenty_schemas_are_ones_the_api_accepts() -> None:
    assert len(SCHEMAS) == 20
    schemas = [*SCHEMAS.values(), WORKLOAD_SCHEMA]
    for schema in [*schemas, LONG_TEXT_SCHEMA]:
        check(GrammarSpec.json_schema(schema))
    assert "$defs" in SCHEMAS["org_chart"]


def test_a_constrained_run_counts_its_tokens_and_its_masks(bench: structured.Bench) -> None:
    compiler, build_s = bench.compiler()
    spec = GrammarSpec.json_schema(WORKLOAD_SCHEMA)  # six items: longer than 8 tokens
    workload = [(PROMPT, 8)] * 3
    free = structured.run_mixed(bench, compiler, workload, None)
    constrained = structured.run_mixed(bench, compiler, workload, spec)
    assert build_s > 0
    assert free["tokens"] == constrained["tokens"] == 24
    assert free["mask_ms_per_step"] == 0 < constrained["mask_ms_per_step"]
    assert constrained["json_complete"] == 0
    compiler.close()


def test_the_profile_finds_the_mask_work_only_under_a_grammar(bench: structured.Bench) -> None:
    compiler, _ = bench.compiler()
    spec = GrammarSpec.json_schema(LONG_TEXT_SCHEMA)
    free = structured.profile(lambda: structured.decode_steps(bench, compiler, PROMPT, 6, None))
    constrained = structured.profile(
        lambda: structured.decode_steps(bench, compiler, PROMPT, 6, spec)
    )
    assert free["engine step"] > 0 and constrained["engine step"] > 0
    assert free["grammar masks (llguidance)"] == 0 < constrained["grammar masks (llguidance)"]
    assert 0 < constrained[structured.LOGITS_STEPS] <= 100  # the tiny model has no argmax head
    compiler.close()


def test_paired_steps_come_in_turns_and_only_while_both_run(bench: structured.Bench) -> None:
    compiler, _ = bench.compiler()
    spec = GrammarSpec.json_schema(LONG_TEXT_SCHEMA)
    steps = structured.paired_decode_steps(bench, compiler, PROMPT, 6, spec)
    assert len(steps["free"]) == len(steps["json"]) >= 5  # six tokens, the prompt's step left out
    assert all(seconds > 0 for way in steps.values() for seconds in way)
    assert compiler.stats.num_masks > 0  # the JSON request ran under its grammar
    assert not bench.runner.sequences and not bench.twin.sequences  # both ran to their end
    compiler.close()


def test_a_burst_of_new_schemas_is_answered_while_others_decode(bench: structured.Bench) -> None:
    specs = [GrammarSpec.json_schema(schema) for schema in list(SCHEMAS.values())[:4]]
    served = structured.serve_burst(
        bench, [PROMPT] * 2, structured.ARRIVE_AFTER + 8, [(PROMPT, spec) for spec in specs]
    )
    assert len(served["ttft_s"]) == 4 and min(served["ttft_s"]) > 0
    assert served["gaps_s"] and served["window_s"] > 0
    assert len(served["compile_s"]) == 4  # each schema compiled once, none found cached
