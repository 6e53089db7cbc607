"""`/health`'s database check: `SELECT 1` under a short timeout, its answer cached for a second,
so that `/health` stays cheap however often a load balancer asks (one probe per second at most;
concurrent asks wait for the same probe)."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

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
