"""A chat request's prompt: its messages rendered with the model's chat template, on the
tokenizer's pool. One renderer, so the chat route and a batch's chat lines fail the same way:

- the model has no chat template: `TemplateError` (422, "Template error: This model has no chat
  template: ...");
- a message no template can take (`normalize_messages`): `ValidationError` naming `messages`;
- the template fails (its own `raise_exception`, an undefined, the sandbox): `TemplateError`
  with the template's reason ("Template error: Conversation roles must alternate ...").

Tools reach the template as `tools`, or end the last message when it does not read them
(`api.tools.append_tools`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tgq.api import chat_template
from tgq.api.chat_template import NO_TEMPLATE_MESSAGE, InvalidMessageError, normalize_messages
from tgq.api.errors import TemplateError, ValidationError
from tgq.api.schemas.openai import RequestMessage
from tgq.api.tokenizer import ModelTokenizer
from tgq.api.tools import append_tools


async def render_chat(
    tokenizer: ModelTokenizer,
    messages: Sequence[RequestMessage],
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_prompt: str | None = None,
) -> str:
    """The prompt for `messages` (and `tools`), ending with the assistant's turn
    (`add_generation_prompt`)."""
    template = tokenizer.chat_template
    if template is None:
        raise TemplateError(NO_TEMPLATE_MESSAGE)
    try:
        normalized = normalize_messages([m.model_dump(exclude_none=True) for m in messages])
    except InvalidMessageError as error:
        raise ValidationError(str(error), param="messages") from error
    try:
        if tools and not template.uses_tools():
            normalized = append_tools(normalized, tools, tool_prompt)
        return await tokenizer.run(
            template.render, normalized, add_generation_prompt=True, tools=tools
        )
    except chat_template.ChatTemplateError as error:
        raise TemplateError(str(error)) from error
