"""OpenAI's routes: `/v1/chat/completions`, `/v1/completions` (stream and not) and `/v1/models`.

Streams end with `data: [DONE]`; each choice gets a last chunk with an empty delta and its
`finish_reason`, then (with `stream_options.include_usage`) one chunk with `choices: []` and the
usage. Choice `i` of prompt `p` is item `p * n + i` of the request's job; with completions'
`best_of` > `n`, prompt `p` has `best_of` items and its choices are the `n` with the highest
cumulative logprob, best first (`usage` counts the tokens of every candidate, as OpenAI bills).

`usage.prompt_tokens_details.cached_tokens`: per prompt, the prompt tokens the batcher found in
its prefix cache when it first scheduled the prompt's prefill (the least over the prompt's
copies), a multiple of the KV block size.

Chat with tools (`api.tools`): each choice's text goes through a tool-call reader
(`api.tool_calls`), which turns it into content and `tool_calls` deltas; the answer without
streaming is the same deltas folded. A choice with calls that ended by itself finishes with
`tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response

from tgq.api.admission import Ticket
from tgq.api.app import VERSION, AppState, state_of
from tgq.api.chat_prompt import render_chat
from tgq.api.errors import ApiError, GenerationError, error_body
from tgq.api.openai_validation import chat_params, completion_params, completion_prompts
from tgq.api.routes.openai_answers import (
    chat_choice,
    chat_finish_reason,
    chat_token_logprobs,
    chosen_items,
    completion_choice,
    finish_reason,
    legacy_logprobs,
    run_usage,
    vllm_prompt_logprobs,
)
from tgq.api.run import Run, check_failed
from tgq.api.schemas.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    Model,
    ModelList,
    Usage,
)
from tgq.api.sse import STREAM_RESPONSES, data_event, dump_json, sse_response
from tgq.api.tool_calls import ToolCallReader, tool_reader
from tgq.api.tools import prompt_tools
from tgq.api.validated import GenerationParams
from tgq.batcher.messages import FinalResult

router = APIRouter(tags=["OpenAI"])
FINGERPRINT = f"{VERSION}-native"
DONE = data_event("[DONE]")


async def _start(
    request: Request,
    ticket: Ticket,
    prompts: Sequence[str | list[int]],
    params: GenerationParams,
    *,
    route: str,
    param: str,
) -> Run:
    generation = state_of(request).generation
    validated = await generation.validate(prompts, params, param=param)
    return await generation.start(
        validated,
        ticket,
        route=route,
        key=request.state.key,
        keep_events=params.sampling.wants_logprobs,
    )


# --- chat --------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI chat completions; `stream: true` for Server-Sent Events."""
    state = state_of(request)
    with state.generation.admitted() as ticket:
        params = chat_params(body, state.settings, state.tokenizer.chat_template)
        prompt = await render_chat(
            state.tokenizer, body.messages, tools=prompt_tools(body), tool_prompt=body.tool_prompt
        )
        run = await _start(
            request, ticket, [prompt], params, route="/v1/chat/completions", param="messages"
        )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return sse_response(_chat_chunks(state, run, include_usage=include_usage), {})
    finals = await state.generation.wait_finals(run, request.receive)
    check_failed(finals)
    choices = [chat_choice(state, run, index) for index in range(len(run.requests))]
    prompt_logprobs = None
    if body.prompt_logprobs is not None:  # the prompt's, the same for every choice
        final = run.finals[run.requests[0].request_id]
        token_ids = run.prompt_of(0).prompt_token_ids
        prompt_logprobs = vllm_prompt_logprobs(state, token_ids, final, body.prompt_logprobs)
    return ChatCompletion(
        id=f"chatcmpl-{run.job_id}",
        created=int(run.started_at),
        model=_model_of(state, run),
        system_fingerprint=FINGERPRINT,
        choices=choices,
        usage=run_usage(run),
        prompt_logprobs=prompt_logprobs,
    )


def _model_of(state: AppState, run: Run) -> str:
    """The answer's `model`: the LoRA adapter the request ran with, else the base model."""
    return run.prompts[0].params.adapter or state.settings.model_id


async def _chat_chunks(state: AppState, run: Run, *, include_usage: bool) -> AsyncIterator[bytes]:
    params = run.prompts[0].params
    index_of = {r.request_id: i for i, r in enumerate(run.requests)}

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionChunk(
            id=f"chatcmpl-{run.job_id}",
            created=int(run.started_at),
            model=_model_of(state, run),
            system_fingerprint=FINGERPRINT,
            choices=choices,
            usage=usage,
        )
        return data_event(body.model_dump_json())

    content_chunks = [_content_chunk(chunk, i) for i in range(len(run.requests))]
    readers = [tool_reader(params) for _ in run.requests]
    try:
        yield chunk(
            [
                ChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                for i in index_of.values()
            ]
        )
        async for index, event in state.generation.stream(run):
            reader = readers[index]
            if isinstance(event, FinalResult):
                if event.finish_reason not in ("stop", "length"):
                    raise GenerationError(event.finish_detail or event.finish_reason)
                deltas = [] if reader is None else reader.finish()
                for delta in deltas:
                    yield chunk([ChunkChoice(index=index, delta=delta)])
                has_calls = reader is not None and reader.has_calls
                reason = chat_finish_reason(event, has_calls=has_calls)
                yield chunk([ChunkChoice(index=index, delta=Delta(), finish_reason=reason)])
                continue
            if not event.text and not params.sampling.logprobs:
                continue
            logprobs = None
            if params.sampling.logprobs:
                logprobs = ChatLogprobs(content=chat_token_logprobs(state, event))
            if reader is not None:
                for choice in _read_tool_calls(reader, index, event.text, logprobs):
                    yield chunk([choice])
            elif logprobs is not None:
                delta = Delta(content=event.text)
                yield chunk([ChunkChoice(index=index, delta=delta, logprobs=logprobs)])
            else:
                yield content_chunks[index](event.text)
        if include_usage:
            yield chunk([], run_usage(run))
    except ApiError as error:
        yield data_event(dump_json(error_body(error, flavour="openai")))
    yield DONE


def _read_tool_calls(
    reader: ToolCallReader, index: int, text: str, logprobs: ChatLogprobs | None
) -> list[ChunkChoice]:
    """The chunks a token's text makes through a tool-call reader; its logprobs go on the
    first (an empty delta when the reader holds the text back)."""
    deltas = reader.feed(text) or ([Delta()] if logprobs is not None else [])
    return [
        ChunkChoice(index=index, delta=delta, logprobs=logprobs if i == 0 else None)
        for i, delta in enumerate(deltas)
    ]


def _content_chunk(
    chunk: Callable[[list[ChunkChoice]], bytes], index: int
) -> Callable[[str], bytes]:
    """The chunk of choice `index` carrying a text delta, as `chunk` renders it but without
    building models per token (the hot path): the rendering of a marker, split around it."""
    marker = '"\\u0000marker"'  # how JSON writes the content below
    rendered = chunk([ChunkChoice(index=index, delta=Delta(content="\x00marker"))]).decode()
    head, tail = rendered.split(marker)

    def render(text: str) -> bytes:
        return f"{head}{json.dumps(text, ensure_ascii=False)}{tail}".encode()

    return render


# --- completions -------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=Completion, responses=STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    """OpenAI (legacy) completions: one prompt or a list of them."""
    state = state_of(request)
    with state.generation.admitted() as ticket:
        params = completion_params(body, state.settings)
        prompts = completion_prompts(body, state.settings)
        run = await _start(
            request, ticket, prompts, params, route="/v1/completions", param="prompt"
        )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return sse_response(_completion_chunks(state, run, include_usage=include_usage), {})
    finals = await state.generation.wait_finals(run, request.receive)
    check_failed(finals)
    with_logprobs = body.logprobs is not None
    choices = [
        completion_choice(
            state,
            run,
            index,
            item,
            with_logprobs=with_logprobs,
            prompt_logprobs=body.prompt_logprobs,
        )
        for index, item in enumerate(chosen_items(run, params.num_choices))
    ]
    return _completion(state, run, choices, run_usage(run))


def _completion(
    state: AppState, run: Run, choices: list[CompletionChoice], usage: Usage | None
) -> Completion:
    return Completion(
        id=f"cmpl-{run.job_id}",
        created=int(run.started_at),
        model=_model_of(state, run),
        system_fingerprint=FINGERPRINT,
        choices=choices,
        usage=usage,
    )


async def _completion_chunks(
    state: AppState, run: Run, *, include_usage: bool
) -> AsyncIterator[bytes]:
    wants_logprobs = run.prompts[0].sampling.wants_logprobs

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return data_event(_completion(state, run, choices, usage).model_dump_json())

    try:
        async for index, event in state.generation.stream(run):
            if isinstance(event, FinalResult):
                if event.finish_reason not in ("stop", "length"):
                    raise GenerationError(event.finish_detail or event.finish_reason)
                reason = finish_reason(event)
                yield chunk([CompletionChoice(index=index, text="", finish_reason=reason)])
                continue
            if not event.text and not wants_logprobs:
                continue
            logprobs = legacy_logprobs(state, [event], offset=0) if wants_logprobs else None
            yield chunk([CompletionChoice(index=index, text=event.text, logprobs=logprobs)])
        if include_usage:
            yield chunk([], run_usage(run))
    except ApiError as error:
        yield data_event(dump_json(error_body(error, flavour="openai")))
    yield DONE


# --- models ------------------------------------------------------------------------------------


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """The base model, then each LoRA adapter served on it (`--lora-adapters`; a request's
    `model` picks one)."""
    settings = state_of(request).settings
    adapters = [
        Model(id=name, owned_by="tgq", parent=settings.model_id) for name in settings.adapter_dirs
    ]
    return ModelList(data=[Model(id=settings.model_id, owned_by="tgq"), *adapters])


__all__ = ["Response", "router"]
