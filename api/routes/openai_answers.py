"""The pieces of OpenAI's answers built from a run: choices, their logprobs (chat's and legacy
completions'), finish reasons and usage. Choice `i` of prompt `p` is item `p * n + i`; with
`best_of` > `n` the chosen items are each prompt's `n` most likely (`chosen_items`).
"""

from __future__ import annotations

from tgq.api.app import AppState
from tgq.api.routes.tgi_answers import output_text
from tgq.api.run import Run
from tgq.api.schemas.openai import (
    ChatCompletionChoice,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprob,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from tgq.api.tool_calls import reply_of, with_tool_calls
from tgq.batcher.messages import FinalResult, TokenEvent
from tgq.batcher.request import FinishReason


def finish_reason(final: FinalResult) -> str:
    """OpenAI's names: `length`, else `stop`."""
    return "length" if final.finish_reason == FinishReason.LENGTH else "stop"


def chat_finish_reason(final: FinalResult, *, has_calls: bool) -> str:
    """With tool calls, `tool_calls` where the output ended by itself."""
    return with_tool_calls(finish_reason(final), has_calls=has_calls)


def chat_choice(state: AppState, run: Run, index: int) -> ChatCompletionChoice:
    """Choice `index` of a finished chat run: its text, or its tool calls and the rest."""
    request_id = run.requests[index].request_id
    final, params = run.finals[request_id], run.prompts[0].params
    content, tool_calls = reply_of(params, output_text(state, final, include_stop=False))
    logprobs = None
    if params.sampling.logprobs:
        events = run.events.get(request_id, [])
        entries = [entry for event in events for entry in chat_token_logprobs(state, event)]
        logprobs = ChatLogprobs(content=entries)
    return ChatCompletionChoice(
        index=index,
        message=ChatMessage(content=content, tool_calls=tool_calls),
        logprobs=logprobs,
        finish_reason=chat_finish_reason(final, has_calls=tool_calls is not None),
    )


def run_usage(run: Run) -> Usage:
    finals = run.finals.values()
    prompt_tokens = sum(p.num_prompt_tokens for p in run.prompts)
    scored_only = bool(run.prompts) and run.prompts[0].params.score_only  # `max_tokens: 0`
    completion_tokens = 0 if scored_only else sum(final.num_output_tokens for final in finals)
    cached_tokens = sum(_num_cached_tokens(run, p) for p in range(len(run.prompts)))
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _items_of(run: Run, prompt_index: int) -> range:
    return range(prompt_index * run.copies, (prompt_index + 1) * run.copies)


def _num_cached_tokens(run: Run, prompt_index: int) -> int:
    finals = [run.finals.get(run.requests[i].request_id) for i in _items_of(run, prompt_index)]
    return min((f.num_cached_tokens for f in finals if f is not None), default=0)


def chat_token_logprobs(state: AppState, event: TokenEvent) -> list[ChatTokenLogprob]:
    entries = []
    for position, token_id in enumerate(event.token_ids):
        text = state.tokenizer.token_text(token_id)
        logprob = event.logprobs[position] if position < len(event.logprobs) else None
        tops = event.top_logprobs[position] if position < len(event.top_logprobs) else []
        entries.append(
            ChatTokenLogprob(
                token=text,
                logprob=logprob if logprob is not None else 0.0,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(t := state.tokenizer.token_text(i)),
                        logprob=lp,
                        bytes=list(t.encode()),
                    )
                    for i, lp in tops
                ],
            )
        )
    return entries


def chosen_items(run: Run, num_choices: int) -> list[int]:
    """Per prompt, its `n` items: all of them, or the most likely `n` of its `best_of`."""
    chosen = []
    for prompt_index in range(len(run.prompts)):
        items = list(_items_of(run, prompt_index))
        if len(items) > num_choices:
            items = sorted(items, key=lambda i: -_cumulative_logprob(run, i))[:num_choices]
        chosen += items
    return chosen


def _cumulative_logprob(run: Run, item: int) -> float:
    final = run.finals[run.requests[item].request_id]
    return sum(lp for lp in final.logprobs if lp is not None)


def completion_choice(
    state: AppState,
    run: Run,
    index: int,
    item: int,
    *,
    with_logprobs: bool,
    prompt_logprobs: int | None = None,
) -> CompletionChoice:
    """`prompt_logprobs`: vLLM's field, as asked (None: not asked)."""
    prompt = run.prompt_of(item)
    final = run.finals[run.requests[item].request_id]
    scored_only = prompt.params.score_only  # `max_tokens: 0`: the generated token left out
    text = "" if scored_only else output_text(state, final, include_stop=False)
    prefix = prompt.prompt if prompt.params.return_full_text else ""
    logprobs = None
    if with_logprobs:
        events = [] if scored_only else run.events.get(final.request_id, [])
        logprobs = legacy_logprobs(state, events, offset=len(prefix))
        if prompt.params.decoder_input_details:  # `echo`: the prompt's tokens first, scored
            logprobs = echoed_logprobs(state, prompt.prompt_token_ids, final, logprobs)
    return CompletionChoice(
        index=index,
        text=prefix + text,
        logprobs=logprobs,
        prompt_logprobs=None
        if prompt_logprobs is None
        else vllm_prompt_logprobs(state, prompt.prompt_token_ids, final, prompt_logprobs),
        finish_reason="length" if scored_only else finish_reason(final),
    )


def vllm_prompt_logprobs(
    state: AppState, prompt_ids: list[int], final: FinalResult, top: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: null for the first token; then per position, keyed by token id,
    the prompt's own token (its logprob and rank) and the `top` most likely tokens there."""
    entries: list[dict[str, PromptLogprob] | None] = [None]
    for index in range(1, len(prompt_ids)):
        token_id = prompt_ids[index]
        entry: dict[str, PromptLogprob] = {}
        tops = final.prompt_top_logprobs[index] if index < len(final.prompt_top_logprobs) else []
        for place, (candidate, value) in enumerate(tops[:top], start=1):
            text = state.tokenizer.token_text(candidate)
            entry[str(candidate)] = PromptLogprob(logprob=value, rank=place, decoded_token=text)
        logprob = final.prompt_logprobs[index] if index < len(final.prompt_logprobs) else None
        rank = final.prompt_ranks[index] if index < len(final.prompt_ranks) else None
        if logprob is not None and str(token_id) not in entry:
            text = state.tokenizer.token_text(token_id)
            entry[str(token_id)] = PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
        entries.append(entry)
    return entries


def echoed_logprobs(
    state: AppState, prompt_ids: list[int], final: FinalResult, output: CompletionLogprobs
) -> CompletionLogprobs:
    """OpenAI's `echo` with `logprobs`: the prompt's tokens (the first with null logprob and
    top_logprobs, as OpenAI answers), then the output's, offsets counted from the prompt's
    first character."""
    result = CompletionLogprobs(top_logprobs=[])
    assert result.top_logprobs is not None and output.top_logprobs is not None
    offset = 0
    for index, token_id in enumerate(prompt_ids):
        text = state.tokenizer.token_text(token_id)
        logprob = final.prompt_logprobs[index] if index < len(final.prompt_logprobs) else None
        tops = final.prompt_top_logprobs[index] if index < len(final.prompt_top_logprobs) else []
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(
            None if index == 0 else {state.tokenizer.token_text(i): lp for i, lp in tops}
        )
        result.text_offset.append(offset)
        offset += len(text)
    result.tokens += output.tokens
    result.token_logprobs += output.token_logprobs
    result.top_logprobs += output.top_logprobs
    result.text_offset += output.text_offset
    return result


def legacy_logprobs(
    state: AppState, events: list[TokenEvent], *, offset: int
) -> CompletionLogprobs:
    result = CompletionLogprobs(top_logprobs=[])
    for event in events:
        for position, token_id in enumerate(event.token_ids):
            text = state.tokenizer.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(
                event.logprobs[position] if position < len(event.logprobs) else None
            )
            tops = event.top_logprobs[position] if position < len(event.top_logprobs) else []
            assert result.top_logprobs is not None
            result.top_logprobs.append({state.tokenizer.token_text(i): lp for i, lp in tops})
            result.text_offset.append(offset)
            offset += len(text)
    return result
