"""`tgq api`, `tgq batcher`, `tgq worker`, `tgq beat` and `tgq migrate`: tgq's processes, run
with settings from flags named as TGI's launcher's.

Every flag falls back to its environment variable (`--model-id` <- `MODEL_ID`). The api and the
Celery processes read `api.settings.Settings` from the environment, so their flags become
environment variables of the child; the batcher reads flags, so its settings become its argv.
Single-process commands replace the `tgq` process (`os.execvpe`): signals reach the service
itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from tgq.cli import CommandError

Environ = Mapping[str, str]


@dataclass(frozen=True)
class Flag:
    """A command-line flag that defaults to the environment variable of the same name."""

    name: str  # "--model-id"
    help: str
    type: type = str
    is_switch: bool = False  # takes no value: given means "true"

    @property
    def env(self) -> str:
        return self.name.removeprefix("--").replace("-", "_").upper()

    @property
    def dest(self) -> str:  # prefixed: the root parser's `--api-key` is the client's key
        return f"setting_{self.env.lower()}"


# Fields of `api.settings.Settings`: handed to the api and Celery children as environment.
SETTING_FLAGS = (
    Flag("--model-id", "local model directory or hub id"),
    Flag("--hostname", "address the api listens on"),
    Flag("--port", "port the api listens on", int),
    Flag("--max-concurrent-requests", "requests the api runs at once", int),
    Flag("--max-input-tokens", "longest prompt, in tokens", int),
    Flag("--max-total-tokens", "prompt plus generated tokens, at most", int),
    Flag("--api-key", "require `Authorization: Bearer KEY` on non-public routes"),
)
# Flags of `python -m tgq.batcher` (not api settings): `--model-id` also goes there, as a directory.
BATCHER_FLAGS = (
    Flag("--num-shard", "tensor-parallel ranks of the batcher", int),
    Flag("--max-batch-size", "requests in one batcher step", int),
    Flag("--max-batch-prefill-tokens", "prompt tokens prefilled in one batcher step", int),
    Flag("--device", "torch device of the batcher (default cpu)"),
)
BATCHER_ENV_FLAGS = {"REDIS_URL": "--redis-url", "REDIS_PREFIX": "--prefix"}
# Logs and traces, as TGI's launcher: api settings and batcher flags both, for every service.
LOG_FLAGS = (
    Flag("--json-output", "log one JSON object per line", is_switch=True),
    Flag("--otlp-endpoint", "export OpenTelemetry traces to this OTLP/HTTP collector URL"),
    Flag("--otlp-service-name", "service name of the exported traces (default tgq)"),
)


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for flag in flags:
        described = f"{flag.help} (env {flag.env})"
        if flag.is_switch:
            parser.add_argument(
                flag.name, dest=flag.dest, action="store_const", const="true", help=described
            )
        else:
            parser.add_argument(
                flag.name, dest=flag.dest, type=flag.type, metavar=flag.env, help=described
            )


def given(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, str]:
    """The flags given on the command line, by environment name."""
    values = {flag.env: getattr(args, flag.dest, None) for flag in flags}
    return {env: str(value) for env, value in values.items() if value is not None}


def settings_env(flags: Mapping[str, str], environ: Environ) -> dict[str, str]:
    """The environment of an api or Celery child: `environ` with the given flags over it."""
    return {**environ, **flags}


def batcher_argv(flags: Mapping[str, str], environ: Environ) -> list[str]:
    """`python -m tgq.batcher`'s arguments: each flag given, else its environment variable. The
    model is `--model-id`, else `MODEL_DIR`, else `MODEL_ID` (a directory either way)."""
    env = settings_env(flags, environ)
    model_dir = flags.get("MODEL_ID") or env.get("MODEL_DIR") or env.get("MODEL_ID")
    if not model_dir:
        raise CommandError("the batcher needs a model directory: --model-id (or MODEL_DIR)")
    argv = ["--model-id", model_dir]
    for name, option in BATCHER_ENV_FLAGS.items():
        argv += [option, env[name]] if env.get(name) else []
    for flag in BATCHER_FLAGS:
        argv += [flag.name, env[flag.env]] if env.get(flag.env) else []
    for flag in LOG_FLAGS:
        value = env.get(flag.env, "")
        if flag.is_switch:
            argv += [flag.name] if is_on(value) else []
        else:
            argv += [flag.name, value] if value else []
    return argv


def is_on(value: str) -> bool:
    """A switch's environment value, read as pydantic reads the api's `Settings`."""
    return value.lower() in ("1", "true", "yes", "on", "t", "y")


def celery_argv(role: str, extra: Sequence[str] = ()) -> list[str]:
    """`celery ... ROLE`, with `extra` (`tgq worker -- -c 4`: what follows `--`) appended."""
    extra = extra[1:] if extra[:1] == ["--"] else extra
    return [sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", role, "-l", "INFO", *extra]


def api(args: argparse.Namespace) -> int:
    env = settings_env(given(args, (*SETTING_FLAGS, *LOG_FLAGS)), os.environ)
    replace_process([sys.executable, "-m", "tgq.api"], env)


def batcher(args: argparse.Namespace) -> int:
    argv = batcher_argv(given(args, (*SETTING_FLAGS, *BATCHER_FLAGS, *LOG_FLAGS)), os.environ)
    replace_process([sys.executable, "-m", "tgq.batcher", *argv], dict(os.environ))


def worker(args: argparse.Namespace) -> int:
    env = settings_env(given(args, (*SETTING_FLAGS, *LOG_FLAGS)), os.environ)
    replace_process(celery_argv("worker", args.celery_args), env)


def beat(args: argparse.Namespace) -> int:
    env = settings_env(given(args, (*SETTING_FLAGS, *LOG_FLAGS)), os.environ)
    replace_process(celery_argv("beat", args.celery_args), env)


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


def replace_process(argv: list[str], env: Mapping[str, str]) -> NoReturn:
    """Run `argv` in place of `tgq`: its signals and exit code are the service's own."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, dict(env))
