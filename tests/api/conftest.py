"""Database fixtures: a fresh, migrated Postgres database per test session, and SQLite files.

`pg_url` is the session's database URL (`postgresql+asyncpg://...`); `pg_engine` gives each test an
engine on it with every table emptied first. Engines use `NullPool`, so one engine serves several
`asyncio.run` calls (pooled asyncpg connections belong to the event loop that opened them).
Set `TGQ_TEST_POSTGRES` to the admin URL of another server (default: root on 127.0.0.1:5432).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from tests.api.stack import Stack
from tgq.api.db import create_engine
from tgq.api.db.migrate import upgrade
from tgq.api.db.models import metadata

ADMIN_URL = os.environ.get("TGQ_TEST_POSTGRES", "postgresql+asyncpg://root@127.0.0.1:5432/postgres")


async def _admin(statement: str) -> None:
    engine = create_engine(ADMIN_URL, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    async with engine.connect() as conn:
        await conn.execute(text(statement))
    await engine.dispose()


def _create_database() -> str:
    name = f"tgq_test_{secrets.token_hex(6)}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    return make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def _drop_database(url: str) -> None:
    asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))


@contextlib.contextmanager
def migrated_database() -> Iterator[str]:
    """A migrated Postgres database of its own, dropped after the block."""
    url = _create_database()
    try:
        upgrade(url)
        yield url
    finally:
        _drop_database(url)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated Postgres database for the whole session, dropped at the end."""
    with migrated_database() as url:
        yield url


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A Postgres database that was never migrated, dropped after the test."""
    url = _create_database()
    try:
        yield url
    finally:
        _drop_database(url)


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
    from tests.api.stack import write_text_model

    return write_text_model(tmp_path_factory.mktemp("text-model"))


@contextlib.contextmanager
def running_stack(
    model_dir: Path, log_dir: Path, *, celery_worker: bool = False
) -> Iterator[Stack]:
    """Postgres (a database of its own), Redis, one batcher process, optionally a Celery
    worker (it runs the batches), and the api process."""
    url = _create_database()
    upgrade(url)
    running = Stack(model_dir, url, log_dir)
    try:
        running.start_batcher()
        if celery_worker:
            running.start_worker()
        running.start_api()
        yield running
    finally:
        running.stop()
        _drop_database(url)


@pytest.fixture(scope="module")
def stack(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(text_model_dir, tmp_path_factory.mktemp("logs")) as running:
        yield running
