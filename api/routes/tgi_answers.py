"""The answers of TGI's `/generate` (and `/`): the generated text as TGI's parameters shape it,
its `details` and tokens (with `best_of`, the copy with the highest log probability wins), TGI's
finish reasons and its `x-*` timing headers. `/generate_stream`'s events use the same pieces.
"""

from __future__ import annotations

import time
from typing import Any

from tgq.api.app import AppState
from tgq.api.run import Run
from tgq.api.schemas.tgi import BestOfSequence, Details, GenerateResponse, PrefillToken, Token
from tgq.batcher.messages import FinalResult
from tgq.batcher.request import FinishReason


def finish_reason(final: FinalResult) -> str:
    """TGI's names: `eos_token`, `stop_sequence`, `length`."""
    if final.finish_reason == FinishReason.STOP:
        return "stop_sequence" if final.matched_stop is not None else "eos_token"
    return "length"


def output_text(state: AppState, final: FinalResult, *, include_stop: bool) -> str:
    text = final.text if final.text is not None else state.tokenizer.decode(final.token_ids)
    if include_stop and final.matched_stop is not None:
        text += final.matched_stop
    return text


def tgi_text(state: AppState, run: Run, index: int, final: FinalResult) -> str:
    prompt = run.prompt_of(index)
    text = output_text(state, final, include_stop=prompt.params.include_stop_string)
    return prompt.prompt + text if prompt.params.return_full_text else text


def token(state: AppState, token_id: int, logprob: float | None, text: str | None = None) -> Token:
    return Token(
        id=token_id,
        text=state.tokenizer.token_text(token_id) if text is None else text,
        logprob=logprob,
        special=state.tokenizer.is_special(token_id),
    )


def top_tokens(state: AppState, candidates: list[tuple[int, float]]) -> list[Token]:
    return [token(state, token_id, logprob) for token_id, logprob in candidates]


def _sequence(state: AppState, run: Run, index: int) -> dict[str, Any]:
    request = run.requests[index]
    final = run.finals[request.request_id]
    prompt = run.prompt_of(index)
    logprobs = final.logprobs or [None] * len(final.token_ids)
    events = run.events.get(request.request_id, [])
    tops = [top_tokens(state, t) for event in events for t in event.top_logprobs]
    prefill = []
    if prompt.params.decoder_input_details:
        scores = final.prompt_logprobs or [None] * len(prompt.prompt_token_ids)
        prefill = [
            PrefillToken(id=i, text=state.tokenizer.token_text(i), logprob=lp)
            for i, lp in zip(prompt.prompt_token_ids, scores, strict=False)
        ]
    return {
        "generated_text": tgi_text(state, run, index, final),
        "finish_reason": finish_reason(final),
        "generated_tokens": final.num_output_tokens,
        "seed": request.sampling.seed,
        "prefill": prefill,
        "tokens": [token(state, i, lp) for i, lp in zip(final.token_ids, logprobs, strict=False)],
        "top_tokens": tops,
    }


def _score(run: Run, index: int) -> float:
    final = run.finals[run.requests[index].request_id]
    return sum(lp for lp in final.logprobs if lp is not None)


def generate_response(state: AppState, run: Run) -> GenerateResponse:
    """One prompt's answer; with `best_of`, the copy with the highest log probability wins."""
    indices = range(len(run.requests))
    best = max(indices, key=lambda i: _score(run, i)) if run.copies > 1 else 0
    params = run.prompt_of(best).params
    final = run.finals[run.requests[best].request_id]
    if not (params.details or params.decoder_input_details):
        return GenerateResponse(generated_text=tgi_text(state, run, best, final))
    sequence = _sequence(state, run, best)
    others = [BestOfSequence(**_sequence(state, run, i)) for i in indices if i != best]
    text = sequence.pop("generated_text")
    details = Details(**sequence, best_of_sequences=others or None)
    return GenerateResponse(generated_text=text, details=details)


def timing_headers(run: Run, finals: list[FinalResult], compute_type: str) -> dict[str, str]:
    """TGI's `x-*` headers: times in milliseconds (`x-compute-time` in seconds)."""
    now = time.time()
    first = run.first_token_at or now
    generated = sum(final.num_output_tokens for final in finals)
    inference_s = now - first
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{now - run.started_at:.6f}",
        "x-compute-characters": str(sum(len(p.prompt) for p in run.prompts)),
        "x-total-time": str(round((now - run.started_at) * 1000)),
        "x-validation-time": str(round((run.validated_at - run.started_at) * 1000)),
        "x-queue-time": str(round(max(first - run.validated_at, 0.0) * 1000)),
        "x-inference-time": str(round(inference_s * 1000)),
        "x-time-per-token": str(round(inference_s * 1000 / max(generated, 1))),
        "x-prompt-tokens": str(sum(p.num_prompt_tokens for p in run.prompts)),
        "x-generated-tokens": str(generated),
    }
