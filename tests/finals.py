"""`final_result`: a batcher's final result for tests, naming only what the test is about."""

from __future__ import annotations

from typing import Any

from tgq.batcher.messages import FinalResult
from tgq.batcher.request import FinishReason


def final_result(
    request_id: str,
    token_ids: list[int],
    *,
    finish_reason: FinishReason = FinishReason.LENGTH,
    num_prompt_tokens: int = 2,
    batcher_id: str = "b0",
    **fields: Any,
) -> FinalResult:
    """Finished by `finish_reason` on its first attempt, nothing cached; `num_output_tokens`
    defaults to `len(token_ids)`; any other field of `FinalResult` by name."""
    fields.setdefault("num_output_tokens", len(token_ids))
    fields.setdefault("finish_detail", None)
    fields.setdefault("num_cached_tokens", 0)
    fields.setdefault("attempt", 1)
    return FinalResult(
        request_id=request_id,
        token_ids=token_ids,
        finish_reason=finish_reason,
        num_prompt_tokens=num_prompt_tokens,
        batcher_id=batcher_id,
        **fields,
    )
