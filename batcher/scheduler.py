"""The continuous-batching scheduler: owns the waiting and running queues and the KV manager, and
turns them into one `StepPlan` per step (`schedule`), then folds the runner's answer back in
(`update`). Pure Python; see `gpu_worker.plan` for the contract with the runner.

The one rule: each step gives every running request the tokens it still needs
(`num_computed_tokens` catching up to `num_tokens`) within `max_batch_prefill_tokens` tokens, the
KV pool (`max_batch_total_tokens`) and `max_batch_size` requests — running requests first (one
token each before any gets more, so decodes never wait behind a long prefill; no more than that
for one outranked by a waiting request, so a bulk prefill never delays an interactive one), then
waiting ones by priority then arrival. Chunked prefill, prefix hits, decode and recompute after
preemption are all this rule. When blocks run out, the lowest-priority newest running request is
preempted (its blocks freed, recomputed later); a waiting request may only preempt lower-priority
ones. A request that could never fit the pool is rejected when added, so the oldest
highest-priority request always progresses: no crash, no deadlock.

Speculation (`batcher.speculation`): a decoding request may also carry draft tokens, from the
budget left after every running request's share and only while the step stays within
`speculative_max_batch_tokens` tokens and while drafts pay for what they cost here
(`Speculation.draft_room`); drafts never preempt anything (no blocks, no drafts). After
the runner has verified them, the request keeps the KV of its accepted tokens only
(`KVManager.trim`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.kv_manager import KVManager, expect_integrity
from tgq.batcher.prefix_hashes import adapter_salt
from tgq.batcher.request import Priority, Request, RequestStatus
from tgq.batcher.scheduler_output import SchedulerOutput, StepBuilder
from tgq.batcher.speculation import Speculation
from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.plan import NewSequence, SampledToken, ScheduledChunk, StepResult


@dataclass
class StepStats:
    """Steps that computed tokens, since the scheduler started, and their tokens."""

    num_steps: int = 0
    num_tokens: int = 0
    max_tokens: int = 0  # the largest step: at most `max_batch_prefill_tokens`

    def record(self, num_tokens: int) -> None:
        if num_tokens:
            self.num_steps += 1
            self.num_tokens += num_tokens
            self.max_tokens = max(self.max_tokens, num_tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        model: ModelConfig | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        """`model`: the model's config, where its rope makes a token's KV depend on its
        sequence's length (`ModelConfig.prefix_cache_salt`); None: it never does.
        `speculation`: draft tokens for decoding requests (None: none)."""
        self.config = config
        self.model = model
        self.speculation = speculation
        if config.max_batch_total_tokens is not None:
            num_blocks = min(num_blocks, 1 + config.max_batch_total_tokens // block_size)
        self.kv = KVManager(num_blocks, block_size, enable_prefix_cache=config.enable_prefix_cache)
        self.max_batch_total_tokens = config.max_batch_total_tokens or (
            self.kv.num_usable_blocks * block_size
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # by Request.sort_key
        self.running: list[Request] = []  # by Request.sort_key: preemption victims at the end
        self.num_preemptions = 0
        self.step_stats = StepStats()
        self._runner_request_ids: set[str] = set()  # sequences the runner holds state for
        self._dropped_request_ids: list[str] = []  # to drop from the runner in the next plan
        self._arrival_orders = itertools.count()
        self._num_steps_since_admission = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self._dropped_request_ids)

    def add_request(self, request: Request) -> None:
        """Queue it, or reject it (status FINISHED_REJECTED, reason in `finish_detail`)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        request.arrival_order = next(self._arrival_orders)
        reason = self._never_fits(request)
        if reason is not None:
            request.transition(RequestStatus.FINISHED_REJECTED, reason)
            return
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_sort_key)

    def _never_fits(self, request: Request) -> str | None:
        num_tokens = request.num_prompt_tokens + request.stopping.max_new_tokens
        if num_tokens > self.max_batch_total_tokens:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) + max_new_tokens"
                f" ({request.stopping.max_new_tokens}) = {num_tokens} exceeds"
                f" max_batch_total_tokens ({self.max_batch_total_tokens})"
            )
        num_blocks = self.kv.num_blocks_for(request.max_num_kv_tokens)
        if num_blocks > self.kv.num_usable_blocks:
            return (
                f"needs {num_blocks} KV blocks of {self.kv.block_size} tokens, the pool has"
                f" {self.kv.num_usable_blocks}"
            )
        return None

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED, "aborted")

    def finish(
        self, request_id: str, status: RequestStatus, detail: str | None = None
    ) -> Request | None:
        """End an unfinished request now (abort, a matched stop string); its blocks are free at
        once and the runner drops it in the next plan. None if it is unknown or finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status, detail)
        return request

    def _finish(self, request: Request, status: RequestStatus, detail: str | None = None) -> None:
        queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        self._release(request)
        request.transition(status, detail)
        del self.requests[request.request_id]
        if self.speculation is not None:
            self.speculation.finish(
                request.request_id, request.token_ids, request.num_prompt_tokens
            )

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.block_ids = []
        if request.request_id in self._runner_request_ids:
            self._runner_request_ids.remove(request.request_id)
            self._dropped_request_ids.append(request.request_id)

    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self.config.max_batch_prefill_tokens)
        self._schedule_running(step)
        if self.waiting and self._may_admit(step):
            self._schedule_waiting(step)
        has_admitted = bool(step.new_sequences)  # only admission sends a request in full
        self.step_stats.record(sum(chunk.num_new_tokens for chunk in step.chunks.values()))
        self._num_steps_since_admission = 0 if has_admitted else self._num_steps_since_admission + 1
        if not self.requests:
            self.check_integrity()
        self._runner_request_ids.update(step.new_sequences)
        dropped, self._dropped_request_ids = self._dropped_request_ids, []
        return SchedulerOutput(
            list(step.new_sequences.values()),
            list(step.chunks.values()),
            dropped,
            step.preempted_request_ids,
        )

    def check_integrity(self) -> None:
        """The KV manager's accounting, and each request's block table agreeing with it."""
        self.kv.check_integrity()
        for request in self.running:
            is_consistent = request.block_ids == self.kv.block_ids(request.request_id)
            expect_integrity(is_consistent, f"{request.request_id!r}: block table differs")
            is_behind = request.num_computed_tokens < request.num_tokens
            expect_integrity(is_behind, f"{request.request_id!r}: computed past its tokens")
            is_tight = len(request.block_ids) == self.kv.num_blocks_for(request.num_computed_tokens)
            expect_integrity(is_tight, f"{request.request_id!r}: holds blocks past its KV")
        for request in self.waiting:
            is_empty = not self.kv.block_ids(request.request_id) and not request.num_computed_tokens
            expect_integrity(is_empty, f"waiting {request.request_id!r} holds KV")
        expect_integrity(len(self.running) <= self.config.max_batch_size, "batch too large")

    def _kv_salt(self, request: Request) -> bytes:
        """The prefix-cache salt of the KV the request would compute now: its rope's, and its
        LoRA adapter's (one prompt's KV differs from adapter to adapter)."""
        salt = b""
        if self.model is not None:
            salt = self.model.prefix_cache_salt(request.num_prompt_tokens, request.num_tokens)
        return adapter_salt(request.adapter, salt)

    def _schedule_running(self, step: StepBuilder) -> None:
        for request in list(self.running):
            if request.num_computed_tokens and self._kv_salt(request) != request.kv_salt:
                # Its rope changed with its length (longrope past the original context): the KV
                # it holds is computed again, every token, as the reference does.
                self._preempt(request, step, restart=True)
        shares = self._shares(step.token_budget)
        num_shared = sum(shares.values())
        draft_room = 0
        if self.speculation is not None:
            draft_room = self.speculation.draft_room(num_shared, step.token_budget - num_shared)
        for request in list(self.running):
            num_new = shares[request.request_id]
            if request.status != RequestStatus.RUNNING or num_new == 0:
                continue  # preempted earlier in this loop
            drafts = self._drafts(request, draft_room) if draft_room > 0 and num_new == 1 else []
            end = request.num_computed_tokens + num_new
            new_block_ids = None
            if drafts:  # never preempting for them: without blocks to spare, no drafts
                new_block_ids = self.kv.grow_blocks(request.request_id, end + len(drafts))
            if new_block_ids is None:
                drafts = []
                new_block_ids = self._allocate(request, end, step, lambda _: True)
            draft_room -= len(drafts)
            if new_block_ids is not None:
                request.block_ids.extend(new_block_ids)
                model = self.speculation is not None and self.speculation.uses_draft_model
                step.add(
                    ScheduledChunk(
                        request.request_id,
                        request.num_computed_tokens,
                        num_new + len(drafts),
                        new_block_ids,
                        [] if model else drafts,
                        len(drafts) if model else 0,
                    )
                )

    def _drafts(self, request: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request (placeholders where the runner's draft model
        guesses them), none past its last token (`max_new_tokens`: the token after the drafts
        is sampled too). Under a grammar, only the drafts it allows in a row (none from a
        draft model, whose guesses the batcher never sees)."""
        speculation = self.speculation
        assert speculation is not None
        if not request.speculate or request.num_computed_tokens != request.num_tokens - 1:
            return []
        if request.grammar is not None and speculation.uses_draft_model:
            return []
        remaining = request.stopping.max_new_tokens - request.num_output_tokens - 1
        drafts = speculation.propose(
            request.request_id, request.token_ids, request.num_prompt_tokens, min(room, remaining)
        )
        if request.grammar is not None:
            del drafts[request.grammar.num_draftable(drafts) :]
        return drafts

    def _shares(self, token_budget: int) -> dict[str, int]:
        """One token for each running request first, then the rest of the budget in queue order
        to those that no waiting request outranks."""
        needs = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        shares: dict[str, int] = {}
        for request_id, need in needs.items():
            shares[request_id] = min(need, 1, token_budget)
            token_budget -= shares[request_id]
        min_priority = self.waiting[0].priority if self.waiting else min(Priority)
        for request in self.running:
            if request.priority < min_priority:
                break  # the rest of the queue is outranked too
            request_id, need = request.request_id, needs[request.request_id]
            extra = min(need - shares[request_id], token_budget)
            shares[request_id] += extra
            token_budget -= extra
        return shares

    def _may_admit(self, step: StepBuilder) -> bool:
        """TGI's gate: don't start new requests one by one into a running batch unless enough
        of them can join, they have waited `max_waiting_tokens` steps, or one outranks the
        lowest running priority."""
        if not self.running or self._num_steps_since_admission >= self.config.max_waiting_tokens:
            return True
        if self.waiting[0].priority > self.running[-1].priority:
            return True
        min_count = int(self.config.waiting_served_ratio * len(self.running))
        return self._num_admissible(step) >= min_count

    def _num_admissible(self, step: StepBuilder) -> int:
        """How many waiting requests could start now (first chunks, prefix hits ignored)."""
        num_slots = self.config.max_batch_size - len(self.running)
        token_budget, num_free_blocks = step.token_budget, self.kv.num_free_blocks
        count = 0
        for request in self.waiting[:num_slots]:
            num_new = min(request.num_tokens, token_budget)
            num_blocks = self.kv.num_blocks_for(num_new)
            if num_new == 0 or num_blocks > num_free_blocks:
                break
            count += 1
            token_budget -= num_new
            num_free_blocks -= num_blocks
        return count

    def _schedule_waiting(self, step: StepBuilder) -> None:
        for request in list(self.waiting):
            if step.token_budget == 0:
                break
            if request.request_id in step.preempted_request_ids:
                continue  # just preempted for a higher priority: not back in the same step
            if not self._admit(request, step):
                break  # head-of-line: a later request must not overtake it

    def _admit(self, request: Request, step: StepBuilder) -> bool:
        def outranks(victim: Request) -> bool:
            return victim.priority < request.priority

        if len(self.running) >= self.config.max_batch_size:
            if not outranks(self.running[-1]):
                return False
            self._preempt(self.running[-1], step)
        salt = self._kv_salt(request)
        # A request for its prompt's logprobs computes every prompt token: no prefix hits.
        wants_prompt = request.sampling.prompt_logprobs is not None
        cached_block_ids = (
            [] if wants_prompt else self.kv.find_cached_prefix(request.token_ids, salt)
        )
        num_cached = len(cached_block_ids) * self.kv.block_size
        num_new = min(request.num_tokens - num_cached, step.token_budget)
        block_ids = self._allocate(request, num_cached + num_new, step, outranks, cached_block_ids)
        if block_ids is None:
            return False
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        request.block_ids = block_ids
        request.kv_salt = salt
        request.transition(RequestStatus.RUNNING)
        self.waiting.remove(request)
        bisect.insort(self.running, request, key=_sort_key)
        step.new_sequences[request.request_id] = NewSequence(
            request.request_id,
            list(request.token_ids),
            request.num_prompt_tokens,
            request.sampling,
            list(block_ids),
            request.adapter,
        )
        step.add(ScheduledChunk(request.request_id, num_cached, num_new))
        return True

    def _allocate(
        self,
        request: Request,
        num_tokens: int,
        step: StepBuilder,
        can_preempt: Callable[[Request], bool],
        cached_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Blocks for the request's first `num_tokens` tokens, preempting running requests from
        the end of the queue while `can_preempt` allows. None if it got none (or was itself the
        one preempted)."""
        while True:
            new_block_ids = self.kv.grow_blocks(request.request_id, num_tokens, cached_block_ids)
            if new_block_ids is not None:
                return new_block_ids
            if not self.running or not can_preempt(self.running[-1]):
                return None
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: StepBuilder, *, restart: bool = False) -> None:
        """Free the request's KV and queue it to be computed again; `restart`: not for lack of
        blocks (not counted as a preemption)."""
        self.running.remove(request)
        step.remove(request.request_id)
        self._release(request)
        request.num_computed_tokens = 0
        request.transition(RequestStatus.PREEMPTED)
        bisect.insort(self.waiting, request, key=_sort_key)
        step.preempted_request_ids.append(request.request_id)
        if not restart:
            request.num_preemptions += 1
            self.num_preemptions += 1

    def update(self, output: SchedulerOutput, result: StepResult) -> list[tuple[Request, int]]:
        """Append sampled tokens and apply token-level stopping (each token in turn: a token
        after a stop is dropped), advance computed tokens. Returns the requests that got tokens,
        with how many, in the runner's order (finished ones included)."""
        sampled: dict[str, list[SampledToken]] = {}
        for token in result.sampled:
            sampled.setdefault(token.request_id, []).append(token)
        updated, stops = self._append(sampled)
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished from outside since the plan was made
            if chunk.num_drafts:
                self._verified(request, chunk, len(sampled.get(chunk.request_id, ())))
            else:
                request.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens, request.kv_salt
            )
        for part in result.prompt_logprobs:
            if (request := self.requests.get(part.request_id)) is not None:
                request.record_prompt_logprobs(part)
        for request, (status, detail) in stops:
            self._finish(request, status, detail)
        return updated

    def _append(
        self, sampled: dict[str, list[SampledToken]]
    ) -> tuple[list[tuple[Request, int]], list[tuple[Request, tuple[RequestStatus, str | None]]]]:
        """Append each running request's tokens up to its first stop; returns the requests with
        how many tokens each got, and the stops to apply once the step is accounted."""
        updated: list[tuple[Request, int]] = []
        stops = []
        for request_id, tokens in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_appended = 0
            for token in tokens:
                request.append_token(token.token_id, token.logprob, token.top_logprobs)
                num_appended += 1
                if (stop := request.stop_status()) is not None:
                    stops.append((request, stop))
                    break
            updated.append((request, num_appended))
        return updated, stops

    def _verified(self, request: Request, chunk: ScheduledChunk, num_sampled: int) -> None:
        """After a chunk with drafts: the KV of the last known token and of each accepted draft
        holds, the rest of its blocks are given back."""
        num_drafts = chunk.num_drafts
        if self.speculation is not None and num_sampled > 0:
            self.speculation.record(request.request_id, num_drafts, num_sampled - 1)
        request.num_computed_tokens = request.num_tokens - 1
        request.block_ids = self.kv.trim(request.request_id, request.num_computed_tokens)


def _sort_key(request: Request) -> tuple[int, float, int]:
    return request.sort_key
