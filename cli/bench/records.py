"""One request's outcome in `tgq bench`: the stream events a backend reads, and the timer that
turns them, stamped with `time.perf_counter()`, into the request's record.

The metric definitions follow vLLM's `benchmark_serving` (docs/bench.md spells them out):
TTFT = sent -> first content chunk; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps
between successive content chunks; E2E = sent -> last byte of the response.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

ERROR_TEXT_CHARS = 300


@dataclass(frozen=True)
class StreamEvent:
    """One server-sent event as a backend reads it; only what the metrics need."""

    is_token: bool = False  # carries output (a content chunk): counts for TTFT and ITL
    num_output_tokens: int | None = None  # the server's count (OpenAI usage, TGI details)
    num_prompt_tokens: int | None = None
    is_final: bool = False  # the stream's proper end (`[DONE]`, TGI's `generated_text`)
    error: str | None = None  # an error the server sent inside the stream


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds; `sent_s` counts from the run's start."""

    index: int
    sent_s: float
    prompt_tokens: int
    output_tokens: int = 0
    output_tokens_from: str = "chunks"  # or "server": its usage / details count
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    status: int | None = None  # HTTP status, None when no response came
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Undefined for a single output token (there is no decode time to share)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def content_times_s(self) -> list[float]:
        """When each content chunk arrived, from the run's start."""
        if self.ttft_s is None:
            return []
        return [self.sent_s + t for t in np.cumsum([self.ttft_s, *self.itl_s]).tolist()]

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


class RequestTimer:
    """Turns one request's stream events, stamped with `time.perf_counter()`, into its record."""

    def __init__(self, index: int, sent_at: float, run_started_at: float, prompt_tokens: int):
        self.sent_at = sent_at
        self.record = RequestRecord(index, sent_at - run_started_at, prompt_tokens)
        self._last_at: float | None = None
        self._num_chunks = 0
        self._is_final = False

    def add(self, at: float, event: StreamEvent) -> None:
        record = self.record
        if event.is_token:
            if self._last_at is None:
                record.ttft_s = at - self.sent_at
            else:
                record.itl_s.append(at - self._last_at)
            self._last_at = at
            self._num_chunks += 1
        if event.num_output_tokens is not None:
            record.output_tokens_from = "server"
            record.output_tokens = event.num_output_tokens
        if event.num_prompt_tokens is not None:
            record.prompt_tokens = event.num_prompt_tokens
        record.error = record.error or event.error
        self._is_final = self._is_final or event.is_final

    def finish(self, at: float, status: int | None, error: str | None = None) -> RequestRecord:
        """The record once the response ended (`status` None: no response), or failed with
        `error` (the client's, or a refusal's body)."""
        record = self.record
        record.status, record.e2e_s = status, at - self.sent_at
        if record.output_tokens_from == "chunks":
            record.output_tokens = self._num_chunks
        if error is not None:
            record.error = error[:ERROR_TEXT_CHARS] or f"HTTP {status}"
        elif not (self._is_final or record.error):
            record.error = "the stream ended before its final event"
        return record
