"""Tool calling on `/v1/chat/completions`, the request side: which tools the prompt shows, what
constrains the output and how the output is read (`api.tool_calls` reads it).

`tool_choice` (default `auto` with tools, `none` without):

- `none`: no tools in effect: they are not rendered (as vLLM's `--exclude-tools-when-tool-choice-
  none`), the output is plain content.
- `auto`: the tools are rendered and the model writes freely; its text is read for calls in its
  own format (`api.tool_parsers`, `--tool-call-parser`).
- `required`, or a named function (`{"type": "function", "function": {"name": ...}}`, or TGI's
  bare name): one JSON schema constrains the output (`forced_schema`): an array of calls
  `{"name": <a tool's name>, "arguments": <an object that tool's `parameters` validate>}`, one
  to any number of them (exactly one with `parallel_tool_calls: false` or a named function, whose
  array offers only that tool). Every finished output parses, and its arguments validate.
  `response_format` and vLLM's guided fields constrain the output too: either, not both (422).
  With `auto` they apply, and the output they shape is still read for calls.

The tools reach the chat template as transformers passes them (`tools=[{"type": "function",
"function": {...}}]`). A template that does not read `tools` gets them as TGI does: appended to the
last message, `"\\n---\\n" + <the tools as JSON> + "\\n" + tool_prompt` (TGI's default prompt,
which asks for `{name, parameters}` JSON: `--tool-call-parser auto` reads such a model's output
with `llama3_json`). A tool's `parameters` are compiled only where they constrain the output
(`required`, named); with `auto` they are only shown to the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from tgq.api.chat_template import ChatTemplate, ChatTemplateError
from tgq.api.errors import ValidationError, require
from tgq.api.schemas.openai import ChatCompletionRequest, Tool
from tgq.api.structured import checked
from tgq.api.tool_parsers import FORCED, ParserName, guess_parser
from tgq.batcher.grammar import GrammarError, GrammarSpec, check

DEFAULT_TOOL_PROMPT = (  # TGI's
    "\nGiven the functions available, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt. Respond in the format {name: function "
    "name, parameters: dictionary of argument name and its value}.Do not use variables.\n"
)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # OpenAI: no arguments
TOOL_CHOICE_MESSAGE = (
    '`tool_choice` must be "none", "auto", "required", a function name or '
    '{"type": "function", "function": {"name": ...}}'
)
REQUIRED_NEEDS_TOOLS_MESSAGE = '`tool_choice` "required" needs `tools`'
TOOL_PROMPT_MESSAGE = "`tool_prompt` is only used with `tools`"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request's tools do to its generation."""

    grammar: GrammarSpec | None = None  # `required`, named: the calls' schema
    parser: str | None = None  # FORCED, an `auto` parser's name, or None: plain content
    parallel: bool = True


def tool_use(
    request: ChatCompletionRequest, *, parser_setting: str, template: ChatTemplate | None
) -> ToolUse:
    """The request's tools checked (422 naming the field) and what they do."""
    tools = request.tools or []
    parallel = request.parallel_tool_calls is not False
    _check_tool_prompt(request.tool_prompt, has_tools=bool(tools))
    _check_unique_names(tools)
    choice, name = _choice(request.tool_choice, has_tools=bool(tools))
    if choice == "auto" and tools:
        return ToolUse(parser=resolve_parser(parser_setting, template), parallel=parallel)
    if choice in ("none", "auto"):  # `auto` without tools: nothing to call
        return ToolUse(parallel=parallel)
    _check_not_structured(request)
    if name is not None:
        named = [tool for tool in tools if tool.function.name == name]
        if not named:
            raise ValidationError(
                f"`tool_choice` names the function `{name}`, which is not in `tools`",
                param="tool_choice",
            )
        return ToolUse(_forced_grammar(tools, named, parallel=False), FORCED, parallel=False)
    return ToolUse(_forced_grammar(tools, tools, parallel=parallel), FORCED, parallel)


def prompt_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template gets: none without tools or with `tool_choice: none`."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def resolve_parser(setting: str, template: ChatTemplate | None) -> ParserName:
    """`--tool-call-parser`, with `auto` read from the chat template."""
    if setting != "auto":
        return cast(ParserName, setting)  # the setting's Literal, less "auto"
    if template is None:
        return "hermes"
    try:
        if not template.uses_tools():
            return "llama3_json"  # TGI's appended prompt asks for {name, parameters}
    except ChatTemplateError:
        return "hermes"  # rendering will say what is wrong with it
    return guess_parser("\n".join(template.templates.values()))


def append_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_prompt: str | None
) -> list[dict[str, Any]]:
    """TGI's rule for a template that does not read `tools`: they end the last message."""
    if not messages:
        return messages
    last = messages[-1]
    text = f"\n---\n{json.dumps(tools, ensure_ascii=False)}\n{tool_prompt or DEFAULT_TOOL_PROMPT}"
    return [*messages[:-1], {**last, "content": (last.get("content") or "") + text}]


def forced_schema(tools: list[Tool], *, parallel: bool) -> dict[str, Any]:
    """An array of 1 (`parallel` false) or more calls of these tools. Each tool's `parameters`
    move under the root's `$defs` (with their own `$defs` beside them, renamed), so that their
    `$ref`s still resolve from the root of the array's schema."""
    defs: dict[str, Any] = {}
    calls = []
    for index, tool in enumerate(tools):
        prefix = f"tool{index}"
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, schema in parameters.pop(key, {}).items():
                defs[f"{prefix}_{name}"] = _moved_refs(schema, prefix)
        defs[prefix] = _moved_refs(parameters, prefix)
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": {"$ref": f"#/$defs/{prefix}"},
                },
                "required": ["name", "arguments"],
            }
        )
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": item, "minItems": 1, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _moved_refs(schema: Any, prefix: str) -> Any:
    """`schema` with its local `$ref`s pointing where `forced_schema` moved their targets."""
    if isinstance(schema, list):
        return [_moved_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: _moved_refs(value, prefix) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        if ref == "#":
            moved["$ref"] = f"#/$defs/{prefix}"
        elif ref.startswith(("#/$defs/", "#/definitions/")):
            moved["$ref"] = f"#/$defs/{prefix}_{ref.split('/', 2)[2]}"
        else:  # a pointer into the parameters themselves
            moved["$ref"] = f"#/$defs/{prefix}/{ref[2:]}"
    return moved


def _forced_grammar(all_tools: list[Tool], tools: list[Tool], *, parallel: bool) -> GrammarSpec:
    spec = GrammarSpec.json_schema(forced_schema(tools, parallel=parallel))
    try:
        check(spec)
    except GrammarError:
        for index, tool in enumerate(all_tools):
            if tool in tools:
                _check_parameters(index, tool)
        return checked(spec, "tools", "`tools` are not valid: ")  # raises: the whole is at fault
    return spec


def _check_parameters(index: int, tool: Tool) -> None:
    param = f"tools[{index}].function.parameters"
    spec = GrammarSpec.json_schema(tool.function.parameters or NO_PARAMETERS)
    checked(spec, "tools", f"`{param}` is not valid: ")


def _choice(value: str | dict[str, Any] | None, *, has_tools: bool) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function's name)."""
    if value is None:
        return ("auto" if has_tools else "none"), None
    if value in ("none", "auto"):
        return str(value), None
    if value == "required":
        require(has_tools, REQUIRED_NEEDS_TOOLS_MESSAGE, "tool_choice")
        return "required", None
    if isinstance(value, str) and value:
        return "named", value  # TGI takes a function's name as it is
    function = value.get("function") if isinstance(value, dict) else None
    is_named = (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    )
    require(is_named, TOOL_CHOICE_MESSAGE, "tool_choice")
    assert isinstance(function, dict)
    return "named", str(function["name"])


def _check_not_structured(request: ChatCompletionRequest) -> None:
    fields = request.structured_fields()
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        fields = {"response_format": response_format, **fields}
    field = next((name for name, value in fields.items() if value is not None), None)
    if field is not None:
        message = (
            f'`{field}` cannot be used with `tool_choice` "required" or a named function: '
            "the tool calls' schema constrains the output"
        )
        raise ValidationError(message, param=field)


def _check_tool_prompt(tool_prompt: Any, *, has_tools: bool) -> None:
    if tool_prompt is None:
        return
    require(has_tools, TOOL_PROMPT_MESSAGE, "tool_prompt")
    require(isinstance(tool_prompt, str), "`tool_prompt` must be a string", "tool_prompt")


def _check_unique_names(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for tool in tools:
        name = tool.function.name
        require(name not in seen, f"`tools` has more than one function named `{name}`", "tools")
        seen.add(name)
