"""Scheduler limits, with TGI's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # KV tokens the whole batch may hold; None: every block of the runner's pool.
    max_batch_total_tokens: int | None = None
    # Tokens computed per step (prefill chunks plus decodes); long prompts are chunked to fit.
    max_batch_prefill_tokens: int = 4096
    max_batch_size: int = 256
    # Admission gate (TGI): while requests are running, new ones join only when at least
    # floor(waiting_served_ratio * num_running) of them can, or after `max_waiting_tokens`
    # steps without admission, or when the queue's head outranks the lowest running priority.
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    enable_prefix_cache: bool = True
    # Speculative decoding (TGI's --speculate N): up to N draft tokens per decoding request and
    # step, from `speculative_method` (`batcher.speculation`); 0: off. Drafts are added where
    # they pay on this machine at this load (measured: `DraftChoice`), never past
    # `speculative_max_batch_tokens` tokens a step.
    speculate: int = 0
    speculative_method: str = "ngram"
    speculative_max_batch_tokens: int = 128

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_batch_prefill_tokens < self.max_batch_size:
            raise ValueError("max_batch_prefill_tokens must be >= max_batch_size (one decode each)")
        if self.max_batch_total_tokens is not None and self.max_batch_total_tokens < 1:
            raise ValueError("max_batch_total_tokens must be >= 1")
        if self.waiting_served_ratio < 0 or self.max_waiting_tokens < 0:
            raise ValueError("waiting_served_ratio and max_waiting_tokens must be >= 0")
        if self.speculate < 0 or self.speculative_max_batch_tokens < 1:
            raise ValueError("speculate must be >= 0 and speculative_max_batch_tokens >= 1")
