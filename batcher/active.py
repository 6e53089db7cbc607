"""`ActiveRequest`: a request the batcher has pulled and the engine runs, with what it has
produced so far: the token events it numbered (`seq_index`) and the tokens, logprobs and text its
final result carries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tgq.batcher.engine import RequestOutput
from tgq.batcher.messages import FinalResult, TokenEvent
from tgq.batcher.request import FinishReason, Request
from tgq.batcher.transport.base import Delivery


@dataclass(slots=True)
class ActiveRequest:
    """A pulled request the engine runs; `request` is None when the engine rejected it."""

    delivery: Delivery
    request: Request | None
    num_events: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    text: str = ""
    deadline_passed: bool = False
    duplicates: list[Delivery] = field(default_factory=list)  # other entries of this request

    def add_output(self, output: RequestOutput) -> TokenEvent | None:
        """Takes one step's output; the token event to publish, None when it has nothing new."""
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        self.text += output.new_text
        if not output.new_token_ids and not output.new_text:
            return None
        event = TokenEvent(
            request_id=output.request_id,
            seq_index=self.num_events,
            token_ids=output.new_token_ids,
            logprobs=output.new_logprobs,
            text=output.new_text,
            attempt=self.delivery.request.attempt,
            created_at=time.time(),
            top_logprobs=[
                [(t.token_id, t.logprob) for t in top] for top in output.new_top_logprobs
            ],
        )
        self.num_events += 1
        return event

    def final_result(
        self, reason: FinishReason, detail: str | None, batcher_id: str
    ) -> FinalResult:
        submit, request = self.delivery.request, self.request
        text = request.output_text if request is not None else None
        wants_logprobs = self.delivery.request.sampling.wants_logprobs
        return FinalResult(
            request_id=submit.request_id,
            token_ids=self.token_ids,
            finish_reason=reason,
            finish_detail=detail,
            num_prompt_tokens=len(submit.prompt_token_ids),
            num_output_tokens=len(self.token_ids),
            num_cached_tokens=request.num_cached_tokens if request is not None else 0,
            attempt=submit.attempt,
            batcher_id=batcher_id,
            text=self.text if text is not None else None,
            matched_stop=text.matched_stop if text is not None else None,
            logprobs=self.logprobs if wants_logprobs else [],
            prompt_logprobs=list(request.prompt_logprobs) if request is not None else [],
            prompt_top_logprobs=[
                [(t.token_id, t.logprob) for t in tops] for tops in request.prompt_top_logprobs
            ]
            if request is not None
            else [],
            prompt_ranks=list(request.prompt_ranks) if request is not None else [],
        )
