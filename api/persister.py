"""Final results into the database, and items marked running.

- `Persister`: pulls durable final results from the transport, records them idempotently (unique
  per job item), and acks them only after the commit.
- `Running`: items whose first token the transport has seen are marked `running`, in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from functools import partial

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import in_transaction, store
from tgq.api.ids import parse_request_id
from tgq.api.loops import BackgroundLoop
from tgq.batcher.messages import FinalResult
from tgq.batcher.transport.aio import AsyncApiTransport
from tgq.batcher.transport.base import StoredFinal

log = logging.getLogger(__name__)


STOP_GRACE_S = 10.0  # the persister's last round at shut-down, before it is cancelled


class Persister(BackgroundLoop):
    """Writes every final result to the database, then acks it in the transport."""

    def __init__(
        self,
        db: AsyncEngine,
        transport: AsyncApiTransport,
        consumer: str,
        *,
        max_count: int = 256,
        block_ms: int = 1000,
        on_results: Callable[[list[StoredFinal]], None] = lambda finals: None,
    ) -> None:
        self.db = db
        self.on_results = on_results
        self.transport = transport
        self.consumer = consumer
        self.max_count = max_count
        self.block_ms = block_ms
        self.num_written = 0
        self._is_stopping = False
        # Pulled but not yet written and acked (the database was away): retried before anything
        # new. They stay pending to this consumer, so without this they would wait for the
        # lease (`lease_s`) to lapse before being claimed again.
        self._unwritten: list[StoredFinal] = []

    async def _run(self) -> None:
        backoff_s = 0.1
        while not self._is_stopping:
            try:
                await self.persist_once()
                backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as error:  # database or Redis down: retry; nothing was acked
                log.warning("persister: %s; retrying in %.1fs", error, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)

    async def stop(self) -> None:
        """Lets the round in progress finish, then persists what is already stored without
        waiting for more: a replica that shuts down cleanly leaves no finished job `running`
        until another replica claims its results after the lease."""
        self._is_stopping = True
        if self._task is not None:  # a round cut short would leave its results pending to us
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), STOP_GRACE_S)
        await super().stop()
        try:
            while await self.persist_once(block_ms=0):
                pass
        except Exception as error:  # database or Redis away: the results wait for the next one
            log.warning("persister: results left for another replica: %s", error)

    async def persist_once(self, *, block_ms: int | None = None) -> int:
        wait_ms = self.block_ms if block_ms is None else block_ms
        finals = self._unwritten or await self.transport.pull_finals(
            self.consumer, self.max_count, wait_ms
        )
        if not finals:
            return 0
        self._unwritten = finals
        results = []
        for stored in finals:
            new = new_result(stored.result)
            if new is None:
                log.warning(
                    "final result for unknown request id %r dropped", stored.result.request_id
                )
            else:
                results.append(new)
        try:
            written = await in_transaction(self.db, partial(store.record_results, results=results))
        except Exception:  # a result the database refuses, or the database away: one by one
            written = [await self._record_alone(result) for result in results]
        await self.transport.ack_finals([stored.entry_id for stored in finals])
        self._unwritten = []
        self.num_written += sum(written)
        self.on_results(finals)
        return len(finals)

    async def _record_alone(self, result: store.NewResult) -> bool:
        """One result in its own transaction. One the database refuses while it takes
        others (a value it cannot store) is recorded as a failed result that keeps only its
        ids, so its job still ends; when the database itself is away, the error propagates
        (nothing is acked)."""
        try:
            async with self.db.begin() as conn:
                return (await store.record_results(conn, results=[result]))[0]
        except Exception as error:
            if not await self._database_is_up():
                raise
            log.error("persister: result %s refused (%r); failing it", result.request_id, error)
            refused = type(error).__name__
        stand_in = dataclasses.replace(
            result, text=None, token_ids=[], logprobs=None, finish_reason="failed",
            finish_detail=f"the database refused this result ({refused})",
            num_prompt_tokens=0, num_output_tokens=0, num_cached_tokens=0,
        )  # fmt: skip
        async with self.db.begin() as conn:
            return (await store.record_results(conn, results=[stand_in]))[0]

    async def _database_is_up(self) -> bool:
        try:
            async with self.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:
            return False
        return True


def new_result(result: FinalResult) -> store.NewResult | None:
    where = parse_request_id(result.request_id)
    if where is None:
        return None
    job_id, item_index = where
    return store.NewResult(
        job_id=job_id,
        item_index=item_index,
        request_id=result.request_id,
        text=result.text,
        token_ids=result.token_ids,
        logprobs=result.logprobs or None,
        finish_reason=result.finish_reason,
        finish_detail=result.finish_detail,
        num_prompt_tokens=result.num_prompt_tokens,
        num_output_tokens=result.num_output_tokens,
        num_cached_tokens=result.num_cached_tokens,
        attempt=result.attempt,
        batcher_id=result.batcher_id,
    )


class Running(BackgroundLoop):
    """Marks items `running` (with their job's `started_at`) as batchers start them: reads the
    transport's started log and updates in batches. Best effort: a status, not a result."""

    def __init__(
        self, db: AsyncEngine, transport: AsyncApiTransport, *, max_count: int = 1000
    ) -> None:
        self.db = db
        self.transport = transport
        self.max_count = max_count

    async def _run(self) -> None:
        cursor: str | None = None
        while True:
            try:
                cursor, request_ids = await self.transport.read_started(
                    cursor, self.max_count, 1000
                )
                if request_ids:
                    ids = sorted(set(request_ids))
                    await in_transaction(self.db, partial(store.mark_running, request_ids=ids))
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("marking items running failed: %s", error)
                await asyncio.sleep(1.0)
