"""`in_progress`: the batch's requests go to the transport in a bounded window, rebuilt from
their rows (as the reconciler does for jobs), until the job ends, the batch is cancelled or it
expires."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from tgq.api.db import batches as db_batches
from tgq.api.db import store
from tgq.api.submit import rebuild_request
from tgq.bulk.batches.context import BatchContext, get_batch
from tgq.bulk.batches.lease import BatchLease

POLL_S = 0.25


async def feed_window(ctx: BatchContext, batch: db_batches.BatchRecord, lease: BatchLease) -> None:
    """Feeds the window until the job ends, the batch is cancelled or it expires; then moves
    the batch to `finalizing`, recording the status that ends it."""
    while True:
        await lease.renew()
        batch = await get_batch(ctx, batch.id)
        if batch.status not in ("in_progress", "cancelling") or batch.job_id is None:
            outcome = "cancelled" if batch.status == "cancelling" else "completed"
            break
        if batch.status == "cancelling" or datetime.now(UTC) >= batch.expires_at:
            await _stop_job(ctx, batch.job_id)
            outcome = "cancelled" if batch.status == "cancelling" else "expired"
            break
        async with ctx.db.connect() as conn:
            job = await store.get_job(conn, job_id=batch.job_id)
            window = await db_batches.open_items(conn, job_id=batch.job_id, limit=ctx.window)
        assert job is not None
        completed = job.num_items_done - job.num_items_failed
        if (completed, job.num_items_failed) != (batch.num_completed, batch.num_failed):
            async with ctx.db.begin() as conn:
                await db_batches.set_counts(
                    conn, batch_id=batch.id, completed=completed, failed=job.num_items_failed
                )
        if job.is_finished or job.num_items_done >= job.num_items:
            outcome = "completed"
            break
        missing = set(await ctx.transport.missing([item.request_id for item in window]))
        if missing:
            eos = ctx.tokenizer.eos_token_ids
            requests = [
                rebuild_request(item, job, ctx.settings, eos, attempt=item.attempts + 1)
                for item in window
                if item.request_id in missing
            ]
            await ctx.transport.submit(requests)
        await asyncio.sleep(POLL_S)
    async with ctx.db.begin() as conn:
        await db_batches.set_status(
            conn, batch_id=batch.id, status="finalizing", only_from=("in_progress", "cancelling"),
            finalizing_to=outcome,
        )  # fmt: skip


async def _stop_job(ctx: BatchContext, job_id: str) -> None:
    """Cancels the job's unfinished items (the cancel route may have done it already) and aborts
    those that can be in the transport: the first `window` of them, in item order."""
    async with ctx.db.begin() as conn:
        request_ids = await store.cancel_job(conn, job_id=job_id) or []
    for request_id in request_ids[: ctx.window]:
        await ctx.transport.abort(request_id, "batch cancelled or expired")
