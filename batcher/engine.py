"""The inference engine, in the shape of vLLM's `LLMEngine`: add requests, step, stream outputs.
The batcher (`serving.Batcher`) steps it in its loop; `offline.OfflineEngine` runs it to
completion in one call.

It drives anything with `execute(StepPlan) -> StepResult`, `num_blocks` and `block_size` (the
`ModelRunner` in `gpu_worker`, or a fake in tests) without importing it. Given a tokenizer
(`TokenDecoder`), it also detokenizes each request's output incrementally, streams the text with
every token event, and stops a request when one of its stop strings completes in that text.

Structured output: given a `GrammarCompiler`, a request may carry a `GrammarSpec`. One whose
grammar is not compiled yet waits here, outside the scheduler, while the compile thread works;
each step takes in the requests whose grammars are ready (a grammar that fails to compile rejects
its request) and sends the runner, with the plan, the mask of every constrained sequence that
samples in that step, or for a greedy row, a way to check its free argmax first (see
`grammar_compiler.StepMasks`). A step never waits for a compile; an engine with nothing else to do
waits a few milliseconds for one rather than spin.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import TokenDecoder
from tgq.batcher.grammar import GrammarError, GrammarSpec
from tgq.batcher.grammar_compiler import Constraint, GrammarCompiler, StepMasks
from tgq.batcher.request import FinishReason, Priority, Request, RequestStatus, StoppingParams
from tgq.batcher.scheduler import Scheduler
from tgq.batcher.scheduler_output import SchedulerOutput
from tgq.batcher.speculation import Proposer, Speculation, make_proposer
from tgq.batcher.stopping import OutputText
from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.plan import SamplingParams, StepPlan, StepResult, TokenLogprob

GREEDY = SamplingParams()
COMPILE_WAIT_S = 0.01  # an idle engine's longest wait for a grammar compile, per step


class StepRunner(Protocol):
    """What the engine drives. A runner may also say `checks_argmax_first = True` (the
    `ModelRunner` with a greedy head): then constrained greedy rows may check their free argmax
    against the grammar before their mask is computed (`plan.ArgmaxFirst`); without it every
    mask is computed up front, together."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One streaming event: a request's new tokens (one, or more where drafts were kept), or
    its end."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    new_top_logprobs: list[list[TokenLogprob]]
    finish_reason: FinishReason | None  # None while it runs
    finish_detail: str | None = None
    new_text: str = ""  # text released by this event (with a tokenizer; may lag the tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True)
class RequestResult:
    """A finished request's result (what `generate` returns; `RequestOutput` is one streamed
    event)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    text: str | None = None  # the released output text, with a tokenizer
    # `SamplingParams.prompt_logprobs`: per prompt token (None for the first), and the most
    # likely tokens at each prompt position; empty when not asked.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)

    @classmethod
    def of(cls, request: Request) -> RequestResult:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            logprobs=list(request.output_logprobs),
            finish_reason=request.finish_reason,
            finish_detail=request.finish_detail,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            text=request.output_text.text if request.output_text is not None else None,
            prompt_logprobs=list(request.prompt_logprobs),
            prompt_top_logprobs=list(request.prompt_top_logprobs),
        )


class LLMEngine:
    def __init__(
        self,
        runner: StepRunner,
        config: SchedulerConfig | None = None,
        decoder: TokenDecoder | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        grammars: GrammarCompiler | None = None,
        model: ModelConfig | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`eos_token_ids`: the model's (`gpu_worker.config.model_eos_token_ids`), used by every
        request whose StoppingParams names none. `grammars`: structured output (None: a request
        with a grammar is refused). `model`: the model's config, for the scheduler's prefix
        cache where the rope depends on a sequence's length (`Scheduler`). `proposer`: the
        speculative proposer when `config.speculate` > 0 (default: the configured method's)."""
        self.runner = runner
        self.decoder = decoder
        self.grammars = grammars
        self._argmax_first = bool(getattr(runner, "checks_argmax_first", False))
        # The LoRA adapters the runner serves (`ModelRunner.adapter_names`; none by default).
        self.adapter_names: frozenset[str] = frozenset(getattr(runner, "adapter_names", ()))
        # Requests waiting for their grammar's compile: (request, spec, compile).
        self._compiling: dict[str, tuple[Request, GrammarSpec, Future[Any]]] = {}
        self.eos_token_ids = eos_token_ids
        config = config or SchedulerConfig()
        speculation = None
        if config.speculate > 0:
            proposer = proposer or make_proposer(config.speculative_method)
            speculation = Speculation(
                proposer, config.speculate, config.speculative_max_batch_tokens
            )
        self.scheduler = Scheduler(config, runner.num_blocks, runner.block_size, model, speculation)
        self._requests: dict[str, Request] = {}  # added and not yet reported finished
        self._pending: list[RequestOutput] = []  # ends decided outside a step (abort, reject)
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams = GREEDY,
        stopping: StoppingParams | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
        request_id: str | None = None,
        grammar: GrammarSpec | None = None,
        speculate: bool = True,
        adapter: str | None = None,
    ) -> str:
        """`speculate`: False opts this request out of speculative decoding. `adapter`: the LoRA
        adapter it runs with (None: the base model); one the runner has not loaded
        (`adapter_names`) rejects the request."""
        if grammar is not None and self.grammars is None:
            raise ValueError("structured output needs an engine with a tokenizer (grammars)")
        stopping = stopping or StoppingParams()
        if not stopping.eos_token_ids:
            stopping = dataclasses.replace(stopping, eos_token_ids=self.eos_token_ids)
        if sampling.min_tokens > 0:
            sampling = dataclasses.replace(sampling, min_tokens_stop_ids=_stop_ids(stopping))
        request = Request(
            request_id or f"req-{next(self._ids)}",
            list(prompt_token_ids),
            len(prompt_token_ids),
            sampling,
            stopping,
            priority,
            time.monotonic(),
            speculate=speculate,
            adapter=adapter,
        )
        request.output_text = self._output_text(request)
        self._requests[request.request_id] = request
        if adapter is not None and adapter not in self.adapter_names:
            request.transition(RequestStatus.FINISHED_REJECTED, f"unknown adapter {adapter!r}")
            self._pending.append(_end_of(request))
            return request.request_id
        if grammar is not None and self.grammars is not None:
            request.grammar = self.grammars.cached(grammar)
            if request.grammar is None:
                future = self.grammars.compile(grammar)
                self._compiling[request.request_id] = (request, grammar, future)
                return request.request_id
        self._queue(request)
        return request.request_id

    def request(self, request_id: str) -> Request | None:
        """An added request that has not been reported finished."""
        return self._requests.get(request_id)

    def _queue(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.is_finished:
            self._pending.append(_end_of(request))

    def _take_compiled(self) -> None:
        """Queues the requests whose grammars are ready; waits a little for one when there is
        nothing else to run."""
        if not self._compiling:
            return
        if not self.scheduler.has_work:
            futures = [future for _, _, future in self._compiling.values()]
            concurrent.futures.wait(futures, COMPILE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        for request_id, (request, spec, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            assert self.grammars is not None
            try:
                request.grammar = self.grammars.take(spec, future)
            except GrammarError as error:
                request.transition(RequestStatus.FINISHED_REJECTED, str(error))
                self._pending.append(_end_of(request))
                continue
            self._queue(request)

    def _output_text(self, request: Request) -> OutputText | None:
        stop_strings = request.stopping.stop_strings
        if self.decoder is None:
            if stop_strings:
                raise ValueError("stop strings need an engine with a tokenizer (decoder)")
            return None
        return OutputText(self.decoder, request.prompt_token_ids, stop_strings)

    def abort(self, request_id: str) -> None:
        if (compiling := self._compiling.pop(request_id, None)) is not None:
            compiling[0].transition(RequestStatus.FINISHED_ABORTED, "aborted")
            self._pending.append(_end_of(compiling[0]))
            return
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._pending.append(_end_of(request))

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._take_compiled()
        scheduled = self.scheduler.schedule()
        plan = scheduled.to_plan()
        if (masks := self._token_masks(scheduled)) is not None:
            plan = dataclasses.replace(plan, token_masks=masks)
        outputs, self._pending = self._pending, []  # after the masks: a broken grammar ends here
        if not scheduled.is_empty:
            result = self.runner.execute(plan)
            updated = self.scheduler.update(scheduled, result)
            outputs += [_tokens_of(request, count) for request, count in updated]
            if self.scheduler.speculation is not None:
                num_kept = sum(count for _, count in updated)
                self._time_step(plan, num_kept, time.perf_counter() - start)
        for output in outputs:
            if output.is_finished:
                del self._requests[output.request_id]
        return outputs

    def _time_step(self, plan: StepPlan, num_kept: int, seconds: float) -> None:
        """A decode step's tokens and time, for speculation's choice (`DraftChoice`)."""
        speculation = self.scheduler.speculation
        if speculation is None or not plan.chunks:
            return  # no per-step work without speculation
        if not all(c.num_new_tokens == 1 + c.num_drafts for c in plan.chunks):
            return  # a prefill step says nothing about drafts
        num_drafts = sum(chunk.num_drafts for chunk in plan.chunks)
        rows = plan.num_tokens - num_drafts
        speculation.choice.record(rows, num_drafts > 0, num_kept, seconds)

    def _token_masks(self, scheduled: SchedulerOutput) -> StepMasks | None:
        """The grammar masks of the constrained sequences that sample in this step (greedy rows
        may check their free argmax first, see `StepMasks`). A grammar that broke (past
        llguidance's limits) fails its request; the runner samples its row freely and the
        scheduler drops that token."""
        if self.grammars is None:
            return None
        masks_now: dict[str, Constraint] = {}
        argmax_first: dict[str, Constraint] = {}
        drafts: dict[str, list[int]] = {}
        for chunk in scheduled.chunks:
            request = self.scheduler.requests.get(chunk.request_id)
            if request is None or request.grammar is None:
                continue
            if chunk.num_computed_tokens + chunk.num_new_tokens < request.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            if (error := request.grammar.error) is not None:
                self.scheduler.finish(chunk.request_id, RequestStatus.FINISHED_FAILED, error)
                self._pending.append(_end_of(request))
                continue
            if chunk.draft_token_ids:  # a mask for each row it verifies, computed now
                drafts[chunk.request_id] = chunk.draft_token_ids
            first = (
                self._argmax_first
                and not chunk.draft_token_ids
                and request.sampling.needs_only_argmax
                and request.grammar.checks_argmax_first()
            )
            (argmax_first if first else masks_now)[chunk.request_id] = request.grammar
        if not masks_now and not argmax_first:
            return None
        return self.grammars.step_masks(masks_now, argmax_first, drafts)

    def stream(self) -> Iterator[RequestOutput]:
        """Per-token outputs of every added request until all are finished."""
        while self.has_unfinished:
            yield from self.step()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        stopping: StoppingParams | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
        grammar: GrammarSpec | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestResult]:
        """Run the prompts together (with anything already added) to completion; `sampling` is
        one for all, or one per prompt; `grammar` constrains every prompt's output; `adapters`:
        each prompt's LoRA adapter (None: every prompt on the base model)."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        adapters = [None] * len(prompts) if adapters is None else adapters
        # a length mismatch adds nothing
        triples = list(zip(prompts, sampling, adapters, strict=True))
        request_ids = [
            self.add_request(p, s, stopping, priority=priority, grammar=grammar, adapter=a)
            for p, s, a in triples
        ]
        requests = [self._requests[request_id] for request_id in request_ids]
        for _ in self.stream():
            pass
        return [RequestResult.of(request) for request in requests]


def _tokens_of(request: Request, count: int) -> RequestOutput:
    """The event of a request's last `count` tokens (more than one where drafts were kept)."""
    return RequestOutput(
        request.request_id,
        request.token_ids[-count:],
        request.output_logprobs[-count:],
        request.output_top_logprobs[-count:],
        request.finish_reason,
        request.finish_detail,
        _take_text(request),
    )


def _end_of(request: Request) -> RequestOutput:
    return RequestOutput(
        request.request_id,
        [],
        [],
        [],
        request.finish_reason,
        request.finish_detail,
        _take_text(request),
    )


def _take_text(request: Request) -> str:
    text, request.new_text = request.new_text, ""
    return text


def _stop_ids(stopping: StoppingParams) -> tuple[int, ...]:
    """The token ids that would end a request: masked by the sampler until `min_tokens`."""
    eos = frozenset() if stopping.ignore_eos else stopping.eos_token_ids
    return tuple(sorted(eos | stopping.stop_token_ids))
