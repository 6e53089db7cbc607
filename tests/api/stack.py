"""The real stack for HTTP tests: a tiny text model (random weights, a tokenizer trained here, a
chat template), a batcher process on Redis, and the api as a uvicorn process on Postgres.

`Stack` starts and stops the processes; the fixtures in `conftest.py` share one per module.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from tgq.devtools.demo import add_chat_template
from tgq.devtools.random_model import make_config, write_model
from tgq.devtools.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
NUM_BLOCKS = 512
BLOCK_SIZE = 16


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


def _env(**extra: str) -> dict[str, str]:
    inherited = ("HOSTNAME", "PORT", "REDIS_URL", "DATABASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    # A test's api that stops waits at most 5 s for requests still admitted (30 s by default),
    # and takes 1024 tokens per sequence, not the test model's whole context (4096): the
    # messages the tests spell, and short default generations.
    quick = {
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DRAIN_TIMEOUT_S": "5",
        "MAX_TOTAL_TOKENS": "1024",
    }  # fmt: skip
    return {**env, **quick, **extra}


@dataclass
class Stack:
    model_dir: Path
    database_url: str
    log_dir: Path
    prefix: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex}")
    port: int = field(default_factory=free_port)
    api_env: dict[str, str] = field(default_factory=dict)
    batcher_options: tuple[str, ...] = ()
    name: str = "api"  # of the api's log file
    redis_url: str | None = REDIS_URL  # None: the api runs its own batcher (embedded mode)
    api: subprocess.Popen[bytes] | None = None
    batchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # Celery's

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_batcher(self, batcher_id: str = "b0") -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "tgq.batcher", "--model-id", str(self.model_dir),
            "--redis-url", REDIS_URL, "--prefix", self.prefix, "--batcher-id", batcher_id,
            "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--max-batch-size", "64", "--heartbeat-ttl-s", "4", *self.batcher_options,
        ]  # fmt: skip
        log = open(self.log_dir / f"batcher-{batcher_id}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=log)
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
        return _env(**{**shared, **self.api_env})

    def start_worker(self, name: str = "w0") -> subprocess.Popen[bytes]:
        """A Celery worker (one task at a time) that runs this stack's batches."""
        command = [
            sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", "worker", "--pool", "solo",
            "--concurrency", "1", "--loglevel", "INFO", "--hostname", f"{name}@{self.prefix}",
        ]  # fmt: skip
        log = open(self.log_dir / f"worker-{name}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            command, cwd=ROOT, env=self.service_env(), stdout=log, stderr=log
        )
        self.workers.append(process)
        return process

    def start_beat(self) -> subprocess.Popen[bytes]:
        """Celery beat: the reconciler (and retention) on their schedule."""
        command = [
            sys.executable, "-m", "celery", "-A", "tgq.bulk.celery_app", "beat", "--loglevel",
            "INFO", "--schedule", str(self.log_dir / "beat-schedule"),
        ]  # fmt: skip
        log = open(self.log_dir / "beat.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            command, cwd=ROOT, env=self.service_env(), stdout=log, stderr=log
        )
        self.workers.append(process)
        return process

    def worker_log(self, name: str = "w0") -> str:
        return (self.log_dir / f"worker-{name}.log").read_text(errors="replace")[-4000:]

    def start_api(self, timeout_s: float = 60.0, *, healthy: bool = True) -> None:
        """Starts the api and waits until `/health` says 200 (or, with `healthy=False`, until it
        answers at all: an api without a live batcher is up but unhealthy)."""
        env = {**self.service_env(), "PORT": str(self.port)}
        log = open(self.log_dir / f"{self.name}.log", "wb")  # noqa: SIM115
        self.api = subprocess.Popen(
            [sys.executable, "-m", "tgq.api"], cwd=ROOT, env=env, stdout=log, stderr=log
        )
        self.wait_healthy(timeout_s, healthy=healthy)

    def wait_healthy(self, timeout_s: float = 60.0, *, healthy: bool = True) -> None:
        log = self.log_dir / f"{self.name}.log"
        logs = sorted(self.log_dir.glob("batcher-*.log"))
        wait_healthy(self.url, self.api, log, timeout_s, healthy=healthy, other_logs=logs)

    def api_log(self) -> str:
        return (self.log_dir / f"{self.name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        processes = [p for p in (self.api, *self.batchers, *self.workers) if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{self.prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


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
