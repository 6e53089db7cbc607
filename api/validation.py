"""Request validation at the edge: TGI and OpenAI bodies (`api.openai_validation`) into one
`GenerationParams`, then,
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
  `adapter_id` other than null, the base model's id or a served LoRA adapter (`--lora-adapters`)
  is rejected (TGI falls back to the base model for unknown ids).
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

from tgq.api.errors import require
from tgq.api.request_fields import adapter_of, check_parameter_fields
from tgq.api.schemas.tgi import GenerateParameters, default_parameters
from tgq.api.settings import Settings
from tgq.api.structured import tgi_grammar
from tgq.api.submit import resolve_max_new_tokens, stopping_params
from tgq.api.validated import GenerationParams, ValidatedRequest
from tgq.batcher.request import Priority
from tgq.gpu_worker.plan import SamplingParams

T = TypeVar("T")
MAX_PENALTY = 2.0  # frequency and presence penalties live in [-2, 2]


def check_inputs(prompt: str, param: str = "inputs") -> None:
    """TGI's message on every route; `param` names the field of the route's own body."""
    require(prompt != "", "`inputs` cannot be empty", param)


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
    best_of = default(p.best_of, 1)
    _check_tgi_streaming(p, best_of, is_stream=is_stream)
    _check_tgi_best_of(p, best_of, settings, is_stream=is_stream)
    _check_tgi_knobs(p)
    _check_tgi_limits(p, best_of, settings)
    needs_logprobs = is_stream or p.details or p.decoder_input_details or best_of > 1
    if p.decoder_input_details:
        check_prefill_logprobs("decoder_input_details", settings)
    sampling = _tgi_sampling(p, logprobs=needs_logprobs)
    if p.decoder_input_details:
        sampling = dataclasses.replace(sampling, prompt_logprobs=0)
    return GenerationParams(
        sampling=sampling,
        max_new_tokens=p.max_new_tokens,
        stop_strings=non_empty(p.stop),
        ignore_eos=p.ignore_eos,
        speculate=p.speculate,
        truncate=p.truncate,
        best_of=best_of,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        return_full_text=default(p.return_full_text, return_full_text_default),
        include_stop_string=True,
        top_n_tokens=default(p.top_n_tokens, 0),
        grammar=tgi_grammar(p.grammar),
        adapter=adapter_of(p.adapter_id, settings.model_id, settings.adapter_dirs),
    )


PREFILL_LOGPROBS_OFF = (
    "prompt logprobs are off on this server (asked by `{param}`): start it with"
    " --enable-prefill-logprobs (env ENABLE_PREFILL_LOGPROBS=true)"
)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """A prompt given as token ids: each one a token of the vocabulary."""
    last = vocab_size - 1
    for token_id in token_ids:
        message = f"token id {token_id} in `{param}` is not in the vocabulary (ids 0 to {last})"
        require(0 <= token_id <= last, message, param)


def check_prefill_logprobs(param: str, settings: Settings) -> None:
    """A request for its prompt tokens' logprobs needs `--enable-prefill-logprobs` (TGI's)."""
    require(settings.enable_prefill_logprobs, PREFILL_LOGPROBS_OFF.format(param=param), param)


def _check_tgi_streaming(p: GenerateParameters, best_of: int, *, is_stream: bool) -> None:
    if not is_stream:
        return
    require(best_of == 1, "`best_of` != 1 is not supported when streaming tokens", "best_of")
    require(
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
    require(limit != 1, "`best_of` != 1 is not allowed for this endpoint", "best_of")
    require(
        0 < best_of <= limit, f"`best_of` must be > 0 and <= {limit}. Given: {best_of}", "best_of"
    )
    # TGI's router counts any sampling knob that is set, whatever its value.
    knobs = (p.temperature, p.top_k, p.top_p, p.typical_p)
    is_sampling = p.do_sample or any(knob is not None for knob in knobs)
    require(is_sampling, "you must use sampling when `best_of` is > 1", "best_of")


def _check_tgi_knobs(p: GenerateParameters) -> None:
    temperature, repetition_penalty = p.temperature, p.repetition_penalty
    require(
        temperature is None or temperature > 0,
        "`temperature` must be strictly positive",
        "temperature",
    )
    check_repetition_penalty(repetition_penalty)
    check_penalty("frequency_penalty", p.frequency_penalty)
    check_probability_mass("top_p", p.top_p)
    check_probability_mass("typical_p", p.typical_p)
    require(p.top_k is None or p.top_k > 0, "`top_k` must be strictly positive", "top_k")
    require(p.max_new_tokens != 0, "`max_new_tokens` must be strictly positive", "max_new_tokens")
    check_min_p(p.min_p)
    check_min_tokens(p.min_tokens)


def _check_tgi_limits(p: GenerateParameters, best_of: int, settings: Settings) -> None:
    check_stop_count(len(p.stop), settings)
    require(p.seed is None or best_of <= 1, "`seed` must not be set when `best_of` > 1", "seed")
    top_n, limit = default(p.top_n_tokens, 0), settings.max_top_n_tokens
    require(
        top_n <= limit,
        f"`top_n_tokens` must be >= 0 and <= {limit}. Given: {top_n}",
        "top_n_tokens",
    )
    max_input = settings.max_input_tokens
    require(
        p.truncate is None or 0 < p.truncate <= max_input,
        f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}",
        "truncate",
    )
    require(not p.watermark, "`watermark` is not supported", "watermark")


def _tgi_sampling(p: GenerateParameters, *, logprobs: bool) -> SamplingParams:
    """Greedy unless TGI's server would sample (`tokens.py`: `do_sample` or any sampling knob
    away from its neutral value); penalties apply either way."""
    greedy = SamplingParams(
        temperature=0.0,
        repetition_penalty=default(p.repetition_penalty, 1.0),
        frequency_penalty=default(p.frequency_penalty, 0.0),
        seed=p.seed,
        logprobs=logprobs,
        top_n_logprobs=default(p.top_n_tokens, 0),
        min_tokens=default(p.min_tokens, 0),
    )
    sampling = dataclasses.replace(
        greedy,
        temperature=default(p.temperature, 1.0),
        top_k=default(p.top_k, 0),
        top_p=default(p.top_p, 1.0),
        typical_p=default(p.typical_p, 1.0),
        min_p=default(p.min_p, 0.0),
    )
    is_sampling = p.do_sample or sampling.temperature != 1.0 or sampling.top_k != 0
    is_sampling = is_sampling or sampling.top_p < 1.0 or sampling.typical_p < 1.0
    is_sampling = is_sampling or sampling.min_p > 0.0
    return sampling if is_sampling else greedy


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
    require(bool(token_ids), "`inputs` cannot be empty", param)
    kept_ids = token_ids[-params.truncate :] if params.truncate else token_ids
    num_input, max_total = len(kept_ids), settings.max_total_tokens
    max_new_tokens = resolve_max_new_tokens(
        params.max_new_tokens, num_prompt_tokens=num_input, max_total_tokens=max_total
    )
    require(
        num_input + max_new_tokens <= max_total,
        f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
        f"Given: {num_input} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
    )
    max_input = settings.max_input_tokens
    require(
        num_input <= max_input,
        f"`inputs` must have less than {max_input} tokens. Given: {num_input}",
        param,
    )
    min_tokens = params.sampling.min_tokens
    require(
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


def check_repetition_penalty(value: float | None) -> None:
    require(
        value is None or value > 0,
        "`repetition_penalty` must be strictly positive",
        "repetition_penalty",
    )


def check_penalty(name: str, value: float | None) -> None:
    require(
        value is None or -MAX_PENALTY <= value <= MAX_PENALTY,
        f"`{name}` must be >= -2.0 and <= 2.0",
        name,
    )


def check_min_p(value: float | None) -> None:
    require(value is None or 0 <= value <= 1, "`min_p` must be >= 0.0 and <= 1.0", "min_p")


def check_min_tokens(value: int | None) -> None:
    require(value is None or value >= 0, f"`min_tokens` must be >= 0. Given: {value}", "min_tokens")


def check_probability_mass(name: str, value: float | None) -> None:
    require(value is None or 0 < value <= 1, f"`{name}` must be > 0.0 and <= 1.0", name)


def check_top_n(name: str, top_n: int, settings: Settings) -> None:
    limit = settings.max_top_n_tokens
    require(0 <= top_n <= limit, f"`{name}` must be >= 0 and <= {limit}. Given: {top_n}", name)


def check_stop_count(num_stop: int, settings: Settings) -> None:
    limit = settings.max_stop_sequences
    require(
        num_stop <= limit,
        f"`stop` supports up to {limit} stop sequences. Given: {num_stop}",
        "stop",
    )


def non_empty(stop_strings: list[str]) -> tuple[str, ...]:
    return tuple(stop for stop in stop_strings if stop)


def default(value: T | None, default: T) -> T:
    return default if value is None else value
