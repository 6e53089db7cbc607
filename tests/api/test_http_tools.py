"""Tool calling through HTTP, against the real stack and its random-weight model, with real
clients: the `openai` SDK (plain, and its stream helper reassembling the deltas) and LangChain's
`ChatOpenAI.bind_tools`.

`required` and named choices are constrained by the tools' schemas, so whatever the random
weights pick the arguments validate; the tools' schemas are small and bounded (an enum, an
integer from 1 to 7) so the model completes them within `max_tokens`. `auto` cannot wait for a
random model to write a call: its output is forced into Hermes' format with `guided_regex`
(which `auto` allows beside the tools), so the parser runs end to end on what the engine wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema_rs
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel, Field

from tests.api.stack import Stack

pytestmark = pytest.mark.timeout(300)
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the forecast",
        "parameters": WEATHER_PARAMETERS,
    },
}
CLOCK: ChatCompletionToolParam = {"type": "function", "function": {"name": "clock"}}
SCHEMAS = {"weather": WEATHER_PARAMETERS, "clock": {"type": "object", "properties": {}}}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Bern?"}]
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=60) as sdk:
        yield sdk


def _check_calls(calls: Any, *, names: tuple[str, ...] = ("weather", "clock")) -> None:
    """Each call has an OpenAI id and arguments its tool's schema validates."""
    assert calls
    for call in calls:
        assert CALL_ID.fullmatch(call.id) and call.type == "function"
        assert call.function.name in names
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))


def _create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        **{"model": "tgq-test", "messages": MESSAGES, "max_tokens": 64, "temperature": 0, **fields}
    )


def test_required_returns_one_call_whose_arguments_validate(client: openai.OpenAI) -> None:
    fields = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False}
    answer = _create(client, **fields)
    choice = answer.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


def test_parallel_calls_each_validate(client: openai.OpenAI) -> None:
    """Sampled: greedy random weights would add calls until `max_tokens`."""
    numbers = []
    for seed in range(4):
        answer = _create(
            client, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=400,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = answer.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        _check_calls(choice.message.tool_calls)
        numbers.append(len(choice.message.tool_calls))
    assert max(numbers) > 1, numbers


def test_a_named_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    answer = _create(client, tools=[WEATHER, CLOCK], tool_choice=named, temperature=1.0, seed=3)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, names=("weather",))


def test_the_sdk_stream_helper_reassembles_the_calls(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 64}
    plain = _create(client, **fields, parallel_tool_calls=False).choices[0].message
    with client.chat.completions.stream(
        model="tgq-test", messages=MESSAGES, temperature=0, parallel_tool_calls=False, **fields
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls is not None and plain.tool_calls is not None
    _check_calls(final.message.tool_calls)
    streamed, expected = final.message.tool_calls[0].function, plain.tool_calls[0].function
    assert (streamed.name, streamed.arguments) == ("weather", expected.arguments)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices]
    calls = [call for delta in deltas for call in delta or []]
    assert calls[0].function is not None
    assert (calls[0].index, calls[0].type, calls[0].function.arguments) == (0, "function", "")
    assert CALL_ID.fullmatch(calls[0].id or "")
    assert len(calls) > 2 and all(call.id is None for call in calls[1:])  # arguments in pieces


def test_auto_reads_the_models_own_calls(client: openai.OpenAI) -> None:
    """The output forced to `Checking. <tool_call>{...}</tool_call>`: content and one call, the
    same streamed (content first, the call at the end) as not."""
    call = '{"name": "weather", "arguments": {"unit": "f", "days": 2}}'
    fields: dict[str, Any] = {
        "tools": [WEATHER, CLOCK],
        "max_tokens": 200,
        "extra_body": {"guided_regex": re.escape(f"Checking. <tool_call>{call}</tool_call>")},
    }
    message = _create(client, **fields).choices[0].message
    assert message.content == "Checking."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    assert message.tool_calls[0].function.arguments == '{"unit": "f", "days": 2}'
    with client.chat.completions.stream(
        model="tgq-test", messages=MESSAGES, temperature=0, **fields
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking."
    assert final.message.tool_calls is not None
    assert final.message.tool_calls[0].function.arguments == '{"unit": "f", "days": 2}'
    assert kinds.index("content.delta") < kinds.index("tool_calls.function.arguments.delta")


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI) -> None:
    plain = _create(client, max_tokens=8).choices[0]
    answer = _create(client, tools=[WEATHER], tool_choice="none", max_tokens=8).choices[0]
    assert (answer.message.content, answer.message.tool_calls) == (plain.message.content, None)
    auto = _create(client, tools=[WEATHER], max_tokens=8).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")


def test_a_conversation_with_tool_calls_and_results(client: openai.OpenAI) -> None:
    first = _create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages: list[ChatCompletionMessageParam] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'},
    ]
    answer = client.chat.completions.create(
        model="tgq-test", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"


def test_structured_output_and_forced_calls_together_are_refused(stack: Stack) -> None:
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 422
    assert response.json()["error"] == {
        "message": '`response_format` cannot be used with `tool_choice` "required" or a named '
        "function: the tool calls' schema constrains the output",
        "type": "invalid_request_error",
        "param": "response_format",
        "code": None,
    }


class Weather(BaseModel):
    """The forecast."""

    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)


@pytest.mark.parametrize("tool_choice", ["required", "Weather"])
def test_langchain_bind_tools(stack: Stack, tool_choice: str) -> None:
    chat = ChatOpenAI(
        model="tgq-test", base_url=f"{stack.url}/v1", api_key="unused", temperature=0,
        max_completion_tokens=64,
    )  # fmt: skip
    bound = chat.bind_tools([Weather], tool_choice=tool_choice, parallel_tool_calls=False)
    answer = bound.invoke("Weather in Bern?")
    assert isinstance(answer, AIMessage)
    assert [call["name"] for call in answer.tool_calls] == ["Weather"]
    Weather.model_validate(answer.tool_calls[0]["args"])
    assert answer.response_metadata["finish_reason"] == "tool_calls"
