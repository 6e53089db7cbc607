"""A throwaway redis-server of a test's own on a free port, which the test may kill, flush and
start again on the same port while the shared server other tests use runs on (the Postgres
counterpart is `pg_server.py`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.api.stack import free_port
from tests.polling import eventually


class RedisServer:
    """A redis-server of the caller's own on a free port: without persistence (a restart loses
    every key), or with an append-only file in `data_dir` (as compose runs it)."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.data_dir = data_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self.start()

    def start(self) -> None:
        """Starts it (again, on the same port: empty, or with what its append-only file kept)
        and waits until it answers."""
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.data_dir is None:
            command += ["--appendonly", "no"]
        else:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
            command += ["--dir", str(self.data_dir)]
        self.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        client = redis.Redis(port=self.port)
        eventually(lambda: _pings(client), 10, f"redis-server on port {self.port} answers")
        client.close()

    def kill(self) -> None:
        self.processes[-1].kill()
        self.processes[-1].wait()

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): it writes its append-only file first."""
        self.processes[-1].send_signal(signal.SIGTERM)
        self.processes[-1].wait(10)

    def lose_everything(self, how: str) -> None:
        """Every key gone: "restart" kills it and starts it again (empty, without an append-only
        file), "flushall" empties it and keeps its clients' connections."""
        if how == "restart":
            self.kill()
            self.start()
        elif how == "flushall":
            client = redis.Redis.from_url(self.url)
            client.flushall()
            client.close()
        else:
            raise ValueError(f"no way to lose everything called {how!r}")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@contextlib.contextmanager
def private_redis(data_dir: Path | None = None) -> Iterator[RedisServer]:
    server = RedisServer(data_dir)
    try:
        yield server
    finally:
        server.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
