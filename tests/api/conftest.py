"""Database fixtures: a fresh, migrated Postgres database per test session, and SQLite files;
the tiny text model, and a running stack per module (`tests/api/stack.py` makes them).

`pg_url` is the session's database URL (`postgresql+asyncpg://...`); `pg_engine` gives each test an
engine on it with every table emptied first. Engines use `NullPool`, so one engine serves several
`asyncio.run` calls (pooled asyncpg connections belong to the event loop that opened them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from tests.api.stack import (
    Stack,
    create_database,
    drop_database,
    migrated_database,
    running_stack,
    write_text_model,
)
from tgq.api.db import create_engine
from tgq.api.db.migrate import upgrade
from tgq.api.db.models import metadata


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated Postgres database for the whole session, dropped at the end."""
    with migrated_database() as url:
        yield url


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A Postgres database that was never migrated, dropped after the test."""
    url = create_database()
    try:
        yield url
    finally:
        drop_database(url)


async def _truncate(engine: AsyncEngine) -> None:
    names = ", ".join(f'"{table.name}"' for table in metadata.sorted_tables)
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[AsyncEngine]:
    """An engine on `pg_url` whose tables are all empty when the test starts."""
    engine = create_engine(pg_url, poolclass=NullPool)
    asyncio.run(_truncate(engine))
    yield engine
    asyncio.run(engine.dispose())


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A migrated SQLite file of this test."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tgq.db'}"
    upgrade(url)
    return url


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[AsyncEngine]:
    engine = create_engine(sqlite_url, poolclass=NullPool)
    yield engine
    asyncio.run(engine.dispose())


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a trained tokenizer and a chat template (see `tests/api/stack.py`)."""
    return write_text_model(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def stack(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(text_model_dir, tmp_path_factory.mktemp("logs")) as started:
        yield started
