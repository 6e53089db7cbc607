"""The api's database: Core tables (`models`), queries (`store`), Alembic wiring (`migrate`).

Postgres (asyncpg) is the system of record; SQLite (aiosqlite) is the embedded default. This
module builds the engine for either from one URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

POOL_SIZE = 20  # connections each engine keeps open (Postgres), with up to 10 more under load
# How long a SQLite transaction waits for its turn among this process's writers before it goes
# ahead anyway (SQLite's own busy wait then decides, up to its busy_timeout).
WRITE_TURN_TIMEOUT_S = 1.0
_ASYNC_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
}


def normalize_url(url: str) -> str:
    """The URL with the async driver tgq uses: `postgresql://` becomes `postgresql+asyncpg://`,
    `sqlite://` becomes `sqlite+aiosqlite://`; explicit drivers are kept."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername, parsed.drivername)
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for `url`; keyword arguments go to `create_async_engine`."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        db = create_async_engine(url, **kwargs)
        _configure_sqlite(db)
        return SqliteEngine(db.sync_engine)
    pooling = {} if "poolclass" in kwargs else {"pool_size": POOL_SIZE, "max_overflow": 10}
    return create_async_engine(url, **pooling, **kwargs)


async def warm_up(db: AsyncEngine, num_connections: int) -> None:
    """Opens `num_connections` (at most the pool's size) pooled connections now, so that the
    first burst of requests does not wait for Postgres to start a backend for each."""
    if db.dialect.name == "sqlite":
        return  # a file: nothing worth opening ahead
    count = min(num_connections, POOL_SIZE)
    connections = await asyncio.gather(*(db.connect().start() for _ in range(count)))
    await asyncio.gather(*(connection.close() for connection in connections))


class SqliteEngine(AsyncEngine):
    """SQLite's engine: `begin()` transactions of this process take turns on an asyncio lock
    before SQLite's write lock. SQLite has one writer at a time, and a writer that finds it
    taken waits in SQLite's busy handler, which sleeps 1, 2, 5, 10, ... ms between tries: a
    request's job record waited up to ~10 ms behind the persister's results (a tenth of a
    stream's time to first token). On the lock, the next writer starts as soon as the last
    one commits. A turn not given within `WRITE_TURN_TIMEOUT_S` is taken anyway (SQLite's
    busy wait then decides, as before)."""

    def __init__(self, sync_engine: Any) -> None:
        super().__init__(sync_engine)
        # One lock per event loop (an asyncio.Lock belongs to the loop that first waits on it).
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        turn = self._turns.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        try:
            async with asyncio.timeout(WRITE_TURN_TIMEOUT_S):
                await turn.acquire()
            mine = True
        except TimeoutError:
            mine = False
        try:
            async with super().begin() as conn:
                yield conn
        finally:
            if mine:
                turn.release()


def _configure_sqlite(db: AsyncEngine) -> None:
    # SQLite has one writer at a time. BEGIN IMMEDIATE takes the write lock when a transaction
    # starts, so concurrent writers wait (busy timeout) instead of failing with SQLITE_BUSY
    # when a transaction that has read tries to write.
    @event.listens_for(db.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN: we do
        cursor = dbapi_connection.cursor()
        for pragma in ("journal_mode=WAL", "foreign_keys=ON", "busy_timeout=10000"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(db.sync_engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
