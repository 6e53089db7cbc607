"""A chat request's prompt: its messages rendered with the model's chat template, on the
tokenizer's pool. One renderer, so the chat route and a batch's chat lines fail the same way:

- the model has no chat template: `TemplateError` (422, "Template error: This model has no chat
  template: ...");
- a message no template can take (`normalize_messages`): `ValidationError` naming `messages`;
- the template fails (its own `raise_exception`, an undefined, the sandbox): `TemplateError`
  with the template's reason ("Template error: Conversation roles must alternate ...").
"""

from __future__ import annotations

from collections.abc import Sequence

from tgq.api import chat_template
from tgq.api.chat_template import NO_TEMPLATE_MESSAGE, InvalidMessageError, normalize_messages
from tgq.api.errors import TemplateError, ValidationError
from tgq.api.schemas.openai import RequestMessage
from tgq.api.tokenizer import ModelTokenizer


async def render_chat(tokenizer: ModelTokenizer, messages: Sequence[RequestMessage]) -> str:
    """The prompt for `messages`, ending with the assistant's turn (`add_generation_prompt`)."""
    template = tokenizer.chat_template
    if template is None:
        raise TemplateError(NO_TEMPLATE_MESSAGE)
    try:
        normalized = normalize_messages([m.model_dump(exclude_none=True) for m in messages])
    except InvalidMessageError as error:
        raise ValidationError(str(error), param="messages") from error
    try:
        return await tokenizer.run(template.render, normalized, add_generation_prompt=True)
    except chat_template.ChatTemplateError as error:
        raise TemplateError(str(error)) from error
