"""Everything that crosses the api ↔ batcher boundary: typed, versioned, JSON on the wire.

A frame is `{"v": VERSION, "type": <kind>, "body": {...}}`. Decoding checks the version, the kind
and every field's type, and raises `MessageError` (never anything else) on bad input, so a garbage
entry in Redis is rejected with a reason instead of crashing the batcher. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tgq.batcher.grammar import GrammarSpec, spec_from_wire
from tgq.batcher.request import FinishReason, Priority, StoppingParams
from tgq.gpu_worker.plan import SamplingParams

VERSION = 1


class MessageError(ValueError):
    """A frame that is not a valid message of this version."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None  # unix time; past it the request finishes ("deadline")
    attempt: int = 1  # 1 on first delivery; a reclaim requeues it with attempt + 1
    # The api's `x-request-id` of the HTTP request that submitted it, on the batcher's log lines
    # about it, and the W3C `traceparent` of the api's enqueue span. "" when there is none (the
    # reconciler's and batches' resubmissions, tracing off); optional on the wire.
    http_request_id: str = ""
    traceparent: str = ""
    # Structured output: what the output must match (optional on the wire; None: free).
    grammar: GrammarSpec | None = None
    speculate: bool = True  # False: no draft tokens (optional on the wire)
    adapter: str | None = None  # its LoRA adapter (`--lora-adapters`; optional on the wire)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    reason: str = "aborted by client"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenEvent:
    """Output event `seq_index` (0, 1, ... per request) of one attempt; a rerun replays the same
    indices, and the transport keeps only the first event per index."""

    request_id: str
    seq_index: int
    token_ids: list[int]
    logprobs: list[float | None]
    text: str = ""  # text delta released with these tokens (with a tokenizer)
    attempt: int = 1
    created_at: float = 0.0  # unix time the engine step produced it (latency, ITL)
    # Per token: the most likely tokens as (token id, logprob), when the request asked for them.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalResult:
    request_id: str
    token_ids: list[int]  # the whole output
    finish_reason: FinishReason
    finish_detail: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    attempt: int
    batcher_id: str
    text: str | None = None
    matched_stop: str | None = None  # the stop string that ended it (finish_reason "stop")
    logprobs: list[float | None] = field(default_factory=list)  # per output token, if asked
    # Per prompt token, if asked (`SamplingParams.prompt_logprobs`): its logprob (None for the
    # first) and the most likely tokens at its position as (token id, logprob).
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    batcher_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    max_batch_size: int
    time: float  # unix time it was sent
    # Added later, so absent from older batchers' beats (0): usable KV blocks, and the prompt
    # tokens looked up in / found in the prefix cache since the batcher started; the steps that
    # computed tokens, their tokens, and the largest step's.
    num_usable_blocks: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_steps: int = 0
    num_step_tokens: int = 0
    max_step_tokens: int = 0
    # Structured output (`grammar_compiler.GrammarStats`): compiles per histogram bucket, their
    # total seconds, failures, cache hits; masks computed and their total seconds; greedy rows'
    # argmax checks and the checks that missed.
    grammar_compiles: list[int] = field(default_factory=list)
    grammar_compile_seconds: float = 0.0
    num_grammar_failures: int = 0
    num_grammar_cache_hits: int = 0
    num_grammar_masks: int = 0
    grammar_mask_seconds: float = 0.0
    num_grammar_argmax_checks: int = 0
    num_grammar_argmax_misses: int = 0
    # What the batcher holds (0 from older batchers): its model's weights in bytes, as held (one
    # rank's), and tokens per KV block.
    weight_bytes: int = 0
    kv_block_size: int = 0
    # Speculative decoding (`speculation.SpeculationStats`; zeros when off, empty from older
    # batchers): draft tokens proposed and accepted, sequence-steps that verified drafts, and
    # the acceptance histogram with its sum.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_verified: int = 0
    spec_acceptance: list[int] = field(default_factory=list)
    spec_acceptance_sum: float = 0.0


Message = SubmitRequest | AbortRequest | TokenEvent | FinalResult | Heartbeat

_KINDS: dict[type[Any], str] = {
    SubmitRequest: "submit",
    AbortRequest: "abort",
    TokenEvent: "token",
    FinalResult: "final",
    Heartbeat: "heartbeat",
}


def encode(message: Message) -> bytes:
    body = {f.name: _plain(getattr(message, f.name)) for f in dataclasses.fields(message)}
    frame = {"v": VERSION, "type": _KINDS[type(message)], "body": body}
    return json.dumps(frame, separators=(",", ":")).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def decode(data: bytes | str) -> Message:
    try:
        frame = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MessageError(f"not a JSON message frame: {error}") from None
    if not isinstance(frame, dict) or not isinstance(frame.get("body"), dict):
        raise MessageError("a message frame is an object with 'v', 'type' and 'body'")
    if frame.get("v") != VERSION:
        raise MessageError(f"unsupported message version {frame.get('v')!r} (this is {VERSION})")
    decoder = _DECODERS.get(str(frame.get("type")))
    if decoder is None:
        raise MessageError(f"unknown message type {frame.get('type')!r}")
    try:
        return decoder(frame["body"])
    except MessageError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise MessageError(f"malformed {frame['type']} message: {error!r}") from None


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise MessageError(f"missing field {name!r}")
    value, kinds = body[name], kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise MessageError(f"field {name!r} has the wrong type: {value!r}")
    return value


def _ints(body: dict[str, Any], name: str) -> list[int]:
    values = _field(body, name, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise MessageError(f"field {name!r} must be a list of integers")
    return list(values)


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    return None if body.get(name) is None else _field(body, name, kind)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    if not set(body) <= names:
        raise MessageError(f"unknown sampling fields {sorted(set(body) - names)}")
    return SamplingParams(**body)


def _stopping(body: dict[str, Any]) -> StoppingParams:
    return StoppingParams(
        max_new_tokens=_field(body, "max_new_tokens", int),
        eos_token_ids=frozenset(_ints(body, "eos_token_ids")),
        stop_token_ids=frozenset(_ints(body, "stop_token_ids")),
        stop_strings=tuple(str(s) for s in _field(body, "stop_strings", list)),
        ignore_eos=_field(body, "ignore_eos", bool),
    )


def _submit(body: dict[str, Any]) -> SubmitRequest:
    return SubmitRequest(
        request_id=_field(body, "request_id", str),
        prompt_token_ids=_ints(body, "prompt_token_ids"),
        sampling=_sampling(_field(body, "sampling", dict)),
        stopping=_stopping(_field(body, "stopping", dict)),
        priority=Priority(_field(body, "priority", int)),
        deadline=_optional(body, "deadline", (int, float)),
        attempt=_field(body, "attempt", int),
        http_request_id=_optional(body, "http_request_id", str) or "",
        traceparent=_optional(body, "traceparent", str) or "",
        grammar=spec_from_wire(body.get("grammar")),
        speculate=_optional(body, "speculate", bool) is not False,
        adapter=_optional(body, "adapter", str),
    )


def _abort(body: dict[str, Any]) -> AbortRequest:
    return AbortRequest(_field(body, "request_id", str), _field(body, "reason", str))


def _logprobs(body: dict[str, Any], name: str) -> list[float | None]:
    logprobs = _field(body, name, list) if name in body else []
    if not all(v is None or isinstance(v, (int, float)) for v in logprobs):
        raise MessageError(f"field {name!r} must be a list of numbers or nulls")
    return list(logprobs)


def _ranks(body: dict[str, Any], name: str) -> list[int | None]:
    ranks = _field(body, name, list) if name in body else []
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in ranks):
        raise MessageError(f"field {name!r} must be a list of integers or nulls")
    return list(ranks)


def _top_logprobs(
    body: dict[str, Any], name: str = "top_logprobs"
) -> list[list[tuple[int, float]]]:
    per_token = body.get(name, [])
    try:
        return [[(int(i), float(lp)) for i, lp in top] for top in per_token]
    except (TypeError, ValueError):
        raise MessageError(f"field {name!r} must be lists of [token id, logprob]") from None


def _token(body: dict[str, Any]) -> TokenEvent:
    logprobs = _logprobs(body, "logprobs")
    return TokenEvent(
        request_id=_field(body, "request_id", str),
        seq_index=_field(body, "seq_index", int),
        token_ids=_ints(body, "token_ids"),
        logprobs=list(logprobs),
        text=_field(body, "text", str),
        attempt=_field(body, "attempt", int),
        created_at=float(_field(body, "created_at", (int, float))),
        top_logprobs=_top_logprobs(body),
    )


def _final(body: dict[str, Any]) -> FinalResult:
    return FinalResult(
        request_id=_field(body, "request_id", str),
        token_ids=_ints(body, "token_ids"),
        finish_reason=FinishReason(_field(body, "finish_reason", str)),
        finish_detail=_optional(body, "finish_detail", str),
        num_prompt_tokens=_field(body, "num_prompt_tokens", int),
        num_output_tokens=_field(body, "num_output_tokens", int),
        num_cached_tokens=_field(body, "num_cached_tokens", int),
        attempt=_field(body, "attempt", int),
        batcher_id=_field(body, "batcher_id", str),
        text=_optional(body, "text", str),
        matched_stop=_optional(body, "matched_stop", str),
        logprobs=_logprobs(body, "logprobs"),
        prompt_logprobs=_logprobs(body, "prompt_logprobs"),
        prompt_top_logprobs=_top_logprobs(body, "prompt_top_logprobs"),
        prompt_ranks=_ranks(body, "prompt_ranks"),
    )


def _heartbeat(body: dict[str, Any]) -> Heartbeat:
    return Heartbeat(
        batcher_id=_field(body, "batcher_id", str),
        num_running=_field(body, "num_running", int),
        num_waiting=_field(body, "num_waiting", int),
        num_free_blocks=_field(body, "num_free_blocks", int),
        max_batch_size=_field(body, "max_batch_size", int),
        time=_field(body, "time", (int, float)),
        num_usable_blocks=_optional(body, "num_usable_blocks", int) or 0,
        num_prefix_query_tokens=_optional(body, "num_prefix_query_tokens", int) or 0,
        num_prefix_hit_tokens=_optional(body, "num_prefix_hit_tokens", int) or 0,
        num_steps=_optional(body, "num_steps", int) or 0,
        num_step_tokens=_optional(body, "num_step_tokens", int) or 0,
        max_step_tokens=_optional(body, "max_step_tokens", int) or 0,
        grammar_compiles=_ints(body, "grammar_compiles") if "grammar_compiles" in body else [],
        grammar_compile_seconds=_optional(body, "grammar_compile_seconds", (int, float)) or 0.0,
        num_grammar_failures=_optional(body, "num_grammar_failures", int) or 0,
        num_grammar_cache_hits=_optional(body, "num_grammar_cache_hits", int) or 0,
        num_grammar_masks=_optional(body, "num_grammar_masks", int) or 0,
        grammar_mask_seconds=_optional(body, "grammar_mask_seconds", (int, float)) or 0.0,
        num_grammar_argmax_checks=_optional(body, "num_grammar_argmax_checks", int) or 0,
        num_grammar_argmax_misses=_optional(body, "num_grammar_argmax_misses", int) or 0,
        num_spec_proposed=_optional(body, "num_spec_proposed", int) or 0,
        num_spec_accepted=_optional(body, "num_spec_accepted", int) or 0,
        num_spec_verified=_optional(body, "num_spec_verified", int) or 0,
        spec_acceptance=_ints(body, "spec_acceptance") if "spec_acceptance" in body else [],
        spec_acceptance_sum=_optional(body, "spec_acceptance_sum", (int, float)) or 0.0,
        weight_bytes=_optional(body, "weight_bytes", int) or 0,
        kv_block_size=_optional(body, "kv_block_size", int) or 0,
    )


_DECODERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "submit": _submit,
    "abort": _abort,
    "token": _token,
    "final": _final,
    "heartbeat": _heartbeat,
}
