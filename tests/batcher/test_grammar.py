"""Grammar specs and their compiler, without a model: what `check` refuses and how it says so,
the closing of open object schemas, the bounded cache, compiles joined and kept off the caller's
thread, and a constraint's mask and progress over a real tokenizer."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from tokenizers import Tokenizer

from tgq.batcher.grammar import (
    MAX_SPEC_BYTES,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    check,
    spec_from_wire,
)
from tgq.batcher.grammar_compiler import GrammarCompiler
from tgq.devtools.tokenizer import train_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = train_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return (Path(directory) / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json)


@pytest.fixture
def compiler(tokenizer_json: str) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_json, [EOS], max_cache=2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.json_schema({"type": "strin"}), "invalid json_schema: Invalid type: strin"),
        (
            GrammarSpec(GrammarKind.REGEX, "a("),
            'invalid regex: invalid regex "a(" (in regex): regex parse error: a( error: '
            "unclosed group",
        ),
        (GrammarSpec(GrammarKind.LARK, "start: foo"), 'invalid lark: at 1(8): unknown name: "foo"'),
        (
            GrammarSpec.json_schema({"type": "string", "pattern": "(?=a)"}),
            "invalid json_schema: regex parse error: (?=a) error: look-around, including "
            "look-ahead and look-behind, is not supported",
        ),
        (
            GrammarSpec.json_schema({"$ref": "#/$defs/missing"}),
            "invalid json_schema: Pointer '/$defs/missing' does not exist",
        ),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "{"), "the JSON schema is not valid JSON"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1]"), "a JSON schema is an object or a boolean"),
        (
            GrammarSpec(GrammarKind.REGEX, "a" * (MAX_SPEC_BYTES + 1)),
            f"the regex is {MAX_SPEC_BYTES + 1} bytes; the limit is {MAX_SPEC_BYTES}",
        ),
    ],
)
def test_check_refuses_with_the_reason(spec: GrammarSpec, message: str) -> None:
    with pytest.raises(GrammarError) as caught:
        check(spec)
    assert str(caught.value).startswith(message)


def test_gbnf_becomes_lark_and_a_bad_one_is_named() -> None:
    spec = GrammarSpec.lark_or_gbnf('root ::= "a" | "b"')
    assert spec.kind is GrammarKind.LARK and "::=" not in spec.value
    check(spec)
    with pytest.raises(GrammarError, match="invalid GBNF grammar"):
        GrammarSpec.lark_or_gbnf("root ::= (")


def test_specs_cross_the_wire_as_plain_data() -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.value == '{"type":"object","properties":{"b":{},"a":{}}}'  # order kept
    wire = json.loads(json.dumps(dataclasses.asdict(spec)))
    assert spec_from_wire(wire) == spec and spec_from_wire(None) is None
    with pytest.raises(ValueError, match="'xml' is not a valid GrammarKind"):
        spec_from_wire({"kind": "xml", "value": ""})


def _only_outputs(
    compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, texts: list[str]
) -> list[bool]:
    """Whether each text, tokenized, is allowed token by token and completes the grammar."""
    results = []
    for text in texts:
        constraint = compiler.take(spec, compiler.compile(spec))
        allowed = True
        for token_id in tokenizer.encode(text).ids:
            (mask,) = compiler.masks([constraint])
            allowed = bool(mask[token_id // 8] >> (token_id % 8) & 1)
            if not allowed:
                break
            constraint.consume(token_id)
        results.append(allowed and constraint.is_complete)
    return results


def test_objects_that_do_not_say_allow_no_other_properties(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "properties": {"type": "boolean"}},
        "required": ["a"],
    }
    spec = GrammarSpec.json_schema(schema)
    outputs = ['{"a":1}', '{"a":1,"properties":true}', '{"a":1,"b":2}']
    assert _only_outputs(compiler, tokenizer, spec, outputs) == [True, True, False]
    validator = jsonschema_rs.validator_for(schema)
    assert all(validator.is_valid(json.loads(text)) for text in outputs)  # a subset of the schema
    open_schema = {**schema, "additionalProperties": {"type": "integer"}}
    open_spec = GrammarSpec.json_schema(open_schema)
    assert _only_outputs(compiler, tokenizer, open_spec, outputs[2:]) == [True]


def test_the_cache_is_bounded_and_least_recently_used_goes(compiler: GrammarCompiler) -> None:
    specs = [GrammarSpec(GrammarKind.REGEX, f"x{i}") for i in range(3)]
    for spec in specs[:2]:
        assert compiler.cached(spec) is None
        compiler.take(spec, compiler.compile(spec))
    assert compiler.cached(specs[0]) is not None  # now the most recently used
    compiler.take(specs[2], compiler.compile(specs[2]))
    assert compiler.cached(specs[1]) is None  # evicted
    assert compiler.cached(specs[0]) is not None and compiler.cached(specs[2]) is not None
    assert compiler.stats.num_compiles == 3 and compiler.stats.num_cache_hits == 3


def test_one_compile_per_spec_and_failures_raise_on_take(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "[0-9]+")
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert first is second
    one, other = compiler.take(spec, first), compiler.take(spec, second)
    assert one is not other and compiler.stats.num_compiles == 1
    bad = GrammarSpec(GrammarKind.REGEX, "(")
    with pytest.raises(GrammarError, match="unclosed group"):
        compiler.take(bad, compiler.compile(bad))
    assert compiler.stats.num_failures == 1 and compiler.cached(bad) is None


def test_compiles_run_on_their_own_thread(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "[a-z]{3}")
    names = []
    original = compiler._compile

    def recording(spec: GrammarSpec) -> Any:
        names.append(threading.current_thread().name)
        return original(spec)

    compiler._compile = recording  # type: ignore[method-assign]
    compiler.take(spec, compiler.compile(spec))
    assert names and names[0].startswith("grammar-compile")


def test_each_request_advances_its_own_copy(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "ab|cd")
    one = compiler.take(spec, compiler.compile(spec))
    other = compiler.cached(spec)
    assert other is not None
    (a_id,) = tokenizer.encode("a").ids
    (c_id,) = tokenizer.encode("c").ids
    one.consume(a_id)
    assert compiler.masks([other]) != compiler.masks([one])
    other.consume(c_id)
    (d_id,) = tokenizer.encode("d").ids
    other.consume(d_id)
    assert other.is_complete and not one.is_complete
    (mask,) = compiler.masks([other])  # complete: EOS only
    allowed = [t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1]
    assert allowed == [EOS]
    one.consume(c_id)  # not allowed after "a": the constraint breaks and says so
    assert one.error is not None and one.error.startswith("grammar state: ")


@pytest.mark.parametrize("mask_threads", [0, 2])  # the engine's thread; llguidance's pool
def test_masks_at_once_equal_masks_one_by_one(
    tokenizer_json: str, tokenizer: Tokenizer, mask_threads: int
) -> None:
    compiler = GrammarCompiler(tokenizer_json, [EOS], mask_threads=mask_threads)
    assert (compiler._mask_threads is not None) == (mask_threads > 1)
    specs = [GrammarSpec(GrammarKind.REGEX, "[a-z]+"), GrammarSpec.json_schema({"type": "integer"})]
    constraints = [compiler.take(spec, compiler.compile(spec)) for spec in specs for _ in range(3)]
    (a_id,) = tokenizer.encode("a").ids
    constraints[1].consume(a_id)
    together = compiler.masks(constraints)
    assert len(together[0]) == 512 // 8  # the tokenizer's 512 tokens
    assert together == [compiler.masks([constraint])[0] for constraint in constraints]
    assert len({*together}) == 3  # the regex before and after "a", the integer
    compiler.close()


def test_a_row_whose_argmax_misses_takes_its_mask_first_for_longer_each_time(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "[0-9]+")
    constraint = compiler.take(spec, compiler.compile(spec))
    (digit,) = tokenizer.encode("7").ids
    (letter,) = tokenizer.encode("a").ids

    def steps_with_mask_first_after_a_miss() -> int:
        assert constraint.checks_argmax_first() and not constraint.allows(letter, is_eos=False)
        steps = 0
        while not constraint.checks_argmax_first():
            steps += 1
        return steps

    assert [steps_with_mask_first_after_a_miss() for _ in range(9)] == [
        1, 2, 4, 8, 16, 32, 64, 64, 64,
    ]  # fmt: skip
    assert constraint.allows(digit, is_eos=False)  # a hit: the next miss starts again from 1
    assert steps_with_mask_first_after_a_miss() == 1
    stats = compiler.stats
    assert (stats.num_argmax_checks, stats.num_argmax_misses) == (0, 0)  # not through StepMasks


def test_a_step_checks_first_only_as_many_rows_as_the_miss_rate_allows(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "[0-9]+")
    rows = {f"r{i}": compiler.take(spec, compiler.compile(spec)) for i in range(64)}
    for miss_rate, checking in ((0.5, 1), (0.1, 2), (0.01, 25), (0.0, 64)):
        compiler.miss_rate = miss_rate
        masked = compiler.stats.num_masks
        masks = compiler.step_masks({}, rows)
        assert [row for row in rows if masks.checks_argmax_first(row)] == list(rows)[:checking]
        assert compiler.stats.num_masks - masked == 64 - checking  # the rest: computed now
    (digit,) = tokenizer.encode("7").ids
    (letter,) = tokenizer.encode("a").ids
    compiler.miss_rate = 0.1
    masks = compiler.step_masks({}, {"r0": rows["r0"], "r1": rows["r1"]})
    assert masks.allows("r0", digit) and compiler.miss_rate < 0.1
    hit = compiler.miss_rate
    assert not masks.allows("r1", letter) and compiler.miss_rate > hit
