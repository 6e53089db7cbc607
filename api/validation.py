"""Request validation at the edge: TGI and OpenAI bodies into one `GenerationParams`, then,
after tokenization, into a `ValidatedRequest`. Pure functions, no I/O; every rejection raises
`api.errors.ValidationError` (or `RouteValidationError`) with an exact, tested message.

Order on TGI routes: `tgi_params` makes TGI's checks in TGI's order (streaming rules, `best_of`,
sampling knobs, `max_new_tokens`, `stop`, `seed`, `top_n_tokens`, `truncate`), then
`check_inputs` (TGI checks empty `inputs` just before `truncate`), then, once tokenized,
`validate_tokens` (`max_total_tokens` before `max_input_tokens`, as TGI does).

Deviations from TGI
-------------------
- `top_p: 1.0` and `typical_p: 1.0` are accepted and mean "off" (TGI answers 422 even to the
  OpenAI clients that send `top_p: 1` by default); the message says so: "`top_p` must be > 0.0
  and <= 1.0".
- OpenAI `n` is honoured (`1..max_choices` independent samples); TGI ignores it.
- OpenAI `presence_penalty` is OpenAI's presence penalty over the output, not mapped to
  `repetition_penalty = presence_penalty + 2` (so `-2` is valid, as in OpenAI).
- OpenAI `temperature` and `top_p` take OpenAI's ranges (`[0, 2]`, `(0, 1]`; `0` is greedy).
- Stop strings are left out of OpenAI outputs; TGI routes keep them in `generated_text`.
- Empty stop strings are dropped (TGI would stop after the first token).
- `max_new_tokens` is checked in full against `max_total_tokens`: TGI checks only the first
  1024-token chunk and re-queues the rest, then ends silently with `length` when the re-queue
  fails; tgq admits or rejects the whole request up front.
- `best_of: 0` is rejected ("`best_of` must be > 0 and <= {max}. Given: 0"); TGI runs it as 1.
- Every field either works or is rejected with a message naming it (`api.request_fields`): an
  unknown field is a 422, "unknown field `parameters.X`" on TGI routes (TGI ignores it) and
  OpenAI's "Unrecognized request argument supplied: X" on OpenAI routes (OpenAI answers 400;
  tgq keeps 422, the status of every validation error on these routes).
- `watermark: true` is rejected ("`watermark` is not supported"); `grammar` is rejected with
  TGI's own message for a server without grammar support ("grammar is not supported");
  `adapter_id` other than null or the base model's id is rejected (tgq serves no LoRA adapters;
  TGI falls back to the base model for unknown ids).
- OpenAI `logit_bias` (non-empty), `tools`, `tool_choice` other than "none"/"auto",
  `response_format` other than `{"type": "text"}` and image content parts are rejected with a
  message naming the field; TGI fails to parse OpenAI's shapes or ignores them. So are chat
  `audio`, `functions`, `function_call` (other than "none"/"auto"), `metadata`, `store: true`,
  `modalities` other than ["text"], `moderation`, `prediction`, `prompt_cache_options`,
  `prompt_cache_retention: "24h"`, `reasoning_effort`, `verbosity`, `service_tier` other than
  "auto"/"default", `web_search_options` and TGI's `tool_prompt`. `user`, `safety_identifier`,
  `prompt_cache_key` and `parallel_tool_calls` are accepted: they change nothing in the output
  (no end users are recorded; the prefix cache serves every request; there are no tools).
- vLLM's sampling extensions work on every route that samples: `min_tokens` (EOS, stop tokens and
  stop strings cannot end a sequence before it; "`min_tokens` must be >= 0" and "<= the maximum
  number of new tokens"), `min_p` ("`min_p` must be >= 0.0 and <= 1.0"); on the OpenAI routes
  also `top_k` (-1 or 0: off) and `repetition_penalty`. On TGI routes `min_p > 0` counts as a
  sampling knob, as `top_k` does.
- Completions `best_of` works as OpenAI documents: `best_of` candidates per prompt, the `n` with
  the highest cumulative logprob returned best first, `usage` counting every candidate's tokens;
  `best_of` must be >= `n` and <= `max_best_of`, and equal to `n` when streaming.
- Chat `logprobs`/`top_logprobs`, completions `logprobs` (legacy int), `echo`, `n` and
  `presence_penalty` are honoured; TGI's completions route has none of them.
- `max_completion_tokens` wins over `max_tokens` when both are set (OpenAI deprecated
  `max_tokens`); TGI treats them as aliases.
- `ignore_eos` (a vLLM extension) is accepted on every route: generation goes on past EOS.
- A request without `seed` gets none here: the engine draws one, so `details.seed` is null (TGI
  reports the seed it drew).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from tgq.api.errors import RouteValidationError, ValidationError
from tgq.api.request_fields import check_adapter_id, check_openai_fields, check_parameter_fields
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest, ImagePart
from tgq.api.schemas.tgi import GenerateParameters, default_parameters
from tgq.api.settings import Settings
from tgq.api.submit import resolve_max_new_tokens, stopping_params
from tgq.api.validated import GenerationParams, ValidatedRequest
from tgq.batcher.request import Priority
from tgq.gpu_worker.plan import SamplingParams

T = TypeVar("T")
MAX_PENALTY = 2.0  # frequency and presence penalties live in [-2, 2]
MAX_TEMPERATURE = 2.0  # OpenAI's bound
SUFFIX_MESSAGE = "Suffix is not supported and can be achieved by preprocessing the prompt."
EMPTY_PROMPTS_MESSAGE = "Empty array detected. Do not use an empty array for the prompt."


def check_inputs(prompt: str, param: str = "inputs") -> None:
    """TGI's message on every route; `param` names the field of the route's own body."""
    _require(prompt != "", "`inputs` cannot be empty", param)


# --- TGI ---------------------------------------------------------------------------------------


def tgi_params(
    parameters: GenerateParameters | None,
    settings: Settings,
    *,
    is_stream: bool,
    return_full_text_default: bool = False,  # the `/` route: True for text-generation models
) -> GenerationParams:
    """TGI's `parameters` (None: the body had none) into generation parameters."""
    check_parameter_fields(parameters)
    p = default_parameters() if parameters is None else parameters
    best_of = _default(p.best_of, 1)
    _check_tgi_streaming(p, best_of, is_stream=is_stream)
    _check_tgi_best_of(p, best_of, settings, is_stream=is_stream)
    _check_tgi_knobs(p)
    _check_tgi_limits(p, best_of, settings)
    needs_logprobs = is_stream or p.details or p.decoder_input_details or best_of > 1
    return GenerationParams(
        sampling=_tgi_sampling(p, logprobs=needs_logprobs),
        max_new_tokens=p.max_new_tokens,
        stop_strings=_non_empty(p.stop),
        ignore_eos=p.ignore_eos,
        truncate=p.truncate,
        best_of=best_of,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        return_full_text=_default(p.return_full_text, return_full_text_default),
        include_stop_string=True,
        top_n_tokens=_default(p.top_n_tokens, 0),
    )


def _check_tgi_streaming(p: GenerateParameters, best_of: int, *, is_stream: bool) -> None:
    if not is_stream:
        return
    _require(best_of == 1, "`best_of` != 1 is not supported when streaming tokens", "best_of")
    _require(
        not p.decoder_input_details,
        "`decoder_input_details` == true is not supported when streaming tokens",
        "decoder_input_details",
    )


def _check_tgi_best_of(
    p: GenerateParameters, best_of: int, settings: Settings, *, is_stream: bool
) -> None:
    if is_stream or best_of == 1:
        return
    limit = settings.max_best_of
    _require(limit != 1, "`best_of` != 1 is not allowed for this endpoint", "best_of")
    _require(
        0 < best_of <= limit, f"`best_of` must be > 0 and <= {limit}. Given: {best_of}", "best_of"
    )
    # TGI's router counts any sampling knob that is set, whatever its value.
    knobs = (p.temperature, p.top_k, p.top_p, p.typical_p)
    is_sampling = p.do_sample or any(knob is not None for knob in knobs)
    _require(is_sampling, "you must use sampling when `best_of` is > 1", "best_of")


def _check_tgi_knobs(p: GenerateParameters) -> None:
    temperature, repetition_penalty = p.temperature, p.repetition_penalty
    _require(
        temperature is None or temperature > 0,
        "`temperature` must be strictly positive",
        "temperature",
    )
    _check_repetition_penalty(repetition_penalty)
    _check_penalty("frequency_penalty", p.frequency_penalty)
    _check_probability_mass("top_p", p.top_p)
    _check_probability_mass("typical_p", p.typical_p)
    _require(p.top_k is None or p.top_k > 0, "`top_k` must be strictly positive", "top_k")
    _require(p.max_new_tokens != 0, "`max_new_tokens` must be strictly positive", "max_new_tokens")
    _check_min_p(p.min_p)
    _check_min_tokens(p.min_tokens)


def _check_tgi_limits(p: GenerateParameters, best_of: int, settings: Settings) -> None:
    _check_stop_count(len(p.stop), settings)
    _require(p.seed is None or best_of <= 1, "`seed` must not be set when `best_of` > 1", "seed")
    top_n, limit = _default(p.top_n_tokens, 0), settings.max_top_n_tokens
    _require(
        top_n <= limit,
        f"`top_n_tokens` must be >= 0 and <= {limit}. Given: {top_n}",
        "top_n_tokens",
    )
    max_input = settings.max_input_tokens
    _require(
        p.truncate is None or 0 < p.truncate <= max_input,
        f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}",
        "truncate",
    )
    _require(p.grammar is None, "grammar is not supported", "grammar")
    _require(not p.watermark, "`watermark` is not supported", "watermark")
    check_adapter_id(p.adapter_id, settings.model_id)


def _tgi_sampling(p: GenerateParameters, *, logprobs: bool) -> SamplingParams:
    """Greedy unless TGI's server would sample (`tokens.py`: `do_sample` or any sampling knob
    away from its neutral value); penalties apply either way."""
    greedy = SamplingParams(
        temperature=0.0,
        repetition_penalty=_default(p.repetition_penalty, 1.0),
        frequency_penalty=_default(p.frequency_penalty, 0.0),
        seed=p.seed,
        logprobs=logprobs,
        top_n_logprobs=_default(p.top_n_tokens, 0),
        min_tokens=_default(p.min_tokens, 0),
    )
    sampling = dataclasses.replace(
        greedy,
        temperature=_default(p.temperature, 1.0),
        top_k=_default(p.top_k, 0),
        top_p=_default(p.top_p, 1.0),
        typical_p=_default(p.typical_p, 1.0),
        min_p=_default(p.min_p, 0.0),
    )
    is_sampling = p.do_sample or sampling.temperature != 1.0 or sampling.top_k != 0
    is_sampling = is_sampling or sampling.top_p < 1.0 or sampling.typical_p < 1.0
    is_sampling = is_sampling or sampling.min_p > 0.0
    return sampling if is_sampling else greedy


# --- OpenAI ------------------------------------------------------------------------------------


def chat_params(request: ChatCompletionRequest, settings: Settings) -> GenerationParams:
    check_openai_fields(request)
    _check_chat_unsupported(request)
    _require(bool(request.messages), "`messages` cannot be empty", "messages")
    top_n = _default(request.top_logprobs, 0)
    _check_top_n("top_logprobs", top_n, settings)
    _require(
        top_n == 0 or request.logprobs is True,
        "`logprobs` must be true when `top_logprobs` is set",
        "logprobs",
    )
    if request.max_completion_tokens is not None:
        max_new_tokens = _max_tokens("max_completion_tokens", request.max_completion_tokens)
    else:
        max_new_tokens = _max_tokens("max_tokens", request.max_tokens)
    return GenerationParams(
        sampling=_openai_sampling(request, logprobs=request.logprobs is True, top_n=top_n),
        max_new_tokens=max_new_tokens,
        stop_strings=_openai_stop(request.stop, settings),
        num_choices=_num_choices(request.n, settings),
        ignore_eos=request.ignore_eos,
        top_n_tokens=top_n,
        add_special_tokens=False,  # the chat template has them already
    )


def completion_params(request: CompletionRequest, settings: Settings) -> GenerationParams:
    check_openai_fields(request)
    if request.suffix is not None:
        raise RouteValidationError(
            SUFFIX_MESSAGE, error_type="suffix not supported", param="suffix"
        )
    top_n = _default(request.logprobs, 0)
    _check_top_n("logprobs", top_n, settings)
    num_choices = _num_choices(request.n, settings)
    best_of = _completion_best_of(request, num_choices, settings)
    # The candidates are ranked by their cumulative logprob: they need it, asked for or not.
    logprobs = request.logprobs is not None or best_of > num_choices
    return GenerationParams(
        sampling=_openai_sampling(request, logprobs=logprobs, top_n=top_n),
        max_new_tokens=_max_tokens("max_tokens", request.max_tokens),
        stop_strings=_openai_stop(request.stop, settings),
        best_of=best_of,
        num_choices=num_choices,
        ignore_eos=request.ignore_eos,
        return_full_text=request.echo,
        decoder_input_details=request.echo and request.logprobs is not None,
        top_n_tokens=top_n,
    )


def completion_prompts(request: CompletionRequest, settings: Settings) -> list[str]:
    """The prompts of a `/v1/completions` body (a string or a list of them), each non-empty."""
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    _require(bool(prompts), EMPTY_PROMPTS_MESSAGE, "prompt")
    limit = settings.max_client_batch_size
    if len(prompts) > limit:
        message = f"Number of prompts exceeds the maximum allowed batch size of {limit}"
        raise RouteValidationError(message, error_type="batch size exceeded", param="prompt")
    for prompt in prompts:
        check_inputs(prompt, "prompt")
    return prompts


def _completion_best_of(request: CompletionRequest, num_choices: int, settings: Settings) -> int:
    """OpenAI's `best_of`: candidates per prompt, of which the `n` most likely are returned."""
    best_of, limit = _default(request.best_of, num_choices), settings.max_best_of
    _require(
        0 < best_of <= limit, f"`best_of` must be > 0 and <= {limit}. Given: {best_of}", "best_of"
    )
    _require(
        best_of >= num_choices,
        f"`best_of` must be >= `n` ({num_choices}). Given: {best_of}",
        "best_of",
    )
    _require(
        not request.stream or best_of == num_choices,
        "`best_of` > `n` is not supported when streaming",
        "best_of",
    )
    return best_of


def _check_chat_unsupported(request: ChatCompletionRequest) -> None:
    _require(not request.tools, "`tools` are not supported yet", "tools")
    _require(
        request.tool_choice in (None, "none", "auto"),
        '`tool_choice` other than "none" or "auto" is not supported yet',
        "tool_choice",
    )
    kind = "text" if request.response_format is None else request.response_format.type
    _require(
        kind == "text",
        f"`response_format` of type `{kind}` is not supported yet",
        "response_format",
    )
    for i, message in enumerate(request.messages):
        parts = message.content if isinstance(message.content, list) else []
        has_image = any(isinstance(part, ImagePart) for part in parts)
        _require(not has_image, "image content is not supported", f"messages[{i}].content")


def _openai_sampling(
    request: ChatCompletionRequest | CompletionRequest, *, logprobs: bool, top_n: int
) -> SamplingParams:
    temperature, top_p = _default(request.temperature, 1.0), _default(request.top_p, 1.0)
    _require(
        0 <= temperature <= MAX_TEMPERATURE,
        f"`temperature` must be >= 0.0 and <= {MAX_TEMPERATURE}",
        "temperature",
    )
    _check_probability_mass("top_p", top_p)
    _check_penalty("frequency_penalty", request.frequency_penalty)
    _check_penalty("presence_penalty", request.presence_penalty)
    _check_repetition_penalty(request.repetition_penalty)
    top_k = _default(request.top_k, 0)
    _require(top_k >= -1, f"`top_k` must be >= -1 (-1 or 0: off). Given: {top_k}", "top_k")
    _check_min_p(request.min_p)
    _check_min_tokens(request.min_tokens)
    return SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=_default(request.min_p, 0.0),
        min_tokens=_default(request.min_tokens, 0),
        repetition_penalty=_default(request.repetition_penalty, 1.0),
        frequency_penalty=_default(request.frequency_penalty, 0.0),
        presence_penalty=_default(request.presence_penalty, 0.0),
        seed=request.seed,
        logprobs=logprobs,
        top_n_logprobs=top_n,
    )


def _max_tokens(name: str, value: int | None) -> int | None:
    _require(value is None or value > 0, f"`{name}` must be strictly positive", name)
    return value


def _num_choices(n: int | None, settings: Settings) -> int:
    num_choices, limit = _default(n, 1), settings.max_choices
    _require(1 <= num_choices <= limit, f"`n` must be >= 1 and <= {limit}. Given: {n}", "n")
    return num_choices


def _openai_stop(stop: str | list[str] | None, settings: Settings) -> tuple[str, ...]:
    stop_strings = [stop] if isinstance(stop, str) else _default(stop, [])
    _check_stop_count(len(stop_strings), settings)
    return _non_empty(stop_strings)


# --- After tokenization ------------------------------------------------------------------------


def validate_tokens(
    *,
    prompt: str,
    token_ids: list[int],
    params: GenerationParams,
    settings: Settings,
    priority: Priority = Priority.INTERACTIVE,
    deadline: float | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    param: str = "inputs",  # the prompt's field in the route's body (`prompt`, `messages`)
) -> ValidatedRequest:
    """Truncate (keep the last `truncate` tokens), check the lengths, resolve `max_new_tokens`."""
    _require(bool(token_ids), "`inputs` cannot be empty", param)
    kept_ids = token_ids[-params.truncate :] if params.truncate else token_ids
    num_input, max_total = len(kept_ids), settings.max_total_tokens
    max_new_tokens = resolve_max_new_tokens(
        params.max_new_tokens, num_prompt_tokens=num_input, max_total_tokens=max_total
    )
    _require(
        num_input + max_new_tokens <= max_total,
        f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
        f"Given: {num_input} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
    )
    max_input = settings.max_input_tokens
    _require(
        num_input <= max_input,
        f"`inputs` must have less than {max_input} tokens. Given: {num_input}",
        param,
    )
    min_tokens = params.sampling.min_tokens
    _require(
        min_tokens <= max_new_tokens,
        f"`min_tokens` must be <= the maximum number of new tokens ({max_new_tokens}). "
        f"Given: {min_tokens}",
        "min_tokens",
    )
    return ValidatedRequest(
        prompt=prompt,
        prompt_token_ids=kept_ids,
        params=params,
        stopping=stopping_params(
            params, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
        ),
        priority=priority,
        deadline=deadline,
    )


# --- Shared ------------------------------------------------------------------------------------


def _check_repetition_penalty(value: float | None) -> None:
    _require(
        value is None or value > 0,
        "`repetition_penalty` must be strictly positive",
        "repetition_penalty",
    )


def _check_penalty(name: str, value: float | None) -> None:
    _require(
        value is None or -MAX_PENALTY <= value <= MAX_PENALTY,
        f"`{name}` must be >= -2.0 and <= 2.0",
        name,
    )


def _check_min_p(value: float | None) -> None:
    _require(value is None or 0 <= value <= 1, "`min_p` must be >= 0.0 and <= 1.0", "min_p")


def _check_min_tokens(value: int | None) -> None:
    _require(
        value is None or value >= 0, f"`min_tokens` must be >= 0. Given: {value}", "min_tokens"
    )


def _check_probability_mass(name: str, value: float | None) -> None:
    _require(value is None or 0 < value <= 1, f"`{name}` must be > 0.0 and <= 1.0", name)


def _check_top_n(name: str, top_n: int, settings: Settings) -> None:
    limit = settings.max_top_n_tokens
    _require(0 <= top_n <= limit, f"`{name}` must be >= 0 and <= {limit}. Given: {top_n}", name)


def _check_stop_count(num_stop: int, settings: Settings) -> None:
    limit = settings.max_stop_sequences
    _require(
        num_stop <= limit,
        f"`stop` supports up to {limit} stop sequences. Given: {num_stop}",
        "stop",
    )


def _non_empty(stop_strings: list[str]) -> tuple[str, ...]:
    return tuple(stop for stop in stop_strings if stop)


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def _require(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise ValidationError(message, param=param)
