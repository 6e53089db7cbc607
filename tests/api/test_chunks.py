"""The chat stream's per-token chunk is rendered from a template (no models per token): it must
be byte-for-byte what the response models render."""

from __future__ import annotations

import pytest

from tgq.api.routes.openai import _content_chunk
from tgq.api.schemas.openai import ChatCompletionChunk, ChunkChoice, Delta
from tgq.api.sse import data_event


def chunk(choices: list[ChunkChoice]) -> bytes:
    body = ChatCompletionChunk(
        id="chatcmpl-job_1", created=1, model="m/x", system_fingerprint="0.1.0", choices=choices
    )
    return data_event(body.model_dump_json())


@pytest.mark.parametrize(
    "text", ["", "plain", ' "quoted" \\ back', "line\nbreak\ttab", "é你\U0001f600", "\x00\x1a\x7f"]
)
@pytest.mark.parametrize("index", [0, 3])
def test_the_template_renders_what_the_models_render(text: str, index: int) -> None:
    expected = chunk([ChunkChoice(index=index, delta=Delta(content=text))])
    assert _content_chunk(chunk, index)(text) == expected
