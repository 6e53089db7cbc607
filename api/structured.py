"""Structured output at the edge: every way a client asks for it, into one `GrammarSpec`, checked
here (`batcher.grammar.check`) so that a schema, regex or grammar that cannot compile is a 422
naming the field and the problem before anything is enqueued.

The shapes taken:

- TGI `parameters.grammar` (and TGI's chat `response_format`): `{"type": "json" | "json_object",
  "value": <schema, or its JSON text>}`, `{"type": "regex", "value": "..."}`,
  `{"type": "json_schema", "value": {"name"?, "schema"}}`.
- OpenAI `response_format` (chat and completions): `{"type": "text"}` (free),
  `{"type": "json_object"}` (any JSON object), `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"?, "description"?}}`. The output always follows the schema: `strict` changes
  nothing.
- vLLM's extras: `guided_json`, `guided_regex`, `guided_grammar` (Lark or GBNF), `guided_choice`
  (one of the strings), and `structured_outputs` `{json | regex | grammar | choice |
  json_object}`. `guided_decoding_backend` and `guided_whitespace_pattern` are accepted and
  change nothing (tgq has one grammar engine; whitespace follows the schema's `x-guidance`).

A request names one of them at most. Deviation from TGI: a JSON schema needs no top-level
`properties`, and it is checked by compiling it, not against the 2020-12 meta-schema.
"""

from __future__ import annotations

import json
from typing import Any

from tgq.api.errors import ValidationError, require
from tgq.batcher.grammar import GrammarError, GrammarKind, GrammarSpec, check

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "grammar", "choice", "json_object")
_STRUCTURED_OUTPUTS_IGNORED = ("disable_any_whitespace", "disable_fallback", "whitespace_pattern")


def tgi_grammar(grammar: dict[str, Any] | None, param: str = "grammar") -> GrammarSpec | None:
    """TGI's `GrammarType`; errors read as TGI's ("grammar is not valid: ...")."""
    if grammar is None:
        return None
    kind, value = grammar.get("type"), grammar.get("value")  # value: Any
    extra = sorted(set(grammar) - {"type", "value"})
    require(not extra, f"grammar is not valid: unknown field `{', '.join(extra)}`", param)
    require(value is not None, "grammar is not valid: missing field `value`", param)
    if kind in ("json", "json_object"):
        spec = GrammarSpec.json_schema(_schema(value, param, "grammar is not valid: "))
    elif kind == "regex":
        require(isinstance(value, str), "grammar is not valid: a regex is a string", param)
        spec = GrammarSpec(GrammarKind.REGEX, str(value))
    elif kind == "json_schema":
        require(
            isinstance(value, dict) and "schema" in value,
            "grammar is not valid: `json_schema` takes {name?, schema}",
            param,
        )
        assert isinstance(value, dict)
        spec = GrammarSpec.json_schema(_schema(value["schema"], param, "grammar is not valid: "))
    else:
        message = (
            f"grammar is not valid: unknown type {kind!r} (json, json_object, regex, json_schema)"
        )
        raise ValidationError(message, param=param)
    return checked(spec, param, "grammar is not valid: ")


def openai_grammar(
    response_format: dict[str, Any] | None, extras: dict[str, Any]
) -> GrammarSpec | None:
    """From OpenAI's `response_format` (or TGI's shape of it) and vLLM's guided-decoding fields
    (`extras`: those of them the body set, by name)."""
    asked = [name for name, value in extras.items() if value is not None]
    if response_format is not None and response_format.get("type", "text") != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        message = f"one kind of structured output per request; got `{'` and `'.join(asked)}`"
        raise ValidationError(message, param=asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        assert response_format is not None
        return _response_format(response_format)
    return _guided(name, extras[name])


def _response_format(response_format: dict[str, Any]) -> GrammarSpec:
    param, kind = "response_format", response_format.get("type")
    if "value" in response_format:  # TGI's GrammarType shape
        return _checked_tgi(response_format, param)
    if kind == "json_object":
        return checked(GrammarSpec.json_schema(_ANY_OBJECT), param)
    if kind == "json_schema":
        config = response_format.get("json_schema")
        require(
            isinstance(config, dict),
            "`response_format` of type `json_schema` needs a `json_schema` object",
            param,
        )
        assert isinstance(config, dict)
        prefix = "`response_format.json_schema.schema` is not valid: "
        # OpenAI's schema is optional (absent: any JSON object).
        schema = _schema(config.get("schema", _ANY_OBJECT), param, prefix)
        return checked(GrammarSpec.json_schema(schema), param, prefix)
    message = (
        f"`response_format` of type `{kind}` is not supported "
        "(text, json_object, json_schema; or TGI's json, regex with a `value`)"
    )
    raise ValidationError(message, param=param)


def _checked_tgi(grammar: dict[str, Any], param: str) -> GrammarSpec:
    spec = tgi_grammar(grammar, param)
    assert spec is not None
    return spec


def _guided(name: str, value: Any) -> GrammarSpec:
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name == "guided_json":
        return checked(GrammarSpec.json_schema(_schema(value, name)), name)
    if name == "guided_regex":
        require(isinstance(value, str), "`guided_regex` is a string", name)
        return checked(GrammarSpec(GrammarKind.REGEX, value), name)
    if name == "guided_grammar":
        require(isinstance(value, str), "`guided_grammar` is a string", name)
        return checked(_lark_or_gbnf(value, name), name)
    return checked(_choice(value, name), name)


def _structured_outputs(value: Any) -> GrammarSpec:
    param = "structured_outputs"
    require(isinstance(value, dict), "`structured_outputs` is an object", param)
    unknown = sorted(set(value) - {*_STRUCTURED_OUTPUTS_KINDS, *_STRUCTURED_OUTPUTS_IGNORED})
    require(not unknown, f"`structured_outputs` does not support `{'`, `'.join(unknown)}`", param)
    kinds = [kind for kind in _STRUCTURED_OUTPUTS_KINDS if value.get(kind) not in (None, False)]
    require(
        len(kinds) == 1,
        f"`structured_outputs` takes exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)}",
        param,
    )
    kind, inner = kinds[0], value[kinds[0]]
    if kind == "json_object":
        return checked(GrammarSpec.json_schema(_ANY_OBJECT), param)
    guided = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar"}
    return _guided(guided.get(kind, "guided_choice"), inner)


def _choice(value: Any, param: str) -> GrammarSpec:
    """One of the strings, exactly: a Lark grammar of string literals (no regex escaping)."""
    is_strings = isinstance(value, list) and all(isinstance(c, str) and c for c in value)
    require(
        is_strings and bool(value), f"`{param}` is a non-empty list of non-empty strings", param
    )
    literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
    return GrammarSpec(GrammarKind.LARK, f"start: {literals}")


def _lark_or_gbnf(grammar: str, param: str) -> GrammarSpec:
    try:
        return GrammarSpec.lark_or_gbnf(grammar)
    except GrammarError as error:
        raise ValidationError(f"`{param}` is not valid: {error}", param=param) from None


def _schema(value: Any, param: str, prefix: str | None = None) -> dict[str, Any] | bool:
    """A schema given as an object or as its JSON text."""
    prefix = prefix if prefix is not None else f"`{param}` is not valid: "
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValidationError(f"{prefix}not valid JSON: {error}", param=param) from None
    require(isinstance(value, dict | bool), f"{prefix}a JSON schema is an object", param)
    schema: dict[str, Any] | bool = value
    return schema


def checked(spec: GrammarSpec, param: str, prefix: str | None = None) -> GrammarSpec:
    """The spec, once llguidance has built its grammar; else a 422 naming `param`."""
    try:
        check(spec)
    except GrammarError as error:
        prefix = prefix if prefix is not None else f"`{param}` is not valid: "
        raise ValidationError(f"{prefix}{error}", param=param) from None
    return spec
