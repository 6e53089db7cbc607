"""Fixtures of the transport and process tests: a Redis client of the shared server, a key prefix
of the test's own (its keys deleted after it), and the batcher processes a test starts (killed
after it)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    prefix = f"test-{uuid.uuid4().hex}"
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
