"""Running one batch: its input file becomes one job of kind `batch` (one item per valid line,
each with its own parameters), fed to the transport in a bounded window, then its results become
the output and error files.

A batch is driven by one runner at a time: the runner holds the batch's lease in the database
and renews it as it goes; a second runner started for the same batch (a task delivered twice,
a reconciler that thought it lost) finds the lease taken and leaves. A runner that dies stops
renewing; when the lease has run out, the reconciler starts another, which goes on where the
database says the batch is: validation resumes after the last committed chunk of lines, the
window enqueues only items the transport does not know (items are rebuilt from their rows, as
the reconciler does for jobs), and finalizing is redone from the start (its files have ids of
the batch's own, so a redo replaces them). Nothing finished is redone.

Statuses, as OpenAI's: validating → in_progress → finalizing → completed; failed (the input
could not be read); cancelling → cancelled; expired (past `expires_at`: unfinished lines go to
the error file as `batch_expired`). Each phase has its module: `validating`, `window`
(in_progress and cancelling), `finalizing`.
"""

from __future__ import annotations

import asyncio
import logging

from tgq.bulk.batches.context import BatchContext, get_batch
from tgq.bulk.batches.finalizing import finalize
from tgq.bulk.batches.lease import BatchLease, LeaseLostError
from tgq.bulk.batches.validating import validate_lines
from tgq.bulk.batches.window import feed_window

log = logging.getLogger(__name__)


async def run_batch(ctx: BatchContext, batch_id: str) -> str:
    """Drives the batch to a terminal status and returns it; a batch another runner holds is
    left alone (its status is returned)."""
    lease = BatchLease(ctx, batch_id)
    if not await lease.take():
        batch = await get_batch(ctx, batch_id)
        if not batch.is_finished:
            log.info("batch %s: runner %s holds it", batch_id, batch.runner_id)
        return batch.status
    try:
        batch = await get_batch(ctx, batch_id)
        if batch.status == "validating":
            batch = await validate_lines(ctx, batch, lease)
        if batch.status in ("in_progress", "cancelling"):
            await feed_window(ctx, batch, lease)
        if (await get_batch(ctx, batch_id)).status == "finalizing":
            await finalize(ctx, batch_id, lease)
    except LeaseLostError:
        log.warning("batch %s: another runner took it over; %s stops", batch_id, ctx.runner_id)
    except asyncio.CancelledError:  # this process stops: the next runner need not wait
        await asyncio.shield(lease.release())
        raise
    return (await get_batch(ctx, batch_id)).status
