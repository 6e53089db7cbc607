"""What `/health` answers from: `Health` (the monitor's view of Redis and the batchers, and the
engine's last outcome) and its database check, `DatabaseProbe`: `SELECT 1` under a short timeout,
its answer cached for a second, so that `/health` stays cheap however often a load balancer asks
(one probe per second at most; concurrent asks wait for the same probe)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.batcher.messages import FinalResult
from tgq.batcher.request import FinishReason

PROBE_TIMEOUT_S = 1.0  # a database slower than this to answer `SELECT 1` counts as unreachable
PROBE_TTL_S = 1.0


class DatabaseProbe:
    def __init__(
        self, db: AsyncEngine, *, timeout_s: float = PROBE_TIMEOUT_S, ttl_s: float = PROBE_TTL_S
    ) -> None:
        self.db = db
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._problem: str | None = None
        self._expires_at = 0.0  # monotonic
        self._lock = asyncio.Lock()

    async def problem(self) -> str | None:
        """None when the database answered within the timeout, else what went wrong."""
        async with self._lock:
            if time.monotonic() >= self._expires_at:
                self._problem = await self._probe()
                self._expires_at = time.monotonic() + self.ttl_s
            return self._problem

    async def _probe(self) -> str | None:
        try:
            async with asyncio.timeout(self.timeout_s), self.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except TimeoutError:
            return f"the database is unreachable: no answer within {self.timeout_s:g} s"
        except Exception as error:  # whatever the driver raises: the database cannot serve
            first_line = next(iter(str(error).splitlines()), "")
            return f"the database is unreachable: {type(error).__name__}: {first_line}"
        return None


@dataclass(slots=True)
class Health:
    """What `/health` answers from: the database (probed), Redis and live batchers (the
    monitor's last round), and the engine's last outcome."""

    num_batchers: int = 0
    engine_failure: str | None = None  # set by a failed result, cleared by a successful one
    transport_failure: str | None = None  # set by a failed monitor round, cleared by the next
    database: DatabaseProbe | None = None

    def observe(self, result: FinalResult) -> None:
        if result.finish_reason == FinishReason.FAILED:
            self.engine_failure = result.finish_detail or "failed"
        elif result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.engine_failure = None

    async def check(self) -> str | None:
        """The first problem found, database first; None when healthy."""
        database = None if self.database is None else await self.database.problem()
        return database or self.problem

    @property
    def problem(self) -> str | None:
        if self.transport_failure is not None:
            return self.transport_failure
        if self.num_batchers == 0:
            return "no batcher is alive"
        if self.engine_failure is not None:
            return f"the engine is failing: {self.engine_failure}"
        return None
