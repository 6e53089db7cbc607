"""What a batch's driver works with, and the batch as the database has it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import batches as db_batches
from tgq.api.files.storage import FileStorage
from tgq.api.settings import Settings
from tgq.api.tokenizer import ModelTokenizer
from tgq.batcher.transport.aio import AsyncApiTransport


@dataclass(frozen=True, slots=True)
class BatchContext:
    db: AsyncEngine
    transport: AsyncApiTransport
    storage: FileStorage
    tokenizer: ModelTokenizer
    settings: Settings
    window: int = 256  # at most this many of a batch's requests in the transport at once
    lease_s: float = 30.0  # a runner silent this long is taken for dead
    chunk_lines: int = 500  # lines validated, committed and written per round
    runner_id: str = field(default_factory=lambda: f"runner-{secrets.token_hex(6)}")


async def get_batch(ctx: BatchContext, batch_id: str) -> db_batches.BatchRecord:
    async with ctx.db.connect() as conn:
        batch = await db_batches.get_batch(conn, batch_id=batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id!r}")
    return batch
