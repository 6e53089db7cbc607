"""`Run`: one interactive request in flight, from its start to its answer (the routes build
their answers from it), and `check_failed`, TGI's rule that any failed item fails the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tgq.api.admission import Ticket
from tgq.api.errors import GenerationError
from tgq.api.key_policy import KeyAccess
from tgq.api.validated import ValidatedRequest
from tgq.batcher.messages import FinalResult, SubmitRequest, TokenEvent
from tgq.batcher.request import FAILED_REASONS


@dataclass(slots=True)
class Run:
    """One interactive request in flight: its job and one engine request per item."""

    job_id: str
    prompts: list[ValidatedRequest]
    requests: list[SubmitRequest]
    copies: int  # items per prompt
    ticket: Ticket
    started_at: float  # time.time() when the HTTP request was admitted
    validated_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    finals: dict[str, FinalResult] = field(default_factory=dict)
    keep_events: bool = False  # keep every token event (non-stream answers with top tokens)
    events: dict[str, list[TokenEvent]] = field(default_factory=dict)
    key: KeyAccess | None = None  # the stored key it came with
    holds_lease: bool = False  # under the key's limits, by the job id, until the run ends
    num_tokens_charged: int = 0

    @property
    def num_tokens_used(self) -> int:
        """What the run cost its key: every prompt and what was generated; an unfinished run
        keeps its whole charge (prompt + max new tokens)."""
        if not self.is_finished:
            return self.num_tokens_charged
        return sum(f.num_prompt_tokens + f.num_output_tokens for f in self.finals.values())

    def prompt_of(self, item_index: int) -> ValidatedRequest:
        return self.prompts[item_index // self.copies]

    @property
    def is_finished(self) -> bool:
        return len(self.finals) == len(self.requests)


def check_failed(finals: Sequence[FinalResult]) -> None:
    """424 when any item failed in the engine (TGI: any failure fails the whole request)."""
    for final in finals:
        if final.finish_reason in FAILED_REASONS:
            raise GenerationError(final.finish_detail or final.finish_reason)
