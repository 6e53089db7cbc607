"""`tool_choice: "auto"`: the model writes freely and its text is read for the tool calls it wrote
in its own format. One parser per format, chosen by `--tool-call-parser`:

- `hermes` (Hermes 2/3, Qwen 2.5/3 and most templates since): `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, possibly several; the last one may lack its closing tag
  (the model stopped right after the JSON). Text around the blocks is content.
- `llama3_json` (Llama 3.1/3.2/3.3): the whole output is one call `{"name": ..., "parameters":
  {...}}` (or `"arguments"`), optionally after `<|python_tag|>`, or several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, text before the marker is
  content. `[TOOL_CALLS]` is a special token, which the decoded output leaves out: an output that
  is only such a JSON array reads as calls too.
- `auto` (the setting): the format the chat template writes (`<tool_call>` → hermes,
  `[TOOL_CALLS]` → mistral, `<|python_tag|>` or `ipython` → llama3_json), else hermes; a
  template that does not read `tools` gets TGI's prompt, which asks for llama3_json's format
  (`api.tools.resolve_parser`).

All or nothing: when one block is not a call (bad JSON, no `name`, arguments that are not an
object), the output has no calls and all of it is content; a parser never raises. Calls are
returned whatever their name, as vLLM does: the client knows its tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# `GenerationParams.tool_parser` of `required` and named choices: the output is the grammar's
# JSON array of calls (`api.tools`), read by `api.tool_calls.ForcedCalls`.
FORCED = "forced"
ParserName = Literal["hermes", "llama3_json", "mistral"]
PARSER_NAMES: tuple[ParserName, ...] = ("hermes", "llama3_json", "mistral")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, slots=True)
class Parsed:
    start: int  # where the first call begins in the text: what precedes it is content
    calls: list[ParsedCall]
    after: str  # the content after the first call (between and after the calls), stripped


class ToolCallParser(Protocol):
    def hold_from(self, text: str) -> int:
        """Where the text may start a call (held back when streaming); `len(text)`: nowhere."""

    def parse(self, text: str) -> Parsed | None:
        """The calls in a finished output; None when it has none (all of it is content)."""


def guess_parser(template_text: str) -> ParserName:
    """The parser for a chat template's own tool-call format (`--tool-call-parser auto`)."""
    if HERMES_START in template_text:
        return "hermes"
    if MISTRAL_MARKER in template_text:
        return "mistral"
    if PYTHON_TAG in template_text or "ipython" in template_text:
        return "llama3_json"
    return "hermes"


def parser_of(name: str) -> ToolCallParser:
    return _PARSERS[name]


def _call(raw: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from its JSON: a non-empty string `name` and an object of arguments (or its JSON
    text) under one of `argument_keys`; absent arguments are `{}`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        return None
    arguments: Any = next((raw[key] for key in argument_keys if key in raw), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(raw["name"], json.dumps(arguments, ensure_ascii=False))


def _leading_json(text: str) -> tuple[Any, str] | None:
    """The JSON value `text` starts with (after whitespace) and the text after it."""
    stripped = text.lstrip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError:
        return None
    return value, stripped[end:]


def _json_values(text: str) -> tuple[list[Any], str] | None:
    """The JSON values `text` starts with, separated by `;`, and the text after them."""
    values: list[Any] = []
    while (found := _leading_json(text)) is not None:
        value, text = found
        values.append(value)
        if not text.lstrip().startswith(";"):
            break
        text = text.lstrip()[1:]
    return (values, text) if values else None


def _partial_marker(text: str, marker: str) -> int:
    """Where a prefix of `marker` ends the text (`len(text)` if none does)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)


def _calls(values: list[Any], argument_keys: tuple[str, ...]) -> list[ParsedCall] | None:
    flat = [item for value in values for item in (value if isinstance(value, list) else [value])]
    calls = [_call(raw, argument_keys) for raw in flat]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


class HermesParser:
    def hold_from(self, text: str) -> int:
        found = text.find(HERMES_START)
        return found if found >= 0 else _partial_marker(text, HERMES_START)

    def parse(self, text: str) -> Parsed | None:
        start = text.find(HERMES_START)
        if start < 0:
            return None
        calls: list[ParsedCall] = []
        outside, position = [], start
        while (found := text.find(HERMES_START, position)) >= 0:
            outside.append(text[position:found])
            body_start = found + len(HERMES_START)
            end = text.find(HERMES_END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            try:
                call = _call(json.loads(body), ("arguments",))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
            position = len(text) if end < 0 else end + len(HERMES_END)
        outside.append(text[position:])
        return Parsed(start, calls, "".join(outside).strip())


class Llama3JsonParser:
    """The whole output is calls: text before them (other than whitespace) makes it content."""

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        is_call = stripped.startswith(("{", "[", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped)
        return start if stripped and is_call else len(text)

    def parse(self, text: str) -> Parsed | None:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        found = _json_values(stripped.removeprefix(PYTHON_TAG))
        if found is None or found[1].strip():
            return None
        calls = _calls(found[0], ("parameters", "arguments"))
        return None if calls is None else Parsed(start, calls, "")


class MistralParser:
    def hold_from(self, text: str) -> int:
        found = text.find(MISTRAL_MARKER)
        if found >= 0:
            return found
        stripped = text.lstrip()
        if stripped.startswith("["):  # the marker left out by the decoding
            return len(text) - len(stripped)
        return _partial_marker(text, MISTRAL_MARKER)

    def parse(self, text: str) -> Parsed | None:
        marked = text.find(MISTRAL_MARKER)
        if marked >= 0:
            start, body = marked, text[marked + len(MISTRAL_MARKER) :]
        else:
            body = text.lstrip()
            start = len(text) - len(body)
        found = _leading_json(body)
        if found is None or not isinstance(found[0], list):
            return None
        value, after = found
        if marked < 0 and after.strip():
            return None  # an unmarked array is the whole output, or not calls
        calls = _calls([value], ("arguments",))
        return None if calls is None else Parsed(start, calls, after.strip())


_PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
}
