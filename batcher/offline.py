"""Offline generation in one call, for examples, benchmarks and parity tests: `LLMEngine` (the
scheduler and KV manager that serve requests) with the per-call knobs those callers use, as
vLLM's `LLM` wraps its `LLMEngine`.

    engine = OfflineEngine(runner)
    results = engine.generate(prompts, sampling, max_new_tokens=32, chunk_size=64)

Keep one per runner: its KV manager owns the runner's blocks, and a later call's prompts hit the
prefix cache that earlier calls filled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import GREEDY, LLMEngine, RequestResult, StepRunner
from tgq.batcher.request import StoppingParams
from tgq.gpu_worker.plan import SamplingParams


class OfflineEngine:
    def __init__(self, runner: StepRunner, eos_token_ids: Iterable[int] = ()) -> None:
        """`eos_token_ids`: the ids that end a generation; none by default, so each result
        runs to `max_new_tokens` (as transformers does with `eos_token_id=None`)."""
        self.runner = runner
        self.engine = LLMEngine(
            runner,
            self._limits(None),
            eos_token_ids=frozenset(eos_token_ids),
            model=getattr(runner, "model_config", None),  # a ModelRunner's
        )

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        *,
        max_new_tokens: int = 16,
        chunk_size: int | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestResult]:
        """Run the prompts together to completion. `chunk_size`: the tokens one step computes,
        prefill chunks and decodes together (None: as many as the KV pool holds, so prompts
        are not chunked). `adapters`: each prompt's LoRA adapter (None: the base model). Raises
        ValueError for a prompt the KV pool could never hold."""
        # The scheduler reads its limits at every step and nothing runs between calls, so each
        # call sets its own; the KV manager, prefix cache included, carries over.
        self.engine.scheduler.config = self._limits(chunk_size)
        stopping = StoppingParams(max_new_tokens=max_new_tokens)
        results = self.engine.generate(prompts, sampling, stopping, adapters=adapters)
        for result in results:
            if result.finish_reason == "rejected":
                raise ValueError(f"{result.request_id}: {result.finish_detail}")
        return results

    def _limits(self, chunk_size: int | None) -> SchedulerConfig:
        num_usable_blocks = self.runner.num_blocks - 1  # block 0 is reserved
        budget = chunk_size or num_usable_blocks * self.runner.block_size
        # Every running request needs a token of the budget per step, and a block of its own.
        batch_size = min(budget, num_usable_blocks)
        return SchedulerConfig(max_batch_prefill_tokens=budget, max_batch_size=batch_size)
