"""Real clients, unmodified, against the real stack: the `openai` SDK (sync, async, streaming),
`huggingface_hub.InferenceClient` (text generation with and without streaming, chat) and TGI's
own `text-generation` client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from huggingface_hub import InferenceClient
from openai.types.chat import ChatCompletionMessageParam
from text_generation import AsyncClient, Client

from tests.api.stack import Stack

pytestmark = pytest.mark.timeout(300)
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something"}]


def test_openai_sync_chat_and_completions(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tgq-test",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    completion = client.completions.create(
        model="tgq-test", prompt=["a", "b"], max_tokens=4, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert [m.id for m in client.models.list()] == ["tgq-test"]


def test_openai_sync_stream_equals_the_plain_answer(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    plain = (
        client.chat.completions.create(
            model="tgq-test", messages=MESSAGES, max_tokens=10, temperature=0
        )
        .choices[0]
        .message.content
    )
    stream = client.chat.completions.create(
        model="tgq-test",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_openai_async_with_errors_as_exceptions(stack: Stack) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="tgq-test",
                    messages=[{"role": "user", "content": f"number {i}"}],
                    max_tokens=5,
                    seed=i,
                    temperature=0.8,
                )
                for i in range(8)
            )
        )
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        stream = await client.chat.completions.create(
            model="tgq-test",
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
        )
        assert [c async for c in stream]
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.chat.completions.create(
                model="tgq-test",
                messages=MESSAGES,
                max_tokens=5,
                top_logprobs=99,
                logprobs=True,
            )
        assert "top_logprobs" in str(caught.value)
        await client.close()

    asyncio.run(run())


def test_huggingface_hub_inference_client(stack: Stack) -> None:
    client = InferenceClient(base_url=stack.url)
    text = client.text_generation("The Python language", max_new_tokens=6)
    assert isinstance(text, str)
    details = client.text_generation("The Python language", max_new_tokens=6, details=True)
    assert details.generated_text == text and details.details is not None
    assert details.details.generated_tokens == len(details.details.tokens)
    streamed = list(client.text_generation("The Python language", max_new_tokens=6, stream=True))
    assert text == "The Python language" + "".join(streamed)  # `/` defaults to the full text
    chat = client.chat_completion(MESSAGES, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content is not None
    pieces = list(client.chat_completion(MESSAGES, max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == (
        chat.choices[0].message.content
    )


def test_text_generation_client(stack: Stack) -> None:
    client = Client(stack.url, timeout=60)
    response = client.generate("def main():", max_new_tokens=6, top_n_tokens=2)
    assert response.details.generated_tokens == len(response.details.tokens)
    assert len(response.details.top_tokens) == len(response.details.tokens)
    tokens = list(client.generate_stream("def main():", max_new_tokens=6))
    assert [t.token.id for t in tokens] == [t.id for t in response.details.tokens]
    assert tokens[-1].generated_text == response.generated_text
    best = client.generate("x", max_new_tokens=3, best_of=2, do_sample=True)
    assert best.details.best_of_sequences is not None

    async def run() -> None:
        answer = await AsyncClient(stack.url, timeout=60).generate("def main():", max_new_tokens=6)
        assert answer.generated_text == response.generated_text

    asyncio.run(run())
