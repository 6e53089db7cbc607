"""The reconciler on Celery, for real: a worker process and a beat process on Redis, with
Postgres holding jobs whose requests Redis never got; beat's schedule alone brings them back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.api.conftest import _create_database, _drop_database
from tests.api.stack import REDIS_URL, ROOT
from tgq.api.db import create_engine, store
from tgq.api.db.migrate import upgrade
from tgq.api.generation import new_job_id, request_id_of
from tgq.api.service import job_params
from tgq.api.settings import Settings
from tgq.api.validated import GenerationParams
from tgq.batcher.request import Priority
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.bulk.celery_app import make_app
from tgq.gpu_worker.plan import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def deployment(text_model_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    url = _create_database()
    upgrade(url)
    prefix = f"test-{uuid.uuid4().hex}"
    env = {
        "DATABASE_URL": url,
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": prefix,
        "MODEL_DIR": str(text_model_dir),
        "RECONCILE_INTERVAL_S": "0.5",
        "RECONCILE_GRACE_S": "0",
    }
    try:
        yield env
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
        _drop_database(url)


def start(kind: str, env: dict[str, str], log_dir: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tgq.bulk.celery_app",
        kind,
        "--loglevel",
        "INFO",
    ]
    if kind == "worker":
        command += ["--pool", "solo", "--concurrency", "1"]
    else:
        command += ["--schedule", str(log_dir / "beat-schedule")]
    log = open(log_dir / f"{kind}.log", "wb")  # noqa: SIM115
    inherited = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    return subprocess.Popen(command, cwd=ROOT, env={**inherited, **env}, stdout=log, stderr=log)


def lost_job(database_url: str, num_items: int) -> str:
    """A job committed to Postgres whose requests never reached Redis."""
    job_id = new_job_id()
    params = GenerationParams(sampling=SamplingParams(), max_new_tokens=4)
    job = store.NewJob(
        job_id=job_id,
        kind="job",
        route="/v1/jobs",
        priority=int(Priority.BULK),
        model="m",
        params=job_params(params),
        items=[(request_id_of(job_id, i), [5, 6, 7]) for i in range(num_items)],
    )

    async def create() -> None:
        engine = create_engine(database_url)
        async with engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        await engine.dispose()

    asyncio.run(create())
    return job_id


def test_the_app_accepts_json_only_and_acks_late() -> None:
    conf = make_app(Settings.model_validate({"redis_prefix": "x"})).conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.broker_transport_options == {"global_keyprefix": "x:celery:"}
    assert conf.beat_schedule["reconcile"]["task"] == "tgq.reconcile"


def test_beat_and_a_worker_re_enqueue_what_redis_lost(
    deployment: dict[str, str], tmp_path: Path
) -> None:
    job_id = lost_job(deployment["DATABASE_URL"], num_items=3)
    prefix = deployment["REDIS_PREFIX"]
    api = BlockingApiTransport.from_url(REDIS_URL, prefix)
    batcher = RedisBatcherTransport(redis.Redis.from_url(REDIS_URL), prefix)
    processes = [start("worker", deployment, tmp_path), start("beat", deployment, tmp_path)]
    try:
        deadline = time.monotonic() + 60
        while api.queue_depth() < 3:
            for process in processes:
                assert process.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
        pulled = batcher.pull("b0", 10, 0)
        assert sorted(d.request.request_id for d in pulled) == [
            request_id_of(job_id, i) for i in range(3)
        ]
        assert all(d.request.stopping.max_new_tokens == 4 for d in pulled)
        time.sleep(1.5)  # more beats: nothing is enqueued twice (Redis knows them now)
        assert api.queue_depth() == 3  # the 3 pulled, still pending, and nothing else
    finally:
        api.close()
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert "Task tgq.reconcile" in (tmp_path / "worker.log").read_text()
