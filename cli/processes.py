"""`tgq api`, `tgq batcher`, `tgq worker`, `tgq beat` and `tgq migrate`: tgq's processes, run
with the options of its one configuration model (`api.settings.Settings`, which extends the
batcher's `batcher.options.BatcherOptions`).

The flags are generated from the model (`batcher.flags`): `tgq batcher` takes the batcher's
options, the other services every setting. Every process reads its options from its
environment, so the flags given are written into this process's environment (a flag beats its
variable), checked there, and the service inherits them. Single-process commands replace the
`tgq` process (`os.execvpe`): signals reach the service itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from tgq.api.settings import Settings
from tgq.batcher.flags import Model, as_env, build, given
from tgq.batcher.options import BatcherOptions
from tgq.cli import CommandError


def set_environment(
    args: argparse.Namespace, model: type[Model], defaults: dict[str, str] | None = None
) -> Model:
    """The flags given, written into this process's environment over `defaults` and the
    variables already set; the options they make, checked as the service will read them."""
    for name, value in (defaults or {}).items():
        os.environ.setdefault(name, value)
    values = given(args, model)
    os.environ.update(as_env(values))
    try:
        return build(model, {})
    except ValueError as error:
        raise CommandError(str(error)) from None


def celery_argv(role: str, extra: Sequence[str] = ()) -> list[str]:
    """`celery ... ROLE`, with `extra` (`tgq worker -- -c 4`: what follows `--`) appended."""
    extra = extra[1:] if extra[:1] == ["--"] else extra
    return [sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", role, "-l", "INFO", *extra]


def api(args: argparse.Namespace) -> int:
    set_environment(args, Settings)
    replace_process([sys.executable, "-m", "tgq.api"])


def batcher(args: argparse.Namespace) -> int:
    set_environment(args, BatcherOptions)
    replace_process([sys.executable, "-m", "tgq.batcher"])


def worker(args: argparse.Namespace) -> int:
    set_environment(args, Settings)
    replace_process(celery_argv("worker", args.celery_args))


def beat(args: argparse.Namespace) -> int:
    set_environment(args, Settings)
    replace_process(celery_argv("beat", args.celery_args))


def migrate(args: argparse.Namespace) -> int:
    """Upgrade the database to the head revision; print the revision before and after."""
    from sqlalchemy.engine import make_url

    from tgq.api.db import migrate as migrations  # alembic and SQLAlchemy: only for this command

    url = args.database_url or migrations.default_url()
    before = migrations.current_revision(url)
    migrations.upgrade(url)
    after = migrations.current_revision(url)
    shown = make_url(url).render_as_string(hide_password=True)
    print(f"{shown}: revision {before or 'none'} -> {after or 'none'}")
    return 0


def replace_process(argv: list[str]) -> NoReturn:
    """Run `argv` in place of `tgq`, in its environment: its signals and exit code are the
    service's own."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, dict(os.environ))
