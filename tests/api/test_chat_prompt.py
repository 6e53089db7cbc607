"""A chat request's prompt: rendered on the tokenizer's pool, and every failure answered with one
exact message, whichever path renders it (the chat route, a batch's chat lines)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import BPE

from tgq.api.chat_prompt import render_chat
from tgq.api.chat_template import NO_TEMPLATE_MESSAGE, ChatTemplate
from tgq.api.errors import ApiError, TemplateError, ValidationError, error_body
from tgq.api.schemas.openai import RequestMessage
from tgq.api.tokenizer import ModelTokenizer

# Answers a conversation that does not start with the user the way Mistral's template does.
USER_FIRST = (
    "{% if messages[0]['role'] != 'user' %}"
    "{{ raise_exception('Conversation must start with the user') }}{% endif %}"
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture
def tokenizer() -> Iterator[ModelTokenizer]:
    model_tokenizer = ModelTokenizer(
        Tokenizer(BPE()), chat_template=ChatTemplate(USER_FIRST), max_workers=1
    )
    yield model_tokenizer
    model_tokenizer.close()


def messages(*raw: dict[str, Any]) -> list[RequestMessage]:
    return [RequestMessage.model_validate(message) for message in raw]


def rejection(tokenizer: ModelTokenizer, chat: list[RequestMessage]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        asyncio.run(render_chat(tokenizer, chat))
    return caught.value


def test_renders_the_messages_then_the_assistant_turn(tokenizer: ModelTokenizer) -> None:
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]
    chat = messages({"role": "user", "content": parts}, {"role": "assistant", "content": "hello"})
    prompt = asyncio.run(render_chat(tokenizer, chat))
    assert prompt == "[user] hi you\n[assistant] hello\n[assistant] "


def test_a_model_without_a_template() -> None:
    bare = ModelTokenizer(Tokenizer(BPE()), max_workers=1)
    error = rejection(bare, messages({"role": "user", "content": "hi"}))
    bare.close()
    assert isinstance(error, TemplateError) and error.message == NO_TEMPLATE_MESSAGE
    assert error_body(error, flavour="tgi") == {
        "error": f"Template error: {NO_TEMPLATE_MESSAGE}",
        "error_type": "template_error",
    }


def test_a_message_no_template_can_take(tokenizer: ModelTokenizer) -> None:
    error = rejection(tokenizer, messages({"role": "user"}))
    assert isinstance(error, ValidationError)
    assert error.message == "messages[0]: `content` may be null only with `tool_calls`"
    assert error.param == "messages"


def test_the_template_failing_says_why_once(tokenizer: ModelTokenizer) -> None:
    error = rejection(tokenizer, messages({"role": "system", "content": "be brief"}))
    assert isinstance(error, TemplateError)
    assert error_body(error, flavour="tgi") == {
        "error": "Template error: Conversation must start with the user",
        "error_type": "template_error",
    }
    assert error_body(error, flavour="openai")["error"] == {
        "message": "Template error: Conversation must start with the user",
        "type": "invalid_request_error",
        "param": None,
        "code": "template_error",
    }
