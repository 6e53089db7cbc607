"""Start-up warm-up: one decode step of each batch size before the first request.

On the CPU kernels a decode-only step runs as a recorded op program, one per number of rows
(`tgq.kernels.replay`); the first step of each size records it, at ~3x a step's time (25 ms
against 8-12 ms for the medium model on an Intel Xeon). A fresh batcher's first burst of
requests went through every size from its largest batch down to one as they finished, and paid
each recording then: ~1 s of a 64-request mixed burst of ~17 s. `warm_up_decode` runs them at
start-up instead, before the batcher takes work.
"""

from __future__ import annotations

import logging
import time

from tgq.batcher.engine import StepRunner
from tgq.gpu_worker.plan import NewSequence, SamplingParams, ScheduledChunk, StepPlan

log = logging.getLogger(__name__)

# Every warm-up row writes its one token here: block 0 is reserved (a runner has block 1 at
# least), and a free block's contents are written by its next owner before anything reads them.
WARM_UP_BLOCK = 1


def warm_up_decode(runner: StepRunner, max_rows: int) -> float:
    """Runs a step of 1, 2, ..., `max_rows` single-token rows (each a new one-token sequence in
    `WARM_UP_BLOCK`), dropping each size's sequences in the next step's plan, and the last ones
    after; seconds taken. Nothing of it stays in the runner."""
    if max_rows <= 0:
        return 0.0
    start = time.perf_counter()
    finished: list[str] = []
    for rows in range(1, max_rows + 1):
        ids = [f"warm-up-{rows}-{i}" for i in range(rows)]
        runner.execute(
            StepPlan(
                new_sequences=[
                    NewSequence(i, [0], 1, SamplingParams(), [WARM_UP_BLOCK]) for i in ids
                ],
                chunks=[ScheduledChunk(i, 0, 1) for i in ids],
                finished_request_ids=finished,
            )
        )
        finished = ids
    runner.execute(StepPlan(finished_request_ids=finished))
    seconds = time.perf_counter() - start
    log.info("warm-up: decode steps of 1-%d rows in %.2f s", max_rows, seconds)
    return seconds
