"""The step plan: what the scheduler asks the model runner to do in one step.

Plain data only (no torch), so the batcher can build it and it can cross a process boundary as
JSON/msgpack. Modelled on vLLM v1: a sequence is sent in full the first time the runner sees it
(`NewSequence`), afterwards each step carries only a diff (`ScheduledChunk`).

The runner keeps each sequence's token ids and appends the tokens it samples, so a decode step
carries no token ids at all. A chunk computes tokens `[num_computed_tokens, num_computed_tokens +
num_new_tokens)` of the sequence; a sequence whose chunk reaches the end of its known tokens gets
a sampled next token, a chunk that stops short (chunked prefill) does not.

Speculative decoding: a decode chunk may carry `draft_token_ids`, tokens a proposer guesses come
next. The runner appends them to the sequence for this step only, computes the last known token and
the k drafts together (`num_new_tokens` = 1 + k), samples at each of those k + 1 positions (each
row sampling as if the drafts before it had been sampled), and keeps the longest prefix of drafts
that matches what it sampled, plus the token sampled after that prefix (`accepted_length`). For a
draft that is one fixed guess this is exact rejection sampling: a draft is kept with the target's
probability of it, and where it is not kept the token sampled instead is a draw from the target
with the draft excluded, so outputs are distributed as without speculation (and a seeded row, whose
draw depends only on its seed and position, samples the very same tokens). `SampledToken`s then
come several to a sequence, in order. Both sides then hold the KV of the kept tokens only: the
blocks past `num_blocks_for(len(token_ids) - 1)` are given back (`trim`).

Block tables: the KV of token `i` of a sequence lives in block `block_ids[i // block_size]` at
offset `i % block_size`; its slot is `block_id * block_size + offset`. Blocks before
`num_computed_tokens` may be shared with other sequences (prefix cache) and are only read.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

# Sentinels for "this sampling knob is off".
NO_TOP_K = 0
NO_SEED = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-sequence sampling. `temperature == 0` means greedy (argmax after penalties)."""

    temperature: float = 0.0
    top_k: int = NO_TOP_K  # 0: off
    top_p: float = 1.0  # 1.0: off
    typical_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; drop tokens less likely than min_p * the top token's prob
    repetition_penalty: float = 1.0  # HF/TGI semantics, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    seed: int | None = NO_SEED
    logprobs: bool = False  # logprob of the chosen token
    top_n_logprobs: int = 0  # also return the n most likely tokens and their logprobs
    # vLLM's `min_tokens`: `min_tokens_stop_ids` (EOS unless ignored, and the stop token ids;
    # the batcher's engine fills them in) are masked while fewer tokens have been generated.
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    # The prompt's tokens' logprobs (each under the model's raw distribution after the tokens
    # before it; the first has none): None off, 0 each token's own, n > 0 also the n most likely
    # tokens at each position (vLLM's `prompt_logprobs`). Every prompt token is then computed
    # (no prefix-cache hits).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # JSON and msgpack hand the ids back as a list; a tuple keeps the params hashable.
        object.__setattr__(self, "min_tokens_stop_ids", tuple(self.min_tokens_stop_ids))
        _check(self.temperature >= 0.0, "temperature must be >= 0")
        _check(self.top_k >= 0, "top_k must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(0.0 < self.typical_p <= 1.0, "typical_p must be in (0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be > 0")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _check(self.top_n_logprobs >= 0, "top_n_logprobs must be >= 0")
        _check(self.min_tokens >= 0, "min_tokens must be >= 0")
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs must be >= 0",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_n_logprobs > 0

    @property
    def needs_only_argmax(self) -> bool:
        """Greedy, with nothing that reads the other logits (penalties, logprobs, masks)."""
        return (
            self.is_greedy
            and not self.has_penalties
            and not self.wants_logprobs
            and not self.masks_stop_ids
        )

    @property
    def masks_stop_ids(self) -> bool:
        return self.min_tokens > 0 and bool(self.min_tokens_stop_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the runner has not seen (or has dropped, e.g. after preemption)."""

    request_id: str
    token_ids: list[int]  # every known token: prompt, plus output so far when resumed
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]  # initial block table
    adapter: str | None = None  # the LoRA adapter it runs with (`--lora-adapters`); None: base


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's share of a step."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache (prefix hits included)
    num_new_tokens: int  # tokens to compute now
    new_block_ids: list[int] = field(default_factory=list)  # appended to the block table
    # Speculation: guessed next tokens, computed after the sequence's last token (see above);
    # only on a chunk that starts at the last token (`num_computed_tokens` = known tokens - 1).
    draft_token_ids: list[int] = field(default_factory=list)
    # Or: this many drafts for the runner's draft model to guess first (`gpu_worker.drafter`).
    num_model_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) or self.num_model_drafts


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the runner needs for one forward pass. Chunks run in the given order."""

    new_sequences: list[NewSequence] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # drop their state first
    # Structured output: the tokens a sequence may sample next, for the sequences this step
    # samples under a grammar. A bitmask: token t is allowed when bit `t % 32` of little-endian
    # 32-bit word `t // 32` is set; tokens past its end are not. A chunk with k drafts has k + 1
    # masks of one size one after another: its last token's row's, then each draft's row's
    # (the grammar's state after the drafts before it). In the engine's process the mapping
    # may also be `ArgmaxFirst` (the wire carries every mask).
    token_masks: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


@runtime_checkable
class ArgmaxFirst(Protocol):
    """`StepPlan.token_masks` that let greedy rows skip their mask: for a row that
    `checks_argmax_first`, the runner takes the argmax over every token, asks whether the grammar
    `allows` it (then it is also the argmax over the allowed tokens), and only when not reads the
    row's mask (computed then) and takes the argmax again. `batcher.grammar_compiler.StepMasks`."""

    def checks_argmax_first(self, request_id: str) -> bool: ...

    def allows(self, request_id: str, token_id: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The runner's answer for one sequence whose chunk reached the end of its tokens."""

    request_id: str
    token_id: int
    # Of the chosen token, under the model's raw distribution; None unless the sequence's
    # SamplingParams asked for logprobs.
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] = field(default_factory=list)


def accepted_length(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many of the drafts a chunk keeps: the longest prefix equal to the tokens sampled at
    the positions before them (`sampled_token_ids[i]` follows the sequence plus `drafts[:i]`;
    one more than the drafts). The tokens kept are `sampled_token_ids[: accepted + 1]`."""
    accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids, strict=False):
        if draft != sampled:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A sequence's prompt tokens `[start, start + len(logprobs))` computed in this step, each
    token's logprob after the tokens before it (`start` >= 1: the first token has none) and its
    rank there, with the `prompt_logprobs` most likely tokens at each of those positions."""

    request_id: str
    start: int
    logprobs: list[float]
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # each token's rank in its distribution (1: top)


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


def to_wire(plan: StepPlan) -> dict[str, Any]:
    """Plain dict/list form for JSON or msgpack (no pickle); masks as base64."""
    masks = dict(plan.token_masks)  # every mask, computed now where it was not yet
    wire = asdict(replace(plan, token_masks={}))
    wire["token_masks"] = {k: base64.b64encode(v).decode() for k, v in masks.items()}
    return wire


def plan_from_wire(data: dict[str, Any]) -> StepPlan:
    return StepPlan(
        new_sequences=[
            NewSequence(
                request_id=s["request_id"],
                token_ids=list(s["token_ids"]),
                num_prompt_tokens=s["num_prompt_tokens"],
                sampling=SamplingParams(**s["sampling"]),
                block_ids=list(s["block_ids"]),
                adapter=s.get("adapter"),
            )
            for s in data["new_sequences"]
        ],
        chunks=[ScheduledChunk(**c) for c in data["chunks"]],
        finished_request_ids=list(data["finished_request_ids"]),
        token_masks={k: base64.b64decode(v) for k, v in data.get("token_masks", {}).items()},
    )
