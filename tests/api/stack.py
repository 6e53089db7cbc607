"""The real stack, for the HTTP tests and the HTTP benchmarks alike: Postgres (a database of its
own), Redis, batcher processes, Celery workers and the api as a uvicorn process.

`Stack` starts and stops the processes and `running` holds one up for a block; the fixtures in
`conftest.py` share one per module. Around it: free ports, the Postgres admin (databases made
and dropped), Redis keys deleted, and the tests' tiny text model (random weights, a
tokenizer trained here, a chat template). Plain Python, no pytest: `bench/` imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from tgq.api.db import api_keys, create_engine
from tgq.api.db.api_keys import NO_LIMITS
from tgq.api.db.migrate import upgrade
from tgq.api.key_policy import KeyLimits
from tgq.devtools.demo import add_chat_template
from tgq.devtools.random_model import make_config, write_model
from tgq.devtools.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
# Set `TGQ_TEST_POSTGRES` to the admin URL of another server (default: root on 127.0.0.1:5432).
ADMIN_URL = os.environ.get("TGQ_TEST_POSTGRES", "postgresql+asyncpg://root@127.0.0.1:5432/postgres")
NUM_BLOCKS = 512
BLOCK_SIZE = 16
# What a test stack's processes run with: one torch thread each; an api that waits at most 5 s
# for requests still admitted when it stops (30 s by default) and takes 1024 tokens per
# sequence, not the test model's whole context (4096): the messages the tests spell, and short
# default generations.
# WARM_UP_ROWS: the start-up warm-up runs (its code path is tested), over 4 batch sizes, not 64:
# every test server starting with the default added ~3 minutes to the suite on 2 cores.
TEST_SETTINGS = {
    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DRAIN_TIMEOUT_S": "5",
    "MAX_TOTAL_TOKENS": "1024", "ENABLE_PREFILL_LOGPROBS": "true", "WARM_UP_ROWS": "4",
}  # fmt: skip
# A test batcher's size: a small KV cache, batches of at most 64, a heartbeat that lapses in 4 s.
TEST_BATCHER_SIZING = (
    "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-batch-size", "64",
    "--heartbeat-ttl-s", "4",
)  # fmt: skip


def write_text_model(path: Path, *, chat_template: bool = True, seed: int = 7) -> Path:
    """A tiny Llama whose vocabulary is a tokenizer trained on Python's docs."""
    train_tokenizer(path)
    write_model(path, make_config("LlamaForCausalLM", max_position_embeddings=4096), seed=seed)
    if chat_template:
        add_chat_template(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- Postgres and Redis keys --------------------------------------------------------------------


def admin(statement: str, admin_url: str = ADMIN_URL) -> None:
    """Runs `statement` (CREATE/DROP DATABASE) on the server's admin database, outside a
    transaction."""

    async def run() -> None:
        engine = create_engine(admin_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        async with engine.connect() as conn:
            await conn.execute(text(statement))
        await engine.dispose()

    asyncio.run(run())


def create_database() -> str:
    """A new, empty database on `ADMIN_URL`'s server; its URL."""
    name = f"tgq_test_{secrets.token_hex(6)}"
    admin(f'CREATE DATABASE "{name}"')
    return make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    admin(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


@contextlib.contextmanager
def migrated_database() -> Iterator[str]:
    """A migrated Postgres database of its own, dropped after the block."""
    url = create_database()
    try:
        upgrade(url)
        yield url
    finally:
        drop_database(url)


def create_api_key(database_url: str, name: str, limits: KeyLimits = NO_LIMITS) -> str:
    """A stored API key with `limits`; its secret."""

    async def create() -> str:
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                _, secret = await api_keys.create_api_key(conn, name=name, limits=limits)
        finally:
            await engine.dispose()
        return secret

    return asyncio.run(create())


def delete_keys(redis_url: str, prefix: str) -> None:
    """Deletes every key under `prefix` (a stack's, a test's)."""
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


# --- the stack ----------------------------------------------------------------------------------


def process_env(**settings: str) -> dict[str, str]:
    """This process's environment for a child, without what would point it elsewhere, plus
    `settings`."""
    inherited = ("HOSTNAME", "PORT", "REDIS_URL", "DATABASE_URL")
    return {**{k: v for k, v in os.environ.items() if k not in inherited}, **settings}


@dataclass
class Stack:
    model_dir: Path
    database_url: str
    log_dir: Path
    prefix: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex}")
    port: int = field(default_factory=free_port)
    api_env: dict[str, str] = field(default_factory=dict)  # more settings of the api (and workers)
    batcher_options: tuple[str, ...] = ()  # after `batcher_sizing`: the last of a flag wins
    name: str = "api"  # of the api's log file
    redis_url: str | None = REDIS_URL  # None: the api runs its own batcher (embedded mode)
    settings: dict[str, str] = field(default_factory=lambda: dict(TEST_SETTINGS))  # every process's
    batcher_sizing: tuple[str, ...] = TEST_BATCHER_SIZING
    batcher_env: dict[str, str] = field(default_factory=dict)  # more settings of the batchers
    api: subprocess.Popen[bytes] | None = None
    batchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # Celery's

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_batcher(self, batcher_id: str = "b0") -> subprocess.Popen[bytes]:
        assert self.redis_url is not None, "an embedded api runs its own batcher"
        command = [
            sys.executable, "-m", "tgq.batcher", "--model-id", str(self.model_dir),
            "--redis-url", self.redis_url, "--prefix", self.prefix, "--batcher-id", batcher_id,
            *self.batcher_sizing, *self.batcher_options,
        ]  # fmt: skip
        env = process_env(**{**self.settings, **self.batcher_env})
        process = self._spawn(f"batcher-{batcher_id}", command, env)
        self.batchers.append(process)
        return process

    def service_env(self) -> dict[str, str]:
        """What the api and the Celery workers share: database, Redis, model, file storage."""
        redis = {} if self.redis_url is None else {"REDIS_URL": self.redis_url}
        shared = {
            "DATABASE_URL": self.database_url,
            "REDIS_PREFIX": self.prefix,
            **redis,
            "MODEL_ID": "tgq-test",
            "MODEL_DIR": str(self.model_dir),
            "FILE_STORAGE_DIR": str(self.log_dir / "files"),
        }
        return process_env(**{**self.settings, **shared, **self.api_env})

    def start_worker(self, name: str = "w0") -> subprocess.Popen[bytes]:
        """A Celery worker (one task at a time) that runs this stack's batches."""
        command = [
            sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", "worker", "--pool", "solo",
            "--concurrency", "1", "--loglevel", "INFO", "--hostname", f"{name}@{self.prefix}",
        ]  # fmt: skip
        process = self._spawn(f"worker-{name}", command, self.service_env())
        self.workers.append(process)
        return process

    def start_beat(self) -> subprocess.Popen[bytes]:
        """Celery beat: the reconciler (and retention) on their schedule."""
        command = [
            sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", "beat", "--loglevel",
            "INFO", "--schedule", str(self.log_dir / "beat-schedule"),
        ]  # fmt: skip
        process = self._spawn("beat", command, self.service_env())
        self.workers.append(process)
        return process

    def worker_log(self, name: str = "w0") -> str:
        return (self.log_dir / f"worker-{name}.log").read_text(errors="replace")[-4000:]

    def start_api(self, timeout_s: float = 60.0, *, healthy: bool = True) -> None:
        """Starts the api and waits until `/health` says 200 (or, with `healthy=False`, until it
        answers at all: an api without a live batcher is up but unhealthy)."""
        env = {**self.service_env(), "PORT": str(self.port)}
        self.api = self._spawn(self.name, [sys.executable, "-m", "tgq.api"], env)
        self.wait_healthy(timeout_s, healthy=healthy)

    def wait_healthy(self, timeout_s: float = 60.0, *, healthy: bool = True) -> None:
        log = self.log_dir / f"{self.name}.log"
        logs = sorted(self.log_dir.glob("batcher-*.log"))
        wait_healthy(self.url, self.api, log, timeout_s, healthy=healthy, other_logs=logs)

    def api_log(self) -> str:
        return (self.log_dir / f"{self.name}.log").read_text(errors="replace")[-4000:]

    def all_logs(self, chars: int = 2000) -> str:
        """The end of every log the stack's processes wrote (api, batchers, killed ones too,
        workers), each under its name, and which processes have exited: what a failure in a
        multi-process test needs to be read."""
        exited = [
            f"{' '.join(map(str, p.args[1:4]))}: exit {p.returncode}"  # type: ignore[index]
            for p in (self.api, *self.batchers, *self.workers)
            if p is not None and p.poll() is not None
        ]
        parts = [f"exited: {exited or 'none'}"]
        for path in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-chars:])
        return "\n".join(parts)

    def _spawn(
        self, log_name: str, command: list[str], env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{log_name}.log", "wb")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)

    def stop(self) -> None:
        """Stops every process (SIGTERM to all, then SIGKILL to any still there after 30 s) and
        deletes the prefix's keys."""
        processes = [p for p in (self.api, *self.batchers, *self.workers) if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            _wait_or_kill(process, 30)
        if self.redis_url is not None:
            # A private server may be gone already, and its keys with it.
            with contextlib.suppress(redis.ConnectionError):
                delete_keys(self.redis_url, self.prefix)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM (a clean stop drains), then SIGKILL if it has not exited within `timeout_s`."""
    if process.poll() is None:
        process.terminate()
    _wait_or_kill(process, timeout_s)


def _wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running(
    stack: Stack, *, batcher: bool = True, celery_worker: bool = False, timeout_s: float = 60.0
) -> Iterator[Stack]:
    """The stack's batcher (b0), optionally a Celery worker (it runs the batches), and its api
    (healthy within `timeout_s`; unhealthy but up without a batcher); all stopped after."""
    try:
        if batcher:
            stack.start_batcher()
        if celery_worker:
            stack.start_worker()
        stack.start_api(timeout_s, healthy=batcher)
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def running_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    celery_worker: bool = False,
    batcher_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A test stack on a database of its own: one batcher process (with `batcher_env`'s
    settings), optionally a Celery worker, and the api process."""
    stack_of = functools.partial(Stack, batcher_env=batcher_env or {})
    with (
        migrated_database() as url,
        running(stack_of(model_dir, url, log_dir), celery_worker=celery_worker) as stack,
    ):
        yield stack


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes] | None,
    log: Path,
    timeout_s: float,
    *,
    healthy: bool = True,
    other_logs: Sequence[Path] = (),
) -> None:
    """Polls `url`/health until it says 200 (or, with `healthy=False`, until it answers at all),
    failing at once if `process` exits; the timeout names the last answer and tails the logs."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the api exited {process.returncode} ({url}):\n{_tails(log, *other_logs)}"
            )
        try:
            response = httpx.get(f"{url}/health", timeout=2)
            if response.status_code == 200 or (not healthy and response.status_code == 503):
                return
            last = f"{response.status_code} {response.text}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(0.2)  # poll interval within the deadline
    raise TimeoutError(
        f"{url} not healthy within {timeout_s:g} s (last: {last}):\n{_tails(log, *other_logs)}"
    )


def _tails(*logs: Path) -> str:
    return "\n".join(
        f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:] if log.exists() else '(none)'}"
        for log in logs
    )
