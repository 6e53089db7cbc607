"""A throwaway Postgres server of a test's own: `initdb` of a fresh cluster on a free port, run
with `pg_ctl` as the `postgres` OS user (the server refuses to run as root), so that a test can
stop the server process itself (`pg_ctl stop -m immediate`: the process is gone, new
connections are refused) and start it again, while the shared server other tests use runs on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.api.stack import free_port

OS_USER = "postgres"


@dataclass
class PgServer:
    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://root@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> None:
        command = ["pg_ctl", "-D", str(self.directory / "data"), "-w", *args]
        subprocess.run(_as_postgres(command), check=True, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg_ctl("-o", options, "-l", str(self.directory / "server.log"), "start")

    def stop(self) -> None:
        """Stops the server process at once (no checkpoint, clients cut)."""
        self._pg_ctl("-m", "immediate", "stop")

    def log(self) -> str:
        return (self.directory / "server.log").read_text(errors="replace")[-4000:]


def _as_postgres(command: list[str]) -> list[str]:
    return command if os.geteuid() != 0 else ["runuser", "-u", OS_USER, "--", *command]


@contextlib.contextmanager
def private_postgres() -> Iterator[PgServer]:
    """A running server (superuser `root`, trust auth) on a free port, removed after the block."""
    directory = Path(tempfile.mkdtemp(prefix="tgq-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, OS_USER)
    server = PgServer(directory, free_port())
    initdb = ["initdb", "-D", str(directory / "data"), "-A", "trust", "-U", "root", "--no-sync"]
    subprocess.run(_as_postgres(initdb), check=True, stdout=subprocess.DEVNULL)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
