"""`tgq serve`: the whole service from one command.

Without `DATABASE_URL` and `REDIS_URL` it is `make run`: the api alone (a child), embedded (SQLite,
migrated at start, the batcher on a thread of the api). With both, it migrates the database, then
supervises the api, one batcher and one Celery worker with beat as child processes: SIGTERM or
SIGINT is forwarded to all of them as SIGTERM; when one exits on its own the others are stopped
(as TGI's launcher does when a shard dies). It exits once all have, non-zero if any failed.
Its own lines are logged as the services' (JSON with `--json-output`).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from tgq.api.settings import Settings
from tgq.batcher.flags import DEST_PREFIX
from tgq.batcher.logs import configure_logging
from tgq.cli import CommandError
from tgq.cli.processes import celery_argv, set_environment

EMBEDDED_DEFAULTS = {"DATABASE_URL": "sqlite+aiosqlite:///.cache/tgq.db", "AUTO_MIGRATE": "true"}
BEAT_SCHEDULE = Path(".cache/celerybeat-schedule")
WORKER_CONCURRENCY = 2  # Celery's default (one process per core) is too many beside a batcher
STOP_TIMEOUT_S = 45.0  # past the api's and the batcher's 30 s drains; then SIGKILL
POLL_S = 0.2
PR_SET_PDEATHSIG = 1
log = logging.getLogger("tgq")


def serve(args: argparse.Namespace) -> int:
    """Every flag reaches every child: each reads the same settings from the environment
    (the api and its in-process batcher, or the api, the batcher and the Celery worker)."""
    if not _given(args, "MODEL_ID") and not _given(args, "MODEL_DIR"):
        os.environ["MODEL_DIR"] = _demo_model()
    has_database, has_redis = _given(args, "DATABASE_URL"), _given(args, "REDIS_URL")
    if has_database != has_redis:
        raise CommandError("set both DATABASE_URL and REDIS_URL (or neither: embedded mode)")
    settings = set_environment(args, Settings, None if has_redis else EMBEDDED_DEFAULTS)
    configure_logging(json_output=settings.json_output)
    if not has_redis:
        Path(".cache").mkdir(exist_ok=True)  # the SQLite file's and the uploads' folder
        return Supervisor({"api": [sys.executable, "-m", "tgq.api"]}).run()
    return _supervised(settings)


def _given(args: argparse.Namespace, name: str) -> bool:
    """Whether setting `name` is set, by its flag or its environment variable."""
    return bool(getattr(args, DEST_PREFIX + name.lower(), None) or os.environ.get(name))


def _demo_model() -> str:
    log.info("no --model-id (MODEL_ID) or MODEL_DIR: serving the demo model")
    command = [sys.executable, "-m", "tgq.devtools.demo"]  # torch: in the child, not here
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return done.stdout.strip().splitlines()[-1]


def _supervised(settings: Settings) -> int:
    from tgq.api.db.migrate import current_revision, upgrade

    upgrade(settings.database_url)
    log.info("database at revision %s", current_revision(settings.database_url))
    BEAT_SCHEDULE.parent.mkdir(exist_ok=True)
    worker_options = ["-B", "-s", str(BEAT_SCHEDULE), "-c", str(WORKER_CONCURRENCY)]
    commands = {
        "api": [sys.executable, "-m", "tgq.api"],
        "batcher": [sys.executable, "-m", "tgq.batcher"],
        "worker": celery_argv("worker", worker_options),
    }
    return Supervisor(commands).run()


class Supervisor:
    """Child processes started together and stopped together."""

    def __init__(self, commands: Mapping[str, list[str]]) -> None:
        self.commands = commands
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.signum: int | None = None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        try:
            for name, argv in self.commands.items():
                self.processes[name] = self._start(argv)
            while self.signum is None and self._all_running():
                time.sleep(POLL_S)
        finally:
            self._stop_all()
        return self._exit_code()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def _start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        # Its own process group, so a terminal's Ctrl-C reaches the children once (from here).
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, process_group=0,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (the supervisor runs no threads)
        )  # fmt: skip

    def _all_running(self) -> bool:
        exited = [name for name, p in self.processes.items() if p.poll() is not None]
        for name in exited:
            code = self.processes[name].returncode
            log.warning("%s exited with %s: stopping the others", name, code)
        return not exited

    def _stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _exit_code(self) -> int:
        # uvicorn re-raises the SIGTERM it handled: -SIGTERM is a clean stop too.
        clean = (0, -signal.SIGTERM)
        failed = [p.returncode for p in self.processes.values() if p.returncode not in clean]
        if failed:
            return 1
        return 0 if self.signum is not None else 1  # a service that quit unasked did not finish


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when `tgq serve` dies, even by SIGKILL (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
