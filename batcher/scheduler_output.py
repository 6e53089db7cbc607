"""What one `Scheduler.schedule` call decides, and the builder it uses meanwhile."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgq.gpu_worker.plan import NewSequence, ScheduledChunk, StepPlan


@dataclass
class SchedulerOutput:
    new_sequences: list[NewSequence] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops these first
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.new_sequences or self.chunks or self.finished_request_ids)

    def to_plan(self) -> StepPlan:
        return StepPlan(self.new_sequences, self.chunks, self.finished_request_ids)


@dataclass
class StepBuilder:
    """The step being built; a request preempted later in the same step is taken out again."""

    token_budget: int
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    new_sequences: dict[str, NewSequence] = field(default_factory=dict)
    preempted_request_ids: list[str] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request_id] = chunk
        self.token_budget -= chunk.num_new_tokens

    def remove(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.token_budget += chunk.num_new_tokens
        self.new_sequences.pop(request_id, None)
