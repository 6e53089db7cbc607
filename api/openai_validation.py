"""OpenAI request bodies (chat and completions) into one `GenerationParams`, with OpenAI's
ranges and messages; the checks shared with the TGI routes, the deviations from TGI and the
check after tokenization are in `api.validation`."""

from __future__ import annotations

import dataclasses

from tgq.api.chat_template import ChatTemplate
from tgq.api.errors import RouteValidationError, require
from tgq.api.request_fields import check_openai_fields
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest, ImagePart
from tgq.api.settings import Settings
from tgq.api.structured import openai_grammar
from tgq.api.tools import tool_use
from tgq.api.validated import GenerationParams
from tgq.api.validation import (
    check_inputs,
    check_min_p,
    check_min_tokens,
    check_penalty,
    check_prefill_logprobs,
    check_probability_mass,
    check_repetition_penalty,
    check_stop_count,
    check_top_n,
    default,
    non_empty,
)
from tgq.batcher.grammar import GrammarSpec
from tgq.gpu_worker.plan import SamplingParams

MAX_TEMPERATURE = 2.0  # OpenAI's bound
SUFFIX_MESSAGE = "Suffix is not supported and can be achieved by preprocessing the prompt."
EMPTY_PROMPTS_MESSAGE = "Empty array detected. Do not use an empty array for the prompt."


def chat_params(
    request: ChatCompletionRequest, settings: Settings, template: ChatTemplate | None = None
) -> GenerationParams:
    """`template`: the model's chat template, for `--tool-call-parser auto`."""
    check_openai_fields(request)
    _check_chat_unsupported(request)
    require(bool(request.messages), "`messages` cannot be empty", "messages")
    top_n = default(request.top_logprobs, 0)
    check_top_n("top_logprobs", top_n, settings)
    require(
        top_n == 0 or request.logprobs is True,
        "`logprobs` must be true when `top_logprobs` is set",
        "logprobs",
    )
    if request.max_completion_tokens is not None:
        max_new_tokens = _max_tokens("max_completion_tokens", request.max_completion_tokens)
    else:
        max_new_tokens = _max_tokens("max_tokens", request.max_tokens)
    grammar = _grammar(request)
    tools = tool_use(request, parser_setting=settings.tool_call_parser, template=template)
    sampling = _openai_sampling(request, logprobs=request.logprobs is True, top_n=top_n)
    return GenerationParams(
        sampling=_vllm_prompt_logprobs(request, sampling, settings),
        max_new_tokens=max_new_tokens,
        stop_strings=_openai_stop(request.stop, settings),
        num_choices=_num_choices(request.n, settings),
        ignore_eos=request.ignore_eos,
        speculate=request.speculate,
        adapter=_adapter(request, settings),
        top_n_tokens=top_n,
        add_special_tokens=False,  # the chat template has them already
        grammar=tools.grammar or grammar,
        tool_parser=tools.parser,
        parallel_tool_calls=tools.parallel,
    )


def _adapter(request: ChatCompletionRequest | CompletionRequest, settings: Settings) -> str | None:
    """OpenAI's `model`: a served LoRA adapter's name picks it; any other value is the base
    model (as TGI, which ignores `model`)."""
    return request.model if request.model in settings.adapter_dirs else None


def completion_params(request: CompletionRequest, settings: Settings) -> GenerationParams:
    check_openai_fields(request)
    if request.suffix is not None:
        raise RouteValidationError(
            SUFFIX_MESSAGE, error_type="suffix not supported", param="suffix"
        )
    top_n = default(request.logprobs, 0)
    check_top_n("logprobs", top_n, settings)
    num_choices = _num_choices(request.n, settings)
    best_of = _completion_best_of(request, num_choices, settings)
    # The candidates are ranked by their cumulative logprob: they need it, asked for or not.
    logprobs = request.logprobs is not None or best_of > num_choices
    sampling = _openai_sampling(request, logprobs=logprobs, top_n=top_n)
    if request.echo and request.logprobs is not None:  # the prompt's tokens come back scored
        check_prefill_logprobs("echo", settings)
        sampling = dataclasses.replace(sampling, prompt_logprobs=top_n)
    sampling = _vllm_prompt_logprobs(request, sampling, settings)
    score_only = request.max_tokens == 0
    require(request.max_tokens is None or request.max_tokens >= 0, MAX_TOKENS_MESSAGE, "max_tokens")
    if score_only:
        require(not request.stream, SCORE_ONLY_STREAM_MESSAGE, "max_tokens")
    return GenerationParams(
        sampling=sampling,
        max_new_tokens=1 if score_only else request.max_tokens,
        score_only=score_only,
        stop_strings=_openai_stop(request.stop, settings),
        best_of=best_of,
        num_choices=num_choices,
        ignore_eos=request.ignore_eos,
        speculate=request.speculate,
        adapter=_adapter(request, settings),
        return_full_text=request.echo,
        decoder_input_details=request.echo and request.logprobs is not None,
        top_n_tokens=top_n,
        grammar=_grammar(request),
    )


MAX_TOKENS_MESSAGE = "`max_tokens` must be >= 0 (0: score the prompt only)"
PROMPT_LOGPROBS_STREAM_MESSAGE = "`prompt_logprobs` is not supported when streaming"


def _vllm_prompt_logprobs(
    request: ChatCompletionRequest | CompletionRequest, sampling: SamplingParams, settings: Settings
) -> SamplingParams:
    """vLLM's `prompt_logprobs: k` (both routes): the prompt's tokens scored, with the k most
    likely at each position; needs --enable-prefill-logprobs; not with `stream` (the scores
    arrive with the final result)."""
    if request.prompt_logprobs is None:
        return sampling
    check_prefill_logprobs("prompt_logprobs", settings)
    check_top_n("prompt_logprobs", request.prompt_logprobs, settings)
    require(not request.stream, PROMPT_LOGPROBS_STREAM_MESSAGE, "prompt_logprobs")
    top = max(request.prompt_logprobs, sampling.prompt_logprobs or 0)
    return dataclasses.replace(sampling, prompt_logprobs=top)


SCORE_ONLY_STREAM_MESSAGE = "`max_tokens` 0 (score the prompt only) is not supported when streaming"
EMPTY_TOKENS_MESSAGE = "A prompt given as token ids needs at least one token."


def completion_prompts(request: CompletionRequest, settings: Settings) -> list[str | list[int]]:
    """The prompts of a `/v1/completions` body, each non-empty: a string or a list of them, or
    token ids (a list, or a list of lists; the ids are checked against the vocabulary when
    validated, `Generation.validate`)."""
    given = request.prompt
    prompts: list[str | list[int]]
    if isinstance(given, str):
        prompts = [given]
    elif given and all(isinstance(item, int) for item in given):
        prompts = [[int(item) for item in given if isinstance(item, int)]]
    else:
        prompts = [item for item in given if isinstance(item, str | list)]
    require(bool(prompts), EMPTY_PROMPTS_MESSAGE, "prompt")
    limit = settings.max_client_batch_size
    if len(prompts) > limit:
        message = f"Number of prompts exceeds the maximum allowed batch size of {limit}"
        raise RouteValidationError(message, error_type="batch size exceeded", param="prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            check_inputs(prompt, "prompt")
        else:
            require(bool(prompt), EMPTY_TOKENS_MESSAGE, "prompt")
    return prompts


def _completion_best_of(request: CompletionRequest, num_choices: int, settings: Settings) -> int:
    """OpenAI's `best_of`: candidates per prompt, of which the `n` most likely are returned."""
    best_of, limit = default(request.best_of, num_choices), settings.max_best_of
    require(
        0 < best_of <= limit, f"`best_of` must be > 0 and <= {limit}. Given: {best_of}", "best_of"
    )
    require(
        best_of >= num_choices,
        f"`best_of` must be >= `n` ({num_choices}). Given: {best_of}",
        "best_of",
    )
    require(
        not request.stream or best_of == num_choices,
        "`best_of` > `n` is not supported when streaming",
        "best_of",
    )
    return best_of


def _check_chat_unsupported(request: ChatCompletionRequest) -> None:
    for i, message in enumerate(request.messages):
        parts = message.content if isinstance(message.content, list) else []
        has_image = any(isinstance(part, ImagePart) for part in parts)
        require(not has_image, "image content is not supported", f"messages[{i}].content")


def _openai_sampling(
    request: ChatCompletionRequest | CompletionRequest, *, logprobs: bool, top_n: int
) -> SamplingParams:
    temperature, top_p = default(request.temperature, 1.0), default(request.top_p, 1.0)
    require(
        0 <= temperature <= MAX_TEMPERATURE,
        f"`temperature` must be >= 0.0 and <= {MAX_TEMPERATURE}",
        "temperature",
    )
    check_probability_mass("top_p", top_p)
    check_penalty("frequency_penalty", request.frequency_penalty)
    check_penalty("presence_penalty", request.presence_penalty)
    check_repetition_penalty(request.repetition_penalty)
    top_k = default(request.top_k, 0)
    require(top_k >= -1, f"`top_k` must be >= -1 (-1 or 0: off). Given: {top_k}", "top_k")
    check_min_p(request.min_p)
    check_min_tokens(request.min_tokens)
    return SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=default(request.min_p, 0.0),
        min_tokens=default(request.min_tokens, 0),
        repetition_penalty=default(request.repetition_penalty, 1.0),
        frequency_penalty=default(request.frequency_penalty, 0.0),
        presence_penalty=default(request.presence_penalty, 0.0),
        seed=request.seed,
        logprobs=logprobs,
        top_n_logprobs=top_n,
    )


def _grammar(request: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
    response_format = request.response_format
    return openai_grammar(
        None if response_format is None else response_format.model_dump(),
        request.structured_fields(),
    )


def _max_tokens(name: str, value: int | None) -> int | None:
    require(value is None or value > 0, f"`{name}` must be strictly positive", name)
    return value


def _num_choices(n: int | None, settings: Settings) -> int:
    num_choices, limit = default(n, 1), settings.max_choices
    require(1 <= num_choices <= limit, f"`n` must be >= 1 and <= {limit}. Given: {n}", "n")
    return num_choices


def _openai_stop(stop: str | list[str] | None, settings: Settings) -> tuple[str, ...]:
    stop_strings = [stop] if isinstance(stop, str) else default(stop, [])
    check_stop_count(len(stop_strings), settings)
    return non_empty(stop_strings)
