"""The reconciler on Celery, for real: a worker process and a beat process on Redis, with
Postgres holding jobs whose requests Redis never got; beat's schedule alone brings them back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.api.stack import REDIS_URL, Stack, migrated_database
from tests.polling import eventually
from tgq.api.db import create_engine, store
from tgq.api.ids import new_job_id, request_id_of
from tgq.api.settings import Settings
from tgq.api.submit import job_params
from tgq.api.validated import GenerationParams
from tgq.batcher.request import Priority
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.bulk.celery_app import make_app
from tgq.gpu_worker.plan import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def stack(text_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    """A deployment without an api or a batcher: Postgres, Redis, and (started by the test) a
    Celery worker and beat, whose reconciler runs every 0.5 s."""
    env = {"RECONCILE_INTERVAL_S": "0.5", "RECONCILE_GRACE_S": "0"}
    with migrated_database() as url:
        deployment = Stack(text_model_dir, url, tmp_path, api_env=env)
        try:
            yield deployment
        finally:
            deployment.stop()


def num_reconciles(stack: Stack) -> int:
    """Reconciler runs the worker has finished so far (Celery logs each task's success)."""
    lines = (stack.log_dir / "worker-w0.log").read_text(errors="replace").splitlines()
    return sum("Task tgq.reconcile[" in line and "] succeeded in" in line for line in lines)


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


def test_beat_and_a_worker_re_enqueue_what_redis_lost(stack: Stack) -> None:
    job_id = lost_job(stack.database_url, num_items=3)
    api = BlockingApiTransport.from_url(REDIS_URL, stack.prefix)
    batcher = RedisBatcherTransport(redis.Redis.from_url(REDIS_URL), stack.prefix)
    processes = [stack.start_worker(), stack.start_beat()]

    def queued(num_requests: int) -> bool:
        for process in processes:
            assert process.poll() is None, stack.worker_log()
        return api.queue_depth() >= num_requests

    try:
        eventually(lambda: queued(3), 60, "the reconciler re-enqueued 3 requests")
        pulled = batcher.pull("b0", 10, 0)
        assert sorted(d.request.request_id for d in pulled) == [
            request_id_of(job_id, i) for i in range(3)
        ]
        assert all(d.request.stopping.max_new_tokens == 4 for d in pulled)
        # Two more runs of the reconciler see them in Redis and enqueue nothing again.
        runs = num_reconciles(stack)
        eventually(lambda: num_reconciles(stack) >= runs + 2, 30, "two more reconciler runs")
        assert api.queue_depth() == 3  # the 3 pulled, still pending, and nothing else
    finally:
        api.close()
    assert "Task tgq.reconcile" in stack.worker_log()
