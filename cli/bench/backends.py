"""The endpoints `tgq bench` speaks to: each backend's route, request body, and the parsing of
its server-sent events (OpenAI's chat and completions chunks, TGI's token events)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tgq.cli.bench.datasets import Prompt
from tgq.cli.bench.records import StreamEvent


@dataclass(frozen=True)
class Backend:
    path: str
    body: Callable[[Prompt, str | None, bool], dict[str, Any]]  # (prompt, model, ignore_eos)
    parse: Callable[[str], StreamEvent]  # one SSE event's data


def openai_body(
    prompt: Prompt, model: str | None, ignore_eos: bool, *, is_chat: bool
) -> dict[str, Any]:
    """Greedy, streamed, with the usage chunk at the end (the server's token counts)."""
    body: dict[str, Any] = {
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if is_chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body | ({"model": model} if model else {}) | ({"ignore_eos": True} if ignore_eos else {})


def tgi_body(prompt: Prompt, model: str | None, ignore_eos: bool) -> dict[str, Any]:
    """Greedy; `details` puts `generated_tokens` in the last event. TGI has no model field, and
    `ignore_eos` is tgq's extension, sent only when asked for."""
    parameters: dict[str, Any] = {
        "max_new_tokens": prompt.output_len,
        "do_sample": False,
        "details": True,
    }
    return {
        "inputs": prompt.text,
        "parameters": parameters | ({"ignore_eos": True} if ignore_eos else {}),
    }


def _json_object(data: str) -> dict[str, Any]:
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError(f"expected a JSON object, got {data[:80]!r}")
    return body


def _error_text(error: object) -> str:
    """OpenAI sends `{"error": {"message": ...}}`, TGI `{"error": "...", "error_type": ...}`."""
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def parse_openai(data: str) -> StreamEvent:
    """A chat (`delta.content`) or completions (`text`) chunk, the usage chunk, or `[DONE]`.
    Only chunks with text are content chunks: the role chunk and the finish chunk are not."""
    if data.strip() == "[DONE]":
        return StreamEvent(is_final=True)
    body = _json_object(data)
    if "error" in body:
        return StreamEvent(error=_error_text(body["error"]))
    choice = (body.get("choices") or [{}])[0]
    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    usage = body.get("usage") or {}
    return StreamEvent(
        is_token=bool(text),
        num_output_tokens=usage.get("completion_tokens"),
        num_prompt_tokens=usage.get("prompt_tokens"),
    )


def parse_tgi(data: str) -> StreamEvent:
    """One token per event (as vLLM's TGI client, every token event counts, special or not);
    the last one has `generated_text` and, with `details`, the server's counts."""
    body = _json_object(data)
    if "error" in body:
        return StreamEvent(error=_error_text(body["error"]))
    details = body.get("details") or {}
    return StreamEvent(
        is_token="token" in body,
        num_output_tokens=details.get("generated_tokens"),
        num_prompt_tokens=details.get("input_length"),
        is_final=body.get("generated_text") is not None,
    )


BACKENDS = {
    "openai-chat": Backend(
        "/v1/chat/completions", functools.partial(openai_body, is_chat=True), parse_openai
    ),
    "openai-completions": Backend(
        "/v1/completions", functools.partial(openai_body, is_chat=False), parse_openai
    ),
    "tgi": Backend("/generate_stream", tgi_body, parse_tgi),
}


async def sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (its `data:` lines joined); comments and other
    fields are skipped. An event is complete at the blank line that ends it."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)
