"""The api's database: Core tables (`models`), queries (`store`), Alembic wiring (`migrate`).

Postgres (asyncpg) is the system of record; SQLite (aiosqlite) is the embedded default. This
module builds the engine for either from one URL, and runs the hot write paths' transactions
(`in_transaction`).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Engine, event
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

T = TypeVar("T")

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
        _configure_sqlite(db.sync_engine)
        return SqliteEngine(db.sync_engine, _sqlite_writer(url))
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


async def in_transaction(db: AsyncEngine, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """`work(conn)` in one transaction, committed when it returns: `async with db.begin()`, except
    on a SQLite file, where the whole of it runs on a thread of its own (`SqliteEngine`). For
    work made only of `conn.execute` calls (the store's functions), on the hot paths: a request's
    job record, its result, its items' `running`."""
    if isinstance(db, SqliteEngine) and db.writer is not None:
        return await db.run_transaction(db.writer, work)
    async with db.begin() as conn:
        return await work(conn)


class SqliteEngine(AsyncEngine):
    """SQLite's engine: `begin()` transactions of this process take turns on an asyncio lock
    before SQLite's write lock. SQLite has one writer at a time, and a writer that finds it
    taken waits in SQLite's busy handler, which sleeps 1, 2, 5, 10, ... ms between tries: a
    request's job record waited up to ~10 ms behind the persister's results (a tenth of a
    stream's time to first token). On the lock, the next writer starts as soon as the last
    one commits. A turn not given within `WRITE_TURN_TIMEOUT_S` is taken anyway (SQLite's
    busy wait then decides, as before).

    `run_transaction` (a file, not `:memory:`) runs a transaction whole on one thread with a
    synchronous connection to the same file (`writer`): aiosqlite hands every statement, cursor
    and commit to its thread and back (a job record: 11 hand-offs, 3-10 ms while the engine's
    threads hold the cores; its SQL takes well under 1 ms), where this is one hand-off."""

    def __init__(self, sync_engine: Any, writer: Engine | None) -> None:
        super().__init__(sync_engine)
        # One lock per event loop (an asyncio.Lock belongs to the loop that first waits on it).
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self.writer = writer
        self._writer_thread = ThreadPoolExecutor(1, "sqlite-writer")  # threads start on first use

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        async with self._turn(), super().begin() as conn:
            yield conn

    async def run_transaction(
        self, writer: Engine, work: Callable[[AsyncConnection], Awaitable[T]]
    ) -> T:
        """`work` whole on the writer's thread, in this process's write turn."""

        def run() -> T:
            with writer.begin() as conn:
                return _run_to_end(work(cast(AsyncConnection, _ThreadConnection(conn))))

        async with self._turn():
            return await asyncio.get_running_loop().run_in_executor(self._writer_thread, run)

    async def dispose(self, close: bool = True) -> None:
        await super().dispose(close)
        if self.writer is not None:  # on its thread: its connections belong to that thread
            await asyncio.get_running_loop().run_in_executor(
                self._writer_thread, self.writer.dispose, close
            )

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        turn = self._turns.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        try:
            async with asyncio.timeout(WRITE_TURN_TIMEOUT_S):
                await turn.acquire()
            mine = True
        except TimeoutError:
            mine = False
        try:
            yield
        finally:
            if mine:
                turn.release()


class _ThreadConnection:
    """A synchronous connection as the store's functions use an AsyncConnection (`execute`,
    `dialect`). Its `execute` never waits, so a coroutine that only awaits it finishes at its
    first step (`_run_to_end`). Rows come back fetched, as the async driver returns them."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.dialect = conn.dialect

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        result = self._conn.execute(statement, parameters)
        return result.freeze()() if result.returns_rows else result


def _run_to_end(work: Awaitable[T]) -> T:
    coroutine = cast(Coroutine[Any, Any, T], work)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise RuntimeError("a SQLite transaction's work awaited something besides its connection")


def _sqlite_writer(url: str) -> Engine | None:
    """A synchronous engine on the same SQLite file (None for an in-memory database, which a
    second connection would not see)."""
    parsed = make_url(url)
    if parsed.database in (None, "", ":memory:") or "memory" in str(parsed.query.get("mode", "")):
        return None
    writer = create_sync_engine(parsed.set(drivername="sqlite+pysqlite"))
    _configure_sqlite(writer)
    return writer


def _configure_sqlite(engine: Engine) -> None:
    # SQLite has one writer at a time. BEGIN IMMEDIATE takes the write lock when a transaction
    # starts, so concurrent writers wait (busy timeout) instead of failing with SQLITE_BUSY
    # when a transaction that has read tries to write.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN: we do
        cursor = dbapi_connection.cursor()
        for pragma in ("journal_mode=WAL", "foreign_keys=ON", "busy_timeout=10000"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
