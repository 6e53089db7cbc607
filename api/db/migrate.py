"""Alembic, driven from code: `upgrade`, `current_revision`, the start-up `check_schema`, and the
`python -m tgq.api.db.migrate [--url URL] [--revision REV]` command.

The revisions live in `migrations/` at the top of the repository; `migrations/env.py` takes the
URL from `Config.attributes["url"]`, then `-x url=...`, then `DATABASE_URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import create_engine, normalize_url
from tgq.api.settings import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaNotMigratedError(RuntimeError):
    """The database is not at the revision this code needs."""


def alembic_config(url: str | None = None) -> Config:
    """tgq's Alembic configuration, for `url` when given."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        config.attributes["url"] = normalize_url(url)
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS_DIR}")
    return head


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database up to `revision`. Runs its own event loop: from async code, call it
    in a thread (`await asyncio.to_thread(upgrade, url)`)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database down to `revision` (`base`: drop everything)."""
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The database's revision; None when it was never migrated. Runs its own event loop."""
    return asyncio.run(_current_revision(url))


async def _current_revision(url: str) -> str | None:
    db = create_engine(url)
    try:
        return await _engine_revision(db)
    finally:
        await db.dispose()


async def _engine_revision(db: AsyncEngine) -> str | None:
    async with db.connect() as conn:
        return await conn.run_sync(_revision_of)


def _revision_of(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def check_schema(db: AsyncEngine) -> None:
    """Raise `SchemaNotMigratedError` unless the database is at the head revision (the app
    refuses to start on a database that was not migrated)."""
    current, head = await _engine_revision(db), head_revision()
    if current != head:
        raise SchemaNotMigratedError(
            f"database schema is at revision {current or 'none'}, this tgq needs {head}: "
            "run `tgq migrate` (or `python -m tgq.api.db.migrate`)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tgq.api.db.migrate", description=__doc__)
    parser.add_argument("--url", help="database URL (default: DATABASE_URL, else tgq's SQLite)")
    parser.add_argument("--revision", default="head", help="target revision (default: head)")
    args = parser.parse_args(argv)
    url = args.url or default_url()
    before = current_revision(url)
    upgrade(url, args.revision)
    after = current_revision(url)
    print(f"{_display(url)}: revision {before or 'none'} -> {after or 'none'}")


def default_url() -> str:
    """The api's database URL: `DATABASE_URL`, else the api's default (the SQLite file)."""
    default: str = Settings.model_fields["database_url"].default
    return os.environ.get("DATABASE_URL") or default


def _display(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    main()
