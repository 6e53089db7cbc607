"""One `Request` per sequence: its tokens, KV bookkeeping, parameters and lifecycle status.

Lifecycle (every move goes through `Request.transition`, checked against `_TRANSITIONS`):

    WAITING ──▶ RUNNING ──▶ FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED | FINISHED_FAILED
       │           │  ▲
       │           ▼  │ (re-admitted: recomputes prompt + output so far)
       │        PREEMPTED ──▶ FINISHED_ABORTED
       └──▶ FINISHED_REJECTED | FINISHED_ABORTED

A PREEMPTED request sits in the waiting queue again, at its original arrival position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING

from tgq.batcher.stopping import OutputText
from tgq.gpu_worker.plan import PromptLogprobs, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from tgq.batcher.grammar_compiler import Constraint


class RequestStatus(IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6
    FINISHED_FAILED = 7  # its own state broke (a grammar past its limits), not the engine

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REJECTED}
    ),
    RequestStatus.RUNNING: frozenset(
        {
            RequestStatus.PREEMPTED,
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_FAILED,
        }
    ),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
    RequestStatus.FINISHED_STOPPED: frozenset(),
    RequestStatus.FINISHED_LENGTH: frozenset(),
    RequestStatus.FINISHED_ABORTED: frozenset(),
    RequestStatus.FINISHED_REJECTED: frozenset(),
    RequestStatus.FINISHED_FAILED: frozenset(),
}


class FinishReason(StrEnum):
    """Why a request ended, on the wire (`FinalResult`) and in the database (`results`)."""

    STOP = "stop"  # an EOS token, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # the client went away, or cancelled
    REJECTED = "rejected"  # it could never run here (e.g. longer than the KV cache)
    DEADLINE = "deadline"  # its deadline passed
    FAILED = "failed"  # the engine failed it, or its attempts ran out


# Ends that count as the request failing (errors, health, traces), not as an answer.
FAILED_REASONS = frozenset({FinishReason.FAILED, FinishReason.REJECTED})

FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
    RequestStatus.FINISHED_FAILED: FinishReason.FAILED,
}


class Priority(IntEnum):
    """Higher runs first; bulk fills idle capacity and is preempted first."""

    BULK = 0
    INTERACTIVE = 1


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """Token-level stopping is applied by the scheduler; `stop_strings` are matched on the
    detokenized text elsewhere and end a request through `Scheduler.finish`."""

    max_new_tokens: int = 16
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS plus generation_config extras
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt, then every sampled token
    num_prompt_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = 0.0
    arrival_order: int = 0  # tie-breaker among equal arrival times, set by the scheduler
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in `block_ids` (prefix hits included)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    kv_salt: bytes = b""  # the prefix-cache salt its KV was computed under (set at admission)
    # `SamplingParams.prompt_logprobs`: per prompt token, its logprob (None for the first, and
    # until computed) and the most likely tokens at its position; empty when not asked.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    num_preemptions: int = 0
    finish_detail: str | None = None  # why it finished, in words (e.g. the rejection reason)
    # Detokenized output, when the engine has a tokenizer; stop strings are matched on it.
    output_text: OutputText | None = None
    new_text: str = ""  # text released since the last output event (taken by the engine)
    # Structured output: masks each next token, advances with each sampled one.
    grammar: Constraint | None = None
    speculate: bool = True  # False: never gets draft tokens (a per-request opt-out)
    adapter: str | None = None  # the LoRA adapter it runs with (`--lora-adapters`); None: base

    def record_prompt_logprobs(self, part: PromptLogprobs) -> None:
        """Keep a step's prompt logprobs; positions already kept (a recompute after preemption
        computes them again) keep their first value."""
        if not self.prompt_logprobs:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
            self.prompt_top_logprobs = [[] for _ in range(self.num_prompt_tokens)]
            self.prompt_ranks = [None] * self.num_prompt_tokens
        for offset, logprob in enumerate(part.logprobs):
            index = part.start + offset
            if index < self.num_prompt_tokens and self.prompt_logprobs[index] is None:
                self.prompt_logprobs[index] = logprob
                if offset < len(part.top_logprobs):
                    self.prompt_top_logprobs[index] = part.top_logprobs[offset]
                if offset < len(part.ranks):
                    self.prompt_ranks[index] = part.ranks[offset]

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"request {self.request_id!r}: a prompt needs at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_num_kv_tokens(self) -> int:
        """Most tokens it can ever hold KV for: the last sampled token is never computed."""
        return self.num_prompt_tokens + self.stopping.max_new_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: higher priority first, then earlier arrival."""
        return (-self.priority, self.arrival_time, self.arrival_order)

    def transition(self, status: RequestStatus, detail: str | None = None) -> None:
        if status not in _TRANSITIONS[self.status]:
            raise ValueError(
                f"request {self.request_id!r}: {self.status.name} -> {status.name} is not allowed"
            )
        self.status = status
        if detail is not None:
            self.finish_detail = detail
        text = self.output_text
        if status.is_finished and text is not None and text.matched_stop is None:
            self.new_text += text.finish()  # held-back text was not a stop string after all

    def append_token(self, token_id: int, logprob: float | None, top: list[TokenLogprob]) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.output_top_logprobs.append(top)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if self.output_text is not None:
            self.new_text += self.output_text.push(token_id, can_stop=self.can_stop)[0]

    @property
    def can_stop(self) -> bool:
        """Whether EOS, stop tokens and stop strings may end it: not before `min_tokens` output
        tokens (vLLM's rule; the sampler masks the stop ids for the tokens before that)."""
        return self.num_output_tokens >= self.sampling.min_tokens

    def stop_status(self) -> tuple[RequestStatus, str | None] | None:
        """Stopping after the last sampled token: a stop string completed in the text, EOS, stop
        token ids (none of them before `min_tokens`), length. Returns the status and a detail,
        or None to go on. A grammar that allows nothing more ends it whatever `min_tokens` says:
        EOS is all it could still sample."""
        if self.grammar is not None and self.grammar.is_complete:
            return RequestStatus.FINISHED_STOPPED, "grammar complete"
        if self.can_stop and (stop := self._stop_before_length()) is not None:
            return stop
        if self.num_output_tokens >= self.stopping.max_new_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def _stop_before_length(self) -> tuple[RequestStatus, str] | None:
        matched = self.output_text.matched_stop if self.output_text is not None else None
        if matched is not None:
            return RequestStatus.FINISHED_STOPPED, f"stop string {matched!r}"
        last = self.token_ids[-1]
        if not self.stopping.ignore_eos and last in self.stopping.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, "eos token"
        if last in self.stopping.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, f"stop token {last}"
        return None
