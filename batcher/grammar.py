"""What a request asks its output to match (`GrammarSpec`), as it crosses from the api to the
batcher: a kind and the text of the schema, regex or grammar, never a compiled object. Both sides
check it the same way (`check`): the api before anything is enqueued, so a spec that cannot
compile is a 4xx naming the problem; the batcher's compile (`batcher.grammar_compiler`) then only
adds the tokenizer.

The grammar engine is llguidance (an Earley parser over a lazily built lexer, in Rust): it needs
no torch, so the api and the batcher can both use it, and it builds a grammar in milliseconds
without a per-vocabulary precomputation. See docs/structured-output.md for how it was chosen.

JSON schemas compile with llguidance's options unless the schema's own `x-guidance` says
otherwise: no free whitespace (`{"a":1}`, not `{ "a" : 1 }`), so a model cannot pad its answer
with endless blank lines, and the output's length is bounded wherever the schema bounds it. An
object schema that lists `properties` and says nothing of other properties gets none (as
OpenAI's strict mode and xgrammar do): the output still validates against the schema as sent,
without keys the client never asked for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The longest schema, regex or grammar text accepted (bytes, UTF-8): larger specs are refused
# before any work. A 100-property extraction schema is ~10 KB.
MAX_SPEC_BYTES = 64 * 1024
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A spec that cannot be compiled: the message says why, in llguidance's words."""


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # value: the schema as JSON text; "{}" is any JSON value
    REGEX = "regex"  # value: a regular expression the whole output must match
    LARK = "lark"  # value: a Lark-style grammar (llguidance's dialect; GBNF is converted)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    value: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))  # from the wire: a string

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        """A schema as a client sends it, as compact JSON text. Its keys keep their order: an
        object's properties are generated in the order the schema lists them."""
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def lark_or_gbnf(cls, grammar: str) -> GrammarSpec:
        """vLLM's `guided_grammar` takes GBNF (llama.cpp's `::=` rules) or Lark: GBNF is
        converted to Lark here."""
        if "::=" in grammar:
            try:
                grammar = gbnf_to_lark(grammar)
            except Exception as error:  # the converter's own errors carry a position
                raise GrammarError(f"invalid GBNF grammar: {error}") from None
        return cls(GrammarKind.LARK, grammar)

    def to_llguidance(self) -> str:
        """llguidance's grammar text for this spec (no check: see `check`)."""
        if self.kind is GrammarKind.JSON_SCHEMA:
            schema = _closed(json.loads(self.value))
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS))
        if self.kind is GrammarKind.REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(self.value))
        return str(llguidance.LLMatcher.grammar_from_lark(self.value))


_ECHO = re.compile(r"\d+ \| ")  # "   1 | start: /a(/": llguidance quoting the grammar
_POSITION = re.compile(r"^at \d+\(\d+\): ")
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")  # JSON values, not schemas


def _closed(schema: Any, *, in_all_of: bool = False) -> Any:
    """A copy of `schema` whose object schemas with `properties` and no word on other keys allow
    none (`additionalProperties: false`); not the members of an `allOf`, which combine."""
    if isinstance(schema, list):
        return [_closed(item, in_all_of=in_all_of) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _VALUES or key.startswith("x-"):
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            closed[key] = _closed(value, in_all_of=key == "allOf")
    is_open = not any(key in schema for key in _OPEN_KEYWORDS)
    if "properties" in schema and is_open and not in_all_of:
        closed["additionalProperties"] = False
    return closed


def check(spec: GrammarSpec) -> str:
    """The spec's llguidance grammar, or GrammarError with the reason (size, invalid JSON,
    an unsupported schema keyword, a regex or grammar syntax error)."""
    size = len(spec.value.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(f"the {spec.kind} is {size} bytes; the limit is {MAX_SPEC_BYTES}")
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema is an object or a boolean")
    grammar = spec.to_llguidance()
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"invalid {spec.kind}: {tidy(problem, spec.kind)}")
    return grammar


def tidy(problem: str, kind: GrammarKind) -> str:
    """llguidance's message on one line, without its echo of the source and its caret lines; a
    position counts in the grammar llguidance built, so it is dropped unless the client wrote
    that grammar (Lark)."""
    lines = [line.strip() for line in problem.splitlines()]
    kept = [line for line in lines if line and not _ECHO.match(line) and set(line) != {"^"}]
    text = " ".join(kept)
    return text if kind is GrammarKind.LARK else _POSITION.sub("", text)


def spec_from_wire(data: Any) -> GrammarSpec | None:
    """From a message or a job row (a spec there is its fields, as `dataclasses.asdict` and the
    messages' encoder write it); ValueError (or TypeError) when it is not a spec."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) != {"kind", "value"}:
        raise ValueError(f"a grammar is {{'kind', 'value'}}, not {data!r}")
    if not isinstance(data["value"], str):
        raise TypeError("a grammar's value is a string")
    return GrammarSpec(GrammarKind(data["kind"]), data["value"])
