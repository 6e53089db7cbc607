"""The draft model of speculative decoding (`--speculative-model DIR`, method `draft`): a small
model with the target's tokenizer, run by a `ModelRunner` of its own with its own paged KV cache,
over the target's block tables (the same block ids index the draft's cache, so it needs no
allocator: a block the scheduler gives a sequence holds that sequence's positions in both).

For the sequences of a step that ask for k model drafts, `propose` catches the draft's KV up to
the sequence's last token in one chunk (the whole sequence the first time, e.g. after a prefix
hit or a preemption, whose blocks the draft may never have written), takes the argmax there, then
decodes k - 1 more argmax tokens. Greedy guesses are one fixed guess each, so the target's
sample-and-compare verification stays exact (`gpu_worker.plan`). `verified` keeps the draft's
KV of the accepted tokens only; `forget` drops a sequence the target dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.plan import NewSequence, SamplingParams, ScheduledChunk, StepPlan, StepResult

GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]  # every known token of the target's sequence
    block_ids: Sequence[int]  # the target's block table, holding the step's k + 1 positions
    num_drafts: int


class DraftRunner(Protocol):
    """What the drafter uses of its `ModelRunner` (the runner module imports this one)."""

    @property
    def sequences(self) -> Mapping[str, object]: ...

    @property
    def model_config(self) -> ModelConfig: ...

    num_blocks: int

    def execute(self, plan: StepPlan) -> StepResult: ...


class Drafter:
    def __init__(self, runner: DraftRunner) -> None:
        """`runner`: a `ModelRunner` of the draft model, with the target's number of blocks
        and block size."""
        self.runner = runner
        self._num_computed: dict[str, int] = {}  # tokens whose draft KV holds, per sequence

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's `num_drafts` argmax tokens of the draft model."""
        held = list(self.runner.sequences)
        new, chunks = [], []
        for r in requests:
            num_tokens = len(r.token_ids)
            start = min(self._num_computed.get(r.request_id, 0), num_tokens - 1)
            new.append(
                NewSequence(r.request_id, list(r.token_ids), num_tokens, GREEDY, list(r.block_ids))
            )
            chunks.append(ScheduledChunk(r.request_id, start, num_tokens - start))
        result = self.runner.execute(StepPlan(new, chunks, held))
        drafts = {token.request_id: [token.token_id] for token in result.sampled}
        for step in range(1, max(r.num_drafts for r in requests)):
            chunks = [
                ScheduledChunk(r.request_id, len(r.token_ids) - 1 + step, 1)
                for r in requests
                if r.num_drafts > step
            ]
            for token in self.runner.execute(StepPlan([], chunks)).sampled:
                drafts[token.request_id].append(token.token_id)
        for r in requests:  # written: the known tokens and every draft but the last
            self._num_computed[r.request_id] = len(r.token_ids) + r.num_drafts - 1
        return drafts

    def verified(self, request_id: str, num_tokens: int) -> None:
        """The sequence now has `num_tokens` tokens: the draft KV of its accepted ones holds
        (every token but the last, as far as the draft wrote)."""
        if request_id in self._num_computed:
            self._num_computed[request_id] = min(self._num_computed[request_id], num_tokens - 1)

    def forget(self, request_id: str) -> None:
        self._num_computed.pop(request_id, None)
