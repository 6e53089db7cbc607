"""The statement pieces the writes share: job locks in id order, insert-unless-taken, and a
timestamp as a SQL literal.

Lock order, so that concurrent writers (several api replicas) never deadlock: a statement that
changes items first locks their jobs (`lock_jobs`), in id order, then the items.
"""

from __future__ import annotations

import functools
from datetime import datetime

from sqlalchemy import ColumnElement, Executable, Table, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import models as db


async def lock_jobs(conn: AsyncConnection, where: ColumnElement[bool]) -> list[str]:
    """Lock the matching job rows in id order (a no-op on SQLite, which has one writer)."""
    query = select(db.jobs.c.id).where(where).order_by(db.jobs.c.id).with_for_update()
    return list((await conn.execute(query)).scalars())


@functools.cache
def insert_unless_taken(dialect: str, table: Table, *unique: str) -> Executable:
    """INSERT ... ON CONFLICT (unique) DO NOTHING RETURNING: a row comes back only when it
    was inserted. Built once per dialect and table (the api runs it for every request)."""
    statement: postgresql.Insert | sqlite.Insert
    if dialect == "postgresql":
        statement = postgresql.insert(table)
    elif dialect == "sqlite":
        statement = sqlite.insert(table)
    else:
        raise NotImplementedError(f"tgq supports Postgres and SQLite, not {dialect}")
    return statement.on_conflict_do_nothing(index_elements=unique).returning(table.c[unique[0]])


def at(moment: datetime) -> ColumnElement[datetime]:
    """`moment` as a literal of the tables' UTC timestamp type (for `coalesce` and `case`)."""
    return literal(moment, db.UtcDateTime())
