"""`tgq keys create|list|revoke`: the api keys stored in the database (`REQUIRE_API_KEYS`).

`create NAME` prints the new key once: only its sha256 is stored, so it cannot be shown again.
`list` shows each key's id, name, prefix and dates, never a secret. `revoke ID|NAME` revokes it;
the api refuses it from its next request on.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.cli import CommandError

T = TypeVar("T")


def create(args: argparse.Namespace) -> int:
    from tgq.api.db.api_keys import create_api_key

    record, secret = _run(args, lambda conn: create_api_key(conn, name=args.name))
    print(f"created key {record.id} ({record.name}); it is shown this once:")
    print(secret)
    return 0


def list_keys(args: argparse.Namespace) -> int:
    from tgq.api.db.api_keys import list_api_keys

    records = _run(args, list_api_keys)
    print(f"{'ID':>4}  {'NAME':<24} {'PREFIX':<10} {'CREATED':<20} {'REVOKED':<20} LAST USED")
    for r in records:
        dates = (_when(r.created_at), _when(r.revoked_at), _when(r.last_used_at))
        print(
            f"{r.id:>4}  {r.name:<24} {r.key_prefix:<10} {dates[0]:<20} {dates[1]:<20} {dates[2]}"
        )
    return 0


def revoke(args: argparse.Namespace) -> int:
    key_id = _run(args, lambda conn: _revoke(conn, args.key))
    print(f"revoked key {key_id}")
    return 0


async def _revoke(conn: AsyncConnection, key: str) -> int:
    from tgq.api.db.api_keys import list_api_keys, revoke_api_key

    live = [r for r in await list_api_keys(conn) if r.revoked_at is None]
    matches = [r for r in live if str(r.id) == key] or [r for r in live if r.name == key]
    if not matches:
        raise CommandError(f"no unrevoked key with id or name {key!r}")
    if len(matches) > 1:
        ids = ", ".join(str(r.id) for r in matches)
        raise CommandError(f"{len(matches)} keys are named {key!r} (ids {ids}): revoke by id")
    await revoke_api_key(conn, key_id=matches[0].id)
    return matches[0].id


def _when(moment: object) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"


def _run(args: argparse.Namespace, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    from tgq.api.db.migrate import default_url

    return asyncio.run(_in_transaction(args.database_url or default_url(), work))


async def _in_transaction(url: str, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    from tgq.api.db import create_engine

    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            return await work(conn)
    finally:
        await engine.dispose()
