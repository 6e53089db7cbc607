"""`tgq`: the command line of the text generation queue.

Each command group adds its own subparser (`_add_batch` for `tgq batch ...`) and sets `handler`,
a function of the parsed arguments returning the exit code. A new group (`serve`, `migrate`, ...)
is one more `_add_*` function in `COMMAND_GROUPS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

from tgq.api.settings import Settings
from tgq.batcher.flags import add_flags
from tgq.batcher.options import BatcherOptions
from tgq.cli import INTERRUPTED, CommandError, batch, bench, download, keys, processes, serve

DEFAULT_URL = "http://127.0.0.1:3000"
USAGE_ERROR = 2  # argparse's own exit code for bad arguments; tgq uses it for server errors too

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _metadata_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_batch(commands: Commands) -> None:
    group = commands.add_parser("batch", help="submit and follow batches (OpenAI's Batches API)")
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")

    submit = actions.add_parser("submit", help="upload a JSONL file and start a batch over it")
    submit.add_argument("file", metavar="FILE.jsonl", type=Path, help="batch request lines")
    submit.add_argument(
        "--endpoint",
        choices=batch.ENDPOINTS,
        help="the endpoint of every line (default: the first line's `url`)",
    )
    submit.add_argument("--completion-window", default="24h", help="e.g. 24h, 30m (default 24h)")
    submit.add_argument(
        "--metadata",
        nargs="+",
        action="extend",
        type=_metadata_pair,
        default=[],
        metavar="KEY=VALUE",
        help="stored with the batch (after FILE, or repeated)",
    )
    submit.add_argument(
        "--wait", action="store_true", help="follow the batch to its end, then download its files"
    )
    submit.add_argument(
        "--output", type=Path, help="with --wait: default FILE's stem + .output.jsonl"
    )
    submit.add_argument(
        "--errors", type=Path, help="with --wait: default FILE's stem + .errors.jsonl"
    )
    submit.set_defaults(handler=batch.submit)

    status = actions.add_parser("status", help="show a batch")
    status.add_argument("batch_id", metavar="BATCH_ID")
    status.add_argument("--json", action="store_true", help="print the batch object as JSON")
    status.set_defaults(handler=batch.status)


def _add_services(commands: Commands) -> None:
    api = commands.add_parser("api", help="run the api (`python -m tgq.api`)")
    add_flags(api, Settings)
    api.set_defaults(handler=processes.api)

    batcher = commands.add_parser("batcher", help="run one batcher (`python -m tgq.batcher`)")
    add_flags(batcher, BatcherOptions)
    batcher.set_defaults(handler=processes.batcher)

    for role, handler in (("worker", processes.worker), ("beat", processes.beat)):
        celery = commands.add_parser(role, help=f"run the Celery {role} of bulk work")
        add_flags(celery, Settings)
        celery.add_argument(
            "celery_args", nargs=argparse.REMAINDER, metavar="-- ...", help="passed to Celery"
        )
        celery.set_defaults(handler=handler)

    everything = commands.add_parser(
        "serve", help="the whole service: embedded, or api + batcher + worker with Redis"
    )
    add_flags(everything, Settings)
    everything.set_defaults(handler=serve.serve)


def _add_migrate(commands: Commands) -> None:
    migrate = commands.add_parser("migrate", help="upgrade the database schema to this tgq's")
    migrate.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL"),
        help="env DATABASE_URL (default: the api's SQLite file)",
    )
    migrate.set_defaults(handler=processes.migrate)


def _add_keys(commands: Commands) -> None:
    group = commands.add_parser("keys", help="create, list and revoke the database's API keys")
    group.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL"),
        help="env DATABASE_URL (default: the api's SQLite file)",
    )
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="a new key; its secret is printed this once")
    create.add_argument("name", metavar="NAME", help="who or what the key is for")
    keys.add_limit_flags(create)
    create.set_defaults(handler=keys.create)
    actions.add_parser("list", help="every key and its limits (never its secret)").set_defaults(
        handler=keys.list_keys
    )
    limits = actions.add_parser(
        "limits", help="change a key's limits: the flags given (`none` lifts one), others kept"
    )
    limits.add_argument("key", metavar="ID|NAME")
    keys.add_limit_flags(limits)
    limits.set_defaults(handler=keys.set_limits)
    revoke = actions.add_parser("revoke", help="revoke a key by its id or name")
    revoke.add_argument("key", metavar="ID|NAME")
    revoke.set_defaults(handler=keys.revoke)


def _add_download(commands: Commands) -> None:
    fetch = commands.add_parser(
        "download", help="fetch a model's safetensors, config and tokenizer from the hub"
    )
    fetch.add_argument("model_id", metavar="MODEL_ID", help="hub id (org/name) or local directory")
    fetch.add_argument(
        "--revision",
        default=os.environ.get("REVISION"),
        help="branch, tag or commit (env REVISION; default main)",
    )
    fetch.add_argument("--cache-dir", type=Path, help="default: the Hugging Face cache")
    fetch.set_defaults(handler=download.download)


def _add_bench(commands: Commands) -> None:
    load = commands.add_parser(
        "bench", help="load-test an OpenAI-compatible or TGI endpoint (tgq's or a peer's)"
    )
    bench.add_arguments(load)
    load.set_defaults(handler=bench.bench)


COMMAND_GROUPS: tuple[Callable[[Commands], None], ...] = (
    _add_batch,
    _add_services,
    _add_migrate,
    _add_keys,
    _add_download,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tgq", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("TGQ_URL", DEFAULT_URL),
        help=f"the tgq server (env TGQ_URL; default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TGQ_API_KEY"),
        help="sent as `Authorization: Bearer` (env TGQ_API_KEY)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_group in COMMAND_GROUPS:
        add_group(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except CommandError as error:
        print(f"tgq: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("tgq: interrupted", file=sys.stderr)
        return INTERRUPTED
    return code
