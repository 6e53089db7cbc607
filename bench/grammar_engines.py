"""Grammar engines side by side, as structured output uses them: build the tokenizer once, then per
schema compile (up to the first mask) and walk a valid answer token by token, timing each mask.

    python -m bench.grammar_engines [--tokenizer llama3|mistral] [--repeats 3]

llguidance is tgq's dependency; xgrammar and outlines-core are measured when installed (they are
not dependencies: `pip install xgrammar outlines-core` in a scratch environment). Prints one
table: tokenizer build, compile p50 and max, mask p50 and max per engine. xgrammar imports torch,
so whatever its speed it could not run in the torch-free batcher and api.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from tests.batcher.tokenizer_zoo import load

SCHEMAS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Alice Smith", "age": 42, "email": "alice@example.com"},
    ),
    (
        {
            "type": "object",
            "properties": {
                "parties": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "role": {"enum": ["buyer", "seller", "agent"]},
                        },
                        "required": ["name", "role"],
                        "additionalProperties": False,
                    },
                },
                "amount": {"type": "number"},
                "currency": {"enum": ["USD", "EUR"]},
                "signed": {"type": "boolean"},
                "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["parties", "amount", "currency", "signed", "notes"],
            "additionalProperties": False,
        },
        {
            "parties": [{"name": "Acme Corp", "role": "buyer"}, {"name": "Bob", "role": "seller"}],
            "amount": 1250.5,
            "currency": "EUR",
            "signed": True,
            "notes": None,
        },
    ),
]
Result = tuple[float, list[float], list[float]]  # tokenizer build s, compile s, mask s


def _llguidance(tokenizer_json: str, eos: int) -> Callable[[int], Result]:
    import llguidance

    def run(repeats: int) -> Result:
        started = time.perf_counter()
        tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        build = time.perf_counter() - started
        compiles, masks = [], []
        for _ in range(repeats):
            for schema, answer in SCHEMAS:
                started = time.perf_counter()
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, {"whitespace_flexible": False}
                )
                matcher = llguidance.LLMatcher(tokenizer, grammar)
                matcher.compute_bitmask()
                compiles.append(time.perf_counter() - started)
                for token_id in tokenizer.tokenize_str(json.dumps(answer, separators=(",", ":"))):
                    assert matcher.consume_token(token_id), matcher.get_error()
                    started = time.perf_counter()
                    matcher.compute_bitmask()
                    masks.append(time.perf_counter() - started)
        return build, compiles, masks

    return run


def _xgrammar(tokenizer_json: str, eos: int) -> Callable[[int], Result]:
    import xgrammar  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast

    def run(repeats: int) -> Result:
        hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizers(tokenizer_json))
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[eos])
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        build = time.perf_counter() - started
        compiles, masks = [], []
        for _ in range(repeats):
            for schema, answer in SCHEMAS:
                started = time.perf_counter()
                compiled = compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=(",", ":")
                )
                matcher = xgrammar.GrammarMatcher(compiled)
                bitmask = xgrammar.allocate_token_bitmask(1, len(hf))
                matcher.fill_next_token_bitmask(bitmask)
                compiles.append(time.perf_counter() - started)
                text = json.dumps(answer, separators=(",", ":"))
                for token_id in hf.encode(text, add_special_tokens=False):
                    assert matcher.accept_token(token_id)
                    started = time.perf_counter()
                    matcher.fill_next_token_bitmask(bitmask)
                    masks.append(time.perf_counter() - started)
        return build, compiles, masks

    return run


def _outlines_core(tokenizer_json: str, eos: int) -> Callable[[int], Result]:
    from outlines_core import Guide, Index, Vocabulary  # type: ignore[import-not-found]
    from outlines_core.json_schema import build_regex_from_schema  # type: ignore[import-not-found]

    def run(repeats: int) -> Result:
        tokenizer = _tokenizers(tokenizer_json)
        started = time.perf_counter()
        vocabulary: dict[str, list[int]] = {}
        for token_id in tokenizer.get_vocab().values():
            text = tokenizer.decode([token_id])
            if token_id != eos and text:
                vocabulary.setdefault(text, []).append(token_id)
        vocab = Vocabulary(eos, vocabulary)
        build = time.perf_counter() - started
        compiles = []
        for _ in range(repeats):
            for schema, _answer in SCHEMAS:
                started = time.perf_counter()
                guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocab))
                guide.get_tokens()
                compiles.append(time.perf_counter() - started)
        return build, compiles, []  # its masks are a precomputed table lookup

    return run


def _tokenizers(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core}
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def _ms(values: list[float], pick: Callable[[list[float]], float]) -> str:
    return f"{pick(values) * 1e3:.3f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", choices=("llama3", "mistral"), default="llama3")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load(args.tokenizer)
    eos = tokenizer.token_to_id("<|end_of_text|>" if args.tokenizer == "llama3" else "</s>")
    assert eos is not None
    tokenizer_json = tokenizer.to_str()
    print(f"vocabulary {tokenizer.get_vocab_size()} ({args.tokenizer}), {len(SCHEMAS)} schemas")
    print("engine         build ms  compile p50  compile max  mask p50 ms  mask max ms")
    for name, make in ENGINES.items():
        if importlib.util.find_spec(MODULES[name]) is None:
            print(f"{name:<14} not installed")
            continue
        build, compiles, masks = make(tokenizer_json, eos)(args.repeats)
        print(
            f"{name:<14} {build * 1e3:8.0f}  {_ms(compiles, statistics.median):>11}"
            f"  {_ms(compiles, max):>11}  {_ms(masks, statistics.median):>11}"
            f"  {_ms(masks, max):>11}"
        )


if __name__ == "__main__":
    main()
