"""The reconciler against real Postgres and Redis: what Redis lost is enqueued again, exactly as
first submitted, and nothing else is."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import store
from tgq.api.ids import new_job_id
from tgq.api.reconciler import EPOCH_SETTLE_S, reconcile_once
from tgq.api.settings import Settings
from tgq.api.submit import job_items, job_params, job_requests, rebuild_request
from tgq.api.validated import GenerationParams
from tgq.api.validation import validate_tokens
from tgq.batcher.messages import SubmitRequest
from tgq.batcher.request import Priority
from tgq.batcher.transport.aio import AsyncRedisApiTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.batcher.transport.redis_keys import RedisKeys
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
SETTINGS = Settings.model_validate({})
EOS = frozenset({2})


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def submitted(num_copies: int = 2) -> tuple[store.NewJob, list[SubmitRequest]]:
    """A job as the api records it: two prompts, `num_copies` seeded samples each."""
    sampling = SamplingParams(temperature=0.7, seed=11)
    params = GenerationParams(
        sampling=sampling, max_new_tokens=None, stop_strings=("\n\n",), num_choices=num_copies
    )
    job_id = new_job_id()
    validated = [
        validate_tokens(
            prompt="p",
            token_ids=prompt_ids,
            params=params,
            settings=SETTINGS,
            priority=Priority.BULK,
            eos_token_ids=EOS,
        )
        for prompt_ids in ([5, 6, 7], [8, 9])
    ]
    requests = job_requests(job_id, validated)
    job = store.NewJob(
        job_id=job_id,
        kind="job",
        route="/v1/jobs",
        priority=int(Priority.BULK),
        model="m",
        params=job_params(params),
        items=job_items(requests),
    )
    return job, requests


def test_lost_items_are_enqueued_again_as_first_submitted(
    pg_engine: AsyncEngine, prefix: str
) -> None:
    job, requests = submitted()
    batcher = RedisBatcherTransport(redis.Redis.from_url(REDIS_URL), prefix)

    async def run() -> tuple[int, int]:
        transport = AsyncRedisApiTransport.from_url(REDIS_URL, prefix)
        async with pg_engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        await transport.submit(requests[:1])  # the rest was lost (say, Redis restarted)
        first = await reconcile_once(
            db=pg_engine, transport=transport, settings=SETTINGS, eos_token_ids=EOS,
            older_than_s=0,
        )  # fmt: skip
        again = await reconcile_once(
            db=pg_engine, transport=transport, settings=SETTINGS, eos_token_ids=EOS,
            older_than_s=0,
        )  # fmt: skip
        await transport.close()
        return first, again

    assert asyncio.run(run()) == (3, 0)  # the second pass finds nothing missing
    pulled = {d.request.request_id: d.request for d in batcher.pull("b0", 10, 0)}
    assert len(pulled) == 4
    for original in requests:
        expected = original if original is requests[0] else dataclasses.replace(original, attempt=2)
        assert pulled[original.request_id] == expected


def test_young_and_finished_items_are_left_alone(pg_engine: AsyncEngine, prefix: str) -> None:
    job, _ = submitted(num_copies=1)

    async def run() -> tuple[int, int]:
        transport = AsyncRedisApiTransport.from_url(REDIS_URL, prefix)
        async with pg_engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        young = await reconcile_once(
            db=pg_engine, transport=transport, settings=SETTINGS, eos_token_ids=EOS,
            older_than_s=60,
        )  # fmt: skip
        async with pg_engine.begin() as conn:
            await store.cancel_job(conn, job_id=job.job_id)
        cancelled = await reconcile_once(
            db=pg_engine, transport=transport, settings=SETTINGS, eos_token_ids=EOS,
            older_than_s=0,
        )  # fmt: skip
        await transport.close()
        return young, cancelled

    assert asyncio.run(run()) == (0, 0)


def test_rebuild_resolves_max_new_tokens_as_validation_does() -> None:
    job, requests = submitted(num_copies=1)
    record = store.JobRecord(
        id=job.job_id, kind="job", route=None, status="queued", priority=0, model="m",
        params=job.params, num_items=2, num_items_done=0, num_items_failed=0, prompt_tokens=0,
        completion_tokens=0, idempotency_scope="", idempotency_key=None,
        idempotency_fingerprint=None, api_key_id=None, deadline=None, created_at=None,  # type: ignore[arg-type]
        started_at=None, finished_at=None, error=None, metadata=None,
    )  # fmt: skip
    for index, original in enumerate(requests):
        item = store.ItemRecord(
            job.job_id, index, original.request_id, original.prompt_token_ids, "queued", 0,
            None,  # type: ignore[arg-type]
            None, None,
        )  # fmt: skip
        rebuilt = rebuild_request(item, record, SETTINGS, EOS)
        assert rebuilt.stopping == original.stopping  # 1024 - prompt length, EOS, stop strings
        assert rebuilt.sampling == original.sampling and rebuilt.attempt == 2


def test_interactive_items_are_never_rerun_and_fail_once_the_epoch_has_settled(
    pg_engine: AsyncEngine, prefix: str
) -> None:
    """A lost interactive item is its client's replica's to enqueue again; the reconciler fails
    it, once every replica has had time to (the epoch is `EPOCH_SETTLE_S` old)."""
    job, _ = submitted(num_copies=1)
    job = dataclasses.replace(job, kind="interactive", route="/generate")
    server = redis.Redis.from_url(REDIS_URL)
    batcher = RedisBatcherTransport(server, prefix)

    async def reconcile(transport: AsyncRedisApiTransport) -> tuple[int, str]:
        count = await reconcile_once(
            db=pg_engine, transport=transport, settings=SETTINGS, eos_token_ids=EOS,
            older_than_s=0,
        )  # fmt: skip
        async with pg_engine.connect() as conn:
            record = await store.get_job(conn, job_id=job.job_id)
        assert record is not None
        return count, record.status

    async def run() -> list[tuple[int, str]]:
        transport = AsyncRedisApiTransport.from_url(REDIS_URL, prefix)
        async with pg_engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        assert (await transport.epoch()).is_new
        young = await reconcile(transport)
        settled = time.time() - EPOCH_SETTLE_S - 1
        server.set(RedisKeys(prefix).epoch, f"{settled:.3f}:test")
        old = await reconcile(transport)
        await transport.close()
        return [young, old]

    assert asyncio.run(run()) == [(0, "queued"), (0, "failed")]
    assert batcher.pull("b0", 10, 0) == []  # nothing was enqueued
    items = asyncio.run(_items(pg_engine, job.job_id))
    assert [item.status for item in items] == ["failed", "failed"]


async def _items(engine: AsyncEngine, job_id: str) -> list[store.ItemRecord]:
    async with engine.connect() as conn:
        return await store.get_items(conn, job_id=job_id)
