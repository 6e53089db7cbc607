"""A plain-Python stand-in for the model runner, strict about the step-plan contract.

Its "model" is deterministic: the next token is a hash of every token so far, so an output
depends on its own sequence only. Its "KV cache" stores, per slot, the hash of the token prefix
that ends there; every chunk checks that each slot it would attend to holds its own sequence's
prefix, which catches a block served from the wrong prefix or handed to two sequences at once.
Draft tokens are verified as the real runner does (`plan.accepted_length`): their slots are
written, the rejected ones' blocks given back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tgq.gpu_worker.plan import SampledToken, StepPlan, StepResult, accepted_length

VOCAB_SIZE = 50


@dataclass
class _Sequence:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int = 0
    prefix_hashes: list[int] = field(default_factory=list)  # [i]: hash of token_ids[: i + 1]

    def prefix_hash(self, position: int) -> int:
        while len(self.prefix_hashes) <= position:
            parent = self.prefix_hashes[-1] if self.prefix_hashes else 0
            self.prefix_hashes.append(hash((parent, self.token_ids[len(self.prefix_hashes)])))
        return self.prefix_hashes[position]


def next_token(prefix_hash: int) -> int:
    return prefix_hash % VOCAB_SIZE


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sequences: dict[str, _Sequence] = {}
        self.slots: dict[int, int] = {}  # slot -> prefix hash of the token whose KV is there
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for request_id in plan.finished_request_ids:
            del self.sequences[request_id]  # dropping an unknown sequence is a scheduler bug here
        for new in plan.new_sequences:
            assert new.request_id not in self.sequences
            self.sequences[new.request_id] = _Sequence(list(new.token_ids), list(new.block_ids))
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        sampled = []
        for chunk in plan.chunks:
            seq = self.sequences[chunk.request_id]
            seq.block_ids.extend(chunk.new_block_ids)
            assert all(0 < b < self.num_blocks for b in seq.block_ids)
            drafts = chunk.draft_token_ids
            num_known = len(seq.token_ids)
            if drafts:
                assert chunk.num_computed_tokens == num_known - 1
                assert chunk.num_new_tokens == len(drafts) + 1
            seq.token_ids += drafts
            end = chunk.num_computed_tokens + chunk.num_new_tokens
            assert chunk.num_new_tokens >= 1 and end <= len(seq.token_ids)
            assert len(seq.block_ids) * self.block_size >= end
            assert chunk.num_computed_tokens <= len(seq.token_ids) - 1
            for position in range(chunk.num_computed_tokens, end):
                self.slots[self._slot(seq, position)] = seq.prefix_hash(position)
            for position in range(end):
                assert self.slots.get(self._slot(seq, position)) == seq.prefix_hash(position)
            if end == len(seq.token_ids):
                rows = [next_token(seq.prefix_hash(p)) for p in range(num_known - 1, end)]
                del seq.token_ids[num_known:], seq.prefix_hashes[num_known:]
                kept = rows[: accepted_length(drafts, rows) + 1]
                seq.token_ids += kept
                sampled += [SampledToken(chunk.request_id, t, -0.5) for t in kept]
                if drafts:
                    del seq.block_ids[-(-(len(seq.token_ids) - 1) // self.block_size) :]
        return StepResult(sampled)

    def _slot(self, seq: _Sequence, position: int) -> int:
        return seq.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )


def solo_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the fake model generates for `prompt` alone (no stopping but the length)."""
    seq = _Sequence(list(prompt), [])
    for _ in range(max_new_tokens):
        seq.token_ids.append(next_token(seq.prefix_hash(len(seq.token_ids) - 1)))
    return seq.token_ids[len(prompt) :]
