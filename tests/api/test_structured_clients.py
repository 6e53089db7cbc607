"""Structured output through real clients, unmodified, against the real stack: the openai SDK's
`parse` with a pydantic model (and its streaming helper), TGI's `text-generation` client and
`huggingface_hub`'s `InferenceClient` with a grammar, and a durable job with a grammar whose
results are read back. The model has random weights: only the structure is checked."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.api.stack import Stack
from tests.api.test_http_jobs import wait_for

pytestmark = pytest.mark.timeout(300)


class Verdict(BaseModel):
    """Bounded everywhere, so a random model completes it within `MAX_TOKENS`."""

    verdict: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=10)
    tags: list[Literal["urgent", "later"]] = Field(max_length=2)


SCHEMA = Verdict.model_json_schema()
# The longest output the schema allows is a forced tool call of 90 characters,
# `[{"name":"Verdict","arguments":{"verdict":"maybe","score":10,"tags":["urgent","urgent"]}}]`
# (no free whitespace): at worst one token each. 60 left a sampled answer short now and then.
MAX_TOKENS = 96
PROMPT = "Is the contract signed? Answer as JSON."


def test_openai_parse_returns_the_pydantic_model(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    for temperature in (0.0, 1.5):
        completion = client.chat.completions.parse(
            model="tgq-test",
            messages=[{"role": "user", "content": PROMPT}],
            response_format=Verdict,
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=3,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Verdict)


def test_openai_stream_helper_parses_the_streamed_json(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    with client.chat.completions.stream(
        model="tgq-test",
        messages=[{"role": "user", "content": PROMPT}],
        response_format=Verdict,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Verdict)


def test_text_generation_client_with_a_grammar(stack: Stack) -> None:
    client = Client(stack.url, timeout=60)
    json_grammar = Grammar(type=GrammarType.Json, value=SCHEMA)
    answer = client.generate(
        PROMPT, max_new_tokens=MAX_TOKENS, grammar=json_grammar, do_sample=True
    )
    Verdict.model_validate_json(answer.generated_text)
    regex = Grammar(type=GrammarType.Regex, value="[0-9]{3}-[a-z]{2}")
    tokens = list(client.generate_stream(PROMPT, max_new_tokens=20, grammar=regex))
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", tokens[-1].generated_text or "")


def test_huggingface_hub_inference_client_with_a_grammar(stack: Stack) -> None:
    client = InferenceClient(base_url=stack.url)
    text = client.text_generation(
        PROMPT,
        max_new_tokens=MAX_TOKENS,
        grammar={"type": "json", "value": SCHEMA},
        return_full_text=False,
    )
    Verdict.model_validate_json(text)


def test_a_job_with_a_grammar_records_it_and_every_result_follows_it(stack: Stack) -> None:
    import httpx

    body = {
        "prompt": [f"Contract {i}: is it signed?" for i in range(6)],
        "parameters": {
            "grammar": {"type": "json", "value": SCHEMA},
            "max_new_tokens": MAX_TOKENS,
            "do_sample": True,
            "temperature": 1.5,
        },
    }
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        job = wait_for(http, http.post("/v1/jobs", json=body).json()["id"])
    assert job["status"] == "succeeded"
    for result in job["results"]:
        assert result["finish_reason"] == "stop"
        Verdict.model_validate(json.loads(result["text"]))


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_the_pydantic_model(stack: Stack, mode: str) -> None:
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused"), mode=instructor.Mode[mode]
    )
    verdict = client.chat.completions.create(
        model="tgq-test",
        messages=[{"role": "user", "content": PROMPT}],
        response_model=Verdict,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        max_retries=0,  # the first answer must validate
    )
    assert isinstance(verdict, Verdict)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stack: Stack, method: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{stack.url}/v1",
        api_key="unused",
        model="tgq-test",
        max_tokens=MAX_TOKENS,
    )
    structured = chat.with_structured_output(Verdict, method=method)  # type: ignore[arg-type]
    assert isinstance(structured.invoke(PROMPT), Verdict)
