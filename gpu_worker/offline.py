"""A minimal sequential driver of the runner: offline generation for examples, benchmarks and
parity tests, until the batcher's scheduler drives the runner for real.

Every unfinished sequence is scheduled every step (prompt chunks of at most `chunk_size`, then one
token at a time); blocks come from a plain free list. Full prompt blocks stay registered by their
token prefix after a sequence ends, so a later prompt with the same prefix reuses them (the last
prompt token is always computed, to get its logits).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tgq.gpu_worker.plan import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from tgq.gpu_worker.runner import ModelRunner

GREEDY = SamplingParams()


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from reused prefix blocks
    finish_reason: str | None = None


@dataclass
class _Active:
    seq_id: str
    generation: Generation
    sampling: SamplingParams
    max_new_tokens: int
    block_ids: list[int]
    num_computed: int
    is_new: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.generation.prompt_token_ids) + len(self.generation.token_ids)


class OfflineEngine:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.free_block_ids = list(range(runner.num_blocks - 1, 0, -1))  # block 0 is reserved
        self.prefix_blocks: dict[tuple[int, ...], int] = {}
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] = GREEDY,
        *,
        max_new_tokens: int = 16,
        chunk_size: int | None = None,
    ) -> list[Generation]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        active = [self._start(p, s, max_new_tokens) for p, s in zip(prompts, params, strict=True)]
        results = [a.generation for a in active]
        while active:
            plan = self._plan(active, chunk_size)
            sampled = {s.seq_id: s for s in self.runner.execute(plan).sampled}
            for seq in active:
                seq.is_new = False
                token = sampled.get(seq.seq_id)
                if token is not None:
                    seq.generation.token_ids.append(token.token_id)
                    seq.generation.logprobs.append(token.logprob or 0.0)
            active = [seq for seq in active if not self._finish_if_done(seq)]
        return results

    def _start(self, prompt: list[int], sampling: SamplingParams, max_new: int) -> _Active:
        block_size = self.runner.block_size
        cached = []
        # Reuse full blocks only strictly before the last prompt token.
        for end in range(block_size, len(prompt), block_size):
            block_id = self.prefix_blocks.get(tuple(prompt[:end]))
            if block_id is None:
                break
            cached.append(block_id)
        generation = Generation(list(prompt), num_cached_tokens=len(cached) * block_size)
        seq_id = f"seq-{next(self._ids)}"
        return _Active(seq_id, generation, sampling, max_new, cached, len(cached) * block_size)

    def _plan(self, active: list[_Active], chunk_size: int | None) -> StepPlan:
        new_sequences, chunks = [], []
        for seq in active:
            num_prompt = len(seq.generation.prompt_token_ids)
            remaining = seq.num_tokens - seq.num_computed
            num_new = min(remaining, chunk_size or remaining)
            new_block_ids = self._allocate(seq, seq.num_computed + num_new)
            if seq.is_new:
                tokens = seq.generation.prompt_token_ids
                new_sequences.append(
                    NewSequence(seq.seq_id, list(tokens), num_prompt, seq.sampling, seq.block_ids)
                )
                new_block_ids = []
            chunks.append(ScheduledChunk(seq.seq_id, seq.num_computed, num_new, new_block_ids))
            seq.num_computed += num_new
        return StepPlan(new_sequences=new_sequences, chunks=chunks)

    def _allocate(self, seq: _Active, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.runner.block_size) - len(seq.block_ids)
        if needed > len(self.free_block_ids):
            raise RuntimeError("out of KV blocks; the offline driver does not preempt")
        new_ids = [self.free_block_ids.pop() for _ in range(max(needed, 0))]
        seq.block_ids = [*seq.block_ids, *new_ids]
        return new_ids

    def _finish_if_done(self, seq: _Active) -> bool:
        generation = seq.generation
        if generation.token_ids and generation.token_ids[-1] in self.eos_token_ids:
            generation.finish_reason = "stop"
        elif len(generation.token_ids) >= seq.max_new_tokens:
            generation.finish_reason = "length"
        else:
            return False
        self._release(seq)
        return True

    def _release(self, seq: _Active) -> None:
        """Keep full prompt blocks for prefix reuse; free the rest."""
        prompt = seq.generation.prompt_token_ids
        block_size = self.runner.block_size
        kept = set(self.prefix_blocks.values())
        for index, block_id in enumerate(seq.block_ids):
            end = (index + 1) * block_size
            if end <= len(prompt):
                self.prefix_blocks.setdefault(tuple(prompt[:end]), block_id)
                kept.add(block_id)
            if block_id not in kept:
                self.free_block_ids.append(block_id)
        self.runner.execute(StepPlan(finished_seq_ids=[seq.seq_id]))
