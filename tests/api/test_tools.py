"""Tools on the request side (`api.tools`): every rejection's exact message, what each
`tool_choice` does to the generation, the one schema of forced calls, the tools a chat template
gets (or the last message, when it does not read them) and `--tool-call-parser auto`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from tokenizers import Tokenizer
from tokenizers.models import BPE

from tgq.api.chat_prompt import render_chat
from tgq.api.chat_template import ChatTemplate
from tgq.api.errors import ValidationError
from tgq.api.openai_validation import chat_params
from tgq.api.schemas.openai import ChatCompletionRequest, RequestMessage, Tool
from tgq.api.settings import Settings
from tgq.api.tokenizer import ModelTokenizer
from tgq.api.tool_parsers import FORCED
from tgq.api.tools import (
    DEFAULT_TOOL_PROMPT,
    TOOL_CHOICE_MESSAGE,
    forced_schema,
    prompt_tools,
    resolve_parser,
)
from tgq.api.validated import GenerationParams
from tgq.batcher.grammar import GrammarSpec

SETTINGS = Settings.model_validate({"model_id": "m", "max_total_tokens": 1024})
USER = [{"role": "user", "content": "Weather in Bern?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": WEATHER_PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "the time"}}
BAD = {"type": "function", "function": {"name": "bad", "parameters": {"type": "strin"}}}
TOOLS = [WEATHER, CLOCK]
NAMED_CLOCK = {"type": "function", "function": {"name": "clock"}}


def _chat(**fields: Any) -> GenerationParams:
    body = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    return chat_params(body, SETTINGS)


def _tools(*raw: dict[str, Any]) -> list[Tool]:
    return [Tool.model_validate(tool) for tool in raw]


REJECTIONS = [
    ({"tool_choice": "required"}, '`tool_choice` "required" needs `tools`', "tool_choice"),
    ({"tools": TOOLS, "tool_choice": ""}, TOOL_CHOICE_MESSAGE, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, TOOL_CHOICE_MESSAGE, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
        TOOL_CHOICE_MESSAGE,
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "radio"}}},
        "`tool_choice` names the function `radio`, which is not in `tools`",
        "tool_choice",
    ),
    (
        {"tool_choice": "radio"},  # TGI's bare name
        "`tool_choice` names the function `radio`, which is not in `tools`",
        "tool_choice",
    ),
    (
        {"tools": [WEATHER, WEATHER]},
        "`tools` has more than one function named `weather`",
        "tools",
    ),
    ({"tool_prompt": "Use them"}, "`tool_prompt` is only used with `tools`", "tool_prompt"),
    ({"tools": TOOLS, "tool_prompt": 3}, "`tool_prompt` must be a string", "tool_prompt"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        '`response_format` cannot be used with `tool_choice` "required" or a named function: '
        "the tool calls' schema constrains the output",
        "response_format",
    ),
    (
        {"tools": TOOLS, "tool_choice": NAMED_CLOCK, "guided_json": {"type": "object"}},
        '`guided_json` cannot be used with `tool_choice` "required" or a named function: '
        "the tool calls' schema constrains the output",
        "guided_json",
    ),
    (
        {"tools": [WEATHER, BAD], "tool_choice": "required"},
        "`tools[1].function.parameters` is not valid: invalid json_schema: Invalid type: strin",
        "tools",
    ),
]


@pytest.mark.parametrize(("fields", "message", "param"), REJECTIONS)
def test_rejections_name_the_field(fields: dict[str, Any], message: str, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _chat(**fields)
    assert (caught.value.message, caught.value.param) == (message, param)


def test_what_each_tool_choice_does() -> None:
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "auto"}):
        params = _chat(**fields)
        assert (params.grammar, params.tool_parser) == (None, None)
    auto = _chat(tools=TOOLS)
    assert (auto.grammar, auto.tool_parser, auto.parallel_tool_calls) == (None, "hermes", True)
    tools = _tools(*TOOLS)
    required = _chat(tools=TOOLS, tool_choice="required")
    assert required.grammar == GrammarSpec.json_schema(forced_schema(tools, parallel=True))
    assert required.tool_parser == FORCED
    single = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.grammar == GrammarSpec.json_schema(forced_schema(tools, parallel=False))
    assert not single.parallel_tool_calls
    clock = GrammarSpec.json_schema(forced_schema(tools[1:], parallel=False))
    assert _chat(tools=TOOLS, tool_choice=NAMED_CLOCK).grammar == clock
    assert _chat(tools=TOOLS, tool_choice="clock").grammar == clock


def test_auto_keeps_response_format_and_guided_fields() -> None:
    params = _chat(tools=TOOLS, response_format={"type": "json_object"})
    assert params.grammar == GrammarSpec.json_schema({"type": "object"})
    assert params.tool_parser == "hermes"


def test_the_forced_schema_of_two_tools() -> None:
    assert forced_schema(_tools(*TOOLS), parallel=False) == {
        "type": "array",
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "arguments": {"$ref": f"#/$defs/tool{index}"},
                    },
                    "required": ["name", "arguments"],
                }
                for index, name in enumerate(("weather", "clock"))
            ]
        },
        "minItems": 1,
        "$defs": {"tool0": WEATHER_PARAMETERS, "tool1": {"type": "object", "properties": {}}},
        "maxItems": 1,
    }


def test_forced_calls_validate_as_calls_of_the_tools() -> None:
    validator = jsonschema_rs.validator_for(forced_schema(_tools(*TOOLS), parallel=True))
    weather = {"name": "weather", "arguments": {"unit": "c", "days": 3}}
    assert validator.is_valid([weather, {"name": "clock", "arguments": {}}])
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "weather", "arguments": {"unit": "k", "days": 3}}])
    assert not validator.is_valid([{"name": "radio", "arguments": {}}])
    single = jsonschema_rs.validator_for(forced_schema(_tools(*TOOLS), parallel=False))
    assert single.is_valid([weather]) and not single.is_valid([weather, weather])


def test_references_in_parameters_still_resolve() -> None:
    """Pydantic writes `$defs` and `$ref`s (instructor, LangChain): they move with the tool."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    parameters = {
        "$defs": {"Point": point},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Point"}, "again": {"$ref": "#/properties/at"}},
        "required": ["at"],
    }
    tool = {"type": "function", "function": {"name": "move", "parameters": parameters}}
    schema = forced_schema(_tools(WEATHER, tool), parallel=True)
    assert schema["$defs"]["tool1_Point"] == point
    assert schema["$defs"]["tool1"]["properties"] == {
        "at": {"$ref": "#/$defs/tool1_Point"},
        "again": {"$ref": "#/$defs/tool1/properties/at"},
    }
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid([{"name": "move", "arguments": {"at": {"x": 1}, "again": {"x": 2}}}])
    assert not validator.is_valid([{"name": "move", "arguments": {"at": {"x": "1"}}}])
    _chat(tools=[WEATHER, tool], tool_choice="required")  # llguidance compiles it


# --- what the chat template gets --------------------------------------------------------------

NO_TOOLS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
READS_TOOLS = (
    "{% if tools %}tools:{{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}" + NO_TOOLS
)


@pytest.fixture
def tokenizers() -> Iterator[dict[str, ModelTokenizer]]:
    made = {
        name: ModelTokenizer(Tokenizer(BPE()), chat_template=ChatTemplate(text), max_workers=1)
        for name, text in (("reads", READS_TOOLS), ("ignores", NO_TOOLS))
    }
    yield made
    for tokenizer in made.values():
        tokenizer.close()


def _render(tokenizer: ModelTokenizer, **fields: Any) -> str:
    body = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    messages = [RequestMessage.model_validate(m) for m in body.messages]
    tools, tool_prompt = prompt_tools(body), body.tool_prompt
    return asyncio.run(render_chat(tokenizer, messages, tools=tools, tool_prompt=tool_prompt))


def test_tools_reach_a_template_that_reads_them(tokenizers: dict[str, ModelTokenizer]) -> None:
    reads = tokenizers["reads"]
    assert _render(reads, tools=TOOLS) == "tools:weather,clock\n[user] Weather in Bern?\n"
    assert _render(reads, tools=TOOLS, tool_choice="required").startswith("tools:")
    assert _render(reads, tools=TOOLS, tool_choice="none") == "[user] Weather in Bern?\n"


def test_other_templates_get_them_after_the_last_message(
    tokenizers: dict[str, ModelTokenizer],
) -> None:
    """TGI's rule: `\\n---\\n`, the tools as JSON, a newline and the tool prompt."""
    tools_json = json.dumps(TOOLS)
    expected = f"[user] Weather in Bern?\n---\n{tools_json}\n{DEFAULT_TOOL_PROMPT}\n"
    assert _render(tokenizers["ignores"], tools=TOOLS) == expected
    custom = _render(tokenizers["ignores"], tools=TOOLS, tool_prompt="Call one.")
    assert custom == f"[user] Weather in Bern?\n---\n{tools_json}\nCall one.\n"
    assert _render(tokenizers["ignores"], tools=TOOLS, tool_choice="none") == (
        "[user] Weather in Bern?\n"
    )


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ tools }}<tool_call>{{ messages }}", "hermes"),
        ("{{ tools }}[TOOL_CALLS]{{ messages }}", "mistral"),
        ("{{ tools }}<|python_tag|>{{ messages }}", "llama3_json"),
        ("{% for t in tools %}ipython{% endfor %}", "llama3_json"),
        ("{{ tools }}{{ messages }}", "hermes"),
        ("{{ messages }}", "llama3_json"),  # TGI's appended prompt asks for {name, parameters}
    ],
)
def test_the_auto_parser_follows_the_template(template: str, parser: str) -> None:
    assert resolve_parser("auto", ChatTemplate(template)) == parser
    assert resolve_parser("mistral", ChatTemplate(template)) == "mistral"


def test_the_auto_parser_without_a_template_is_hermes() -> None:
    assert resolve_parser("auto", None) == "hermes"
    params = chat_params(
        ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS}),
        SETTINGS.model_copy(update={"tool_call_parser": "auto"}),
        ChatTemplate("{{ tools }}[TOOL_CALLS]"),
    )
    assert params.tool_parser == "mistral"
