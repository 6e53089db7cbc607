"""A runner's hold on one batch: taken in the database, renewed as the runner goes."""

from __future__ import annotations

import time

from tgq.api.db import batches as db_batches
from tgq.bulk.batches.context import BatchContext


class LeaseLostError(Exception):
    """Another runner took the batch over (this one was too slow to renew its lease)."""


class BatchLease:
    """This runner's hold on one batch, renewed at most every third of its length."""

    def __init__(self, ctx: BatchContext, batch_id: str) -> None:
        self.ctx, self.batch_id = ctx, batch_id
        self.renewed = -float("inf")

    async def take(self) -> bool:
        async with self.ctx.db.begin() as conn:
            taken = await db_batches.claim(
                conn, batch_id=self.batch_id, runner_id=self.ctx.runner_id,
                lease_s=self.ctx.lease_s,
            )  # fmt: skip
        if taken:
            self.renewed = time.monotonic()
        return taken

    async def release(self) -> None:
        async with self.ctx.db.begin() as conn:
            await db_batches.release(conn, batch_id=self.batch_id, runner_id=self.ctx.runner_id)

    async def renew(self) -> None:
        if time.monotonic() - self.renewed >= self.ctx.lease_s / 3 and not await self.take():
            raise LeaseLostError(self.batch_id)
