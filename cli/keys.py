"""`tgq keys create|list|limits|revoke`: the api keys stored in the database
(`REQUIRE_API_KEYS`).

`create NAME [--rpm N --tpm N --max-concurrent N --max-queued-jobs N --priority bulk]` prints
the new key once: only its sha256 is stored, so it cannot be shown again. `list` shows each key's
id, name, prefix, dates and limits, never a secret. `limits ID|NAME --rpm 120 --tpm none`
changes the limits given (`none` lifts one) and keeps the others. `revoke ID|NAME` revokes it.
The api applies a change from the key's next request on.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.cli import CommandError

if TYPE_CHECKING:
    from tgq.api.db.api_keys import ApiKeyRecord
    from tgq.api.key_policy import KeyLimits

T = TypeVar("T")
LIMIT_FLAGS = ("rpm", "tpm", "max_concurrent", "max_queued_jobs")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    helps = {
        "rpm": "requests per minute",
        "tpm": "tokens per minute (prompt + max_tokens when admitted, settled at the end)",
        "max_concurrent": "requests in flight at once",
        "max_queued_jobs": "jobs and batches open at once",
    }
    for name, text in helps.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_limit,
            default=argparse.SUPPRESS,  # not given: no attribute
            metavar="N",
            help=text,
        )
    parser.add_argument(
        "--adapters",
        type=_names,
        default=argparse.SUPPRESS,
        metavar="NAME,...",
        help="the only models it may use: LoRA adapters' names, the base model's id (`none`: any)",
    )
    parser.add_argument(
        "--priority",
        choices=("interactive", "bulk", "none"),
        default=argparse.SUPPRESS,
        help="the highest priority its requests get (bulk: always bulk)",
    )


def _limit(given: str) -> int | None:
    if given == "none":
        return None
    if not given.isdecimal() or int(given) < 1:
        raise argparse.ArgumentTypeError(f"a positive integer or `none`, not {given!r}")
    return int(given)


def _names(given: str) -> tuple[str, ...] | None:
    if given == "none":
        return None
    names = tuple(name.strip() for name in given.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"comma-separated model names or `none`, not {given!r}")
    return names


def _limits(args: argparse.Namespace, current: KeyLimits | None = None) -> KeyLimits:
    """The limits the flags give, the unset ones taken from `current`."""
    from tgq.api.key_policy import KeyLimits

    base = asdict(current or KeyLimits())
    flags = (*LIMIT_FLAGS, "priority", "adapters")
    chosen = {name: getattr(args, name) for name in flags if name in args}
    if chosen.get("priority") == "none":
        chosen["priority"] = None
    return KeyLimits(**{**base, **chosen})


def create(args: argparse.Namespace) -> int:
    from tgq.api.db.api_keys import create_api_key

    limits = _limits(args)
    record, secret = _run(args, lambda conn: create_api_key(conn, name=args.name, limits=limits))
    print(f"created key {record.id} ({record.name}); it is shown this once:")
    print(secret)
    return 0


def list_keys(args: argparse.Namespace) -> int:
    from tgq.api.db.api_keys import list_api_keys

    records = _run(args, list_api_keys)
    print(
        f"{'ID':>4}  {'NAME':<24} {'PREFIX':<10} {'CREATED':<20} {'REVOKED':<20} "
        f"{'LAST USED':<20} LIMITS"
    )
    for r in records:
        dates = (_when(r.created_at), _when(r.revoked_at), _when(r.last_used_at))
        print(
            f"{r.id:>4}  {r.name:<24} {r.key_prefix:<10} {dates[0]:<20} {dates[1]:<20} "
            f"{dates[2]:<20} {_describe(r.limits)}"
        )
    return 0


def _describe(limits: KeyLimits) -> str:
    values = {**asdict(limits), "adapters": ",".join(limits.adapters or ()) or None}
    parts = [f"{k}={v}" for k, v in values.items() if v is not None]
    return " ".join(parts) or "-"


def set_limits(args: argparse.Namespace) -> int:
    record = _run(args, lambda conn: _set_limits(conn, args))
    print(f"key {record.id} ({record.name}): {_describe(record.limits)}")
    return 0


async def _set_limits(conn: AsyncConnection, args: argparse.Namespace) -> ApiKeyRecord:
    from tgq.api.db.api_keys import set_key_limits

    record = await _live_key(conn, args.key)
    updated = await set_key_limits(conn, key_id=record.id, limits=_limits(args, record.limits))
    assert updated is not None, "the key was just read in this transaction"
    return updated


def revoke(args: argparse.Namespace) -> int:
    key_id = _run(args, lambda conn: _revoke(conn, args.key))
    print(f"revoked key {key_id}")
    return 0


async def _revoke(conn: AsyncConnection, key: str) -> int:
    from tgq.api.db.api_keys import revoke_api_key

    record = await _live_key(conn, key)
    await revoke_api_key(conn, key_id=record.id)
    return record.id


async def _live_key(conn: AsyncConnection, key: str) -> ApiKeyRecord:
    """The unrevoked key with id `key`, else the one named `key`."""
    from tgq.api.db.api_keys import list_api_keys

    live = [r for r in await list_api_keys(conn) if r.revoked_at is None]
    matches = [r for r in live if str(r.id) == key] or [r for r in live if r.name == key]
    if not matches:
        raise CommandError(f"no unrevoked key with id or name {key!r}")
    if len(matches) > 1:
        ids = ", ".join(str(r.id) for r in matches)
        raise CommandError(f"{len(matches)} keys are named {key!r} (ids {ids}): use its id")
    return matches[0]


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
