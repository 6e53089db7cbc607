"""Redis loses everything mid-run (every key of the deployment deleted, as FLUSHALL would; the
shared test Redis is not flushed whole): the reconciler rebuilds the work from Postgres and
every accepted job completes, one result per item."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import text

from tests.api.stack import REDIS_URL, Stack, create_database, drop_database
from tgq.api.db import create_engine
from tgq.api.db.migrate import upgrade

pytestmark = pytest.mark.timeout(240)
NUM_JOBS = 12


@pytest.fixture
def reconciling(text_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    url = create_database()
    upgrade(url)
    env = {"RECONCILE_INTERVAL_S": "0.5", "RECONCILE_GRACE_S": "0.5"}
    # A batch of 4: most jobs are still queued in Redis when it is emptied.
    stack = Stack(
        text_model_dir, url, tmp_path, api_env=env, batcher_options=("--max-batch-size", "4")
    )
    try:
        stack.start_batcher()
        stack.start_api()
        yield stack
    finally:
        stack.stop()
        drop_database(url)


async def result_counts(url: str) -> tuple[int, int]:
    engine = create_engine(url)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(text("SELECT count(*), count(DISTINCT request_id) FROM results"))
        ).one()
    await engine.dispose()
    return rows[0], rows[1]


def test_a_flushed_redis_loses_no_accepted_job(reconciling: Stack) -> None:
    client = httpx.Client(base_url=reconciling.url, timeout=30)
    params = {"max_new_tokens": 300, "ignore_eos": True}
    job_ids = [
        client.post("/v1/jobs", json={"prompt": f"job {i}", "parameters": params}).json()["id"]
        for i in range(NUM_JOBS)
    ]
    deadline = time.monotonic() + 30
    while client.get(f"/v1/jobs/{job_ids[0]}").json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server = redis.Redis.from_url(REDIS_URL)
    keys = list(server.scan_iter(match=f"{reconciling.prefix}:*"))
    server.delete(*keys)  # the deployment's Redis is empty now: queues, tokens, finals, groups
    server.close()
    deadline = time.monotonic() + 120
    statuses: list[str] = []
    while time.monotonic() < deadline:
        statuses = [client.get(f"/v1/jobs/{job_id}").json()["status"] for job_id in job_ids]
        if all(status == "succeeded" for status in statuses):
            break
        time.sleep(0.2)
    assert statuses == ["succeeded"] * NUM_JOBS, reconciling.api_log()
    for job_id in job_ids:
        (result,) = client.get(f"/v1/jobs/{job_id}").json()["results"]
        assert result["completion_tokens"] == 300
    assert asyncio.run(result_counts(reconciling.database_url)) == (NUM_JOBS, NUM_JOBS)
    log = (reconciling.log_dir / "api.log").read_text()
    counts = re.findall(r"reconciler: re-enqueued (\d+) requests", log)
    assert sum(map(int, counts)) >= NUM_JOBS // 2  # the queued ones came back from Postgres
