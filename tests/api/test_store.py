"""The database layer against real Postgres (and the embedded SQLite): migrations, the schema
check, jobs, idempotency, results under concurrency, cancellation, api keys, retention."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import NullPool

from tgq.api import db
from tgq.api.db import api_keys, create_engine, models, normalize_url, store, warm_up
from tgq.api.db.migrate import (
    SchemaNotMigratedError,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from tgq.api.db.store import JobRecord, NewJob, NewResult

T = TypeVar("T")


def run(engine: AsyncEngine, body: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """Run `body` in one transaction on `engine`, in a fresh event loop."""

    async def in_transaction() -> T:
        async with engine.begin() as conn:
            return await body(conn)

    return asyncio.run(in_transaction())


def job_fields(job_id: str, num_items: int = 1, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "job_id": job_id,
        "kind": "job",
        "route": "/v1/jobs",
        "priority": 1,
        "model": "tgq-demo",
        "params": {"max_new_tokens": 8, "temperature": 0.0},
        "items": [(f"{job_id}.{i}", [1, 2, i]) for i in range(num_items)],
    }
    return {**fields, **overrides}


def result(job_id: str, index: int, reason: str = "stop", *, attempt: int = 1) -> NewResult:
    return NewResult(
        job_id=job_id,
        item_index=index,
        request_id=f"{job_id}.{index}",
        text="hi",
        token_ids=[5, 6],
        logprobs=[-0.5, None],
        finish_reason=reason,
        finish_detail=None,
        num_prompt_tokens=3,
        num_output_tokens=2,
        num_cached_tokens=0,
        attempt=attempt,
        batcher_id="b1",
    )


async def create(conn: AsyncConnection, job_id: str, num_items: int = 1, **kw: Any) -> JobRecord:
    job, created = await store.create_job(conn, **job_fields(job_id, num_items, **kw))
    assert created
    return job


async def get(conn: AsyncConnection, job_id: str) -> JobRecord:
    job = await store.get_job(conn, job_id=job_id)
    assert job is not None
    return job


async def count(conn: AsyncConnection, table: Any) -> int:
    return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())


# --- migrations and the schema check ---------------------------------------------------------


def test_migrations_round_trip(empty_pg_url: str) -> None:
    assert current_revision(empty_pg_url) is None
    upgrade(empty_pg_url)
    assert current_revision(empty_pg_url) == head_revision() == "0005"
    downgrade(empty_pg_url, "base")
    assert current_revision(empty_pg_url) is None
    upgrade(empty_pg_url)
    assert current_revision(empty_pg_url) == head_revision()


def _schema_diff(connection: Connection) -> list[Any]:
    return list(compare_metadata(MigrationContext.configure(connection), models.metadata))


def test_migration_creates_the_models_schema(pg_engine: AsyncEngine) -> None:
    async def diff() -> list[Any]:
        async with pg_engine.connect() as conn:
            return await conn.run_sync(_schema_diff)

    assert asyncio.run(diff()) == []


def test_check_schema_refuses_an_unmigrated_database(empty_pg_url: str) -> None:
    engine = create_engine(empty_pg_url, poolclass=NullPool)
    with pytest.raises(SchemaNotMigratedError) as raised:
        asyncio.run(check_schema(engine))
    assert str(raised.value) == (
        f"database schema is at revision none, this tgq needs {head_revision()}: "
        "run `tgq migrate` (or `python -m tgq.api.db.migrate`)"
    )
    upgrade(empty_pg_url)
    asyncio.run(check_schema(engine))
    asyncio.run(engine.dispose())


def test_warm_up_fills_the_pool(pg_url: str) -> None:
    """The first burst of requests finds its connections open and idle in the pool."""
    engine = create_engine(pg_url)

    async def main() -> tuple[int, int]:
        await warm_up(engine, 4)
        return engine.pool.checkedin(), engine.pool.checkedout()  # type: ignore[attr-defined]

    try:
        assert asyncio.run(main()) == (4, 0)
    finally:
        asyncio.run(engine.dispose())


def test_normalize_url() -> None:
    assert normalize_url("postgresql://u:p%40ss@h/db") == "postgresql+asyncpg://u:p%40ss@h/db"
    assert normalize_url("postgresql+asyncpg://h/db") == "postgresql+asyncpg://h/db"
    assert normalize_url("sqlite:///tgq.db") == "sqlite+aiosqlite:///tgq.db"


# --- create, read, list ----------------------------------------------------------------------


def test_create_and_get(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        made = await create(conn, "job_a", 2, metadata={"tag": "x"})
        job = await get(conn, "job_a")
        assert job == made
        assert (job.status, job.num_items, job.num_items_done, job.params) == (
            "queued",
            2,
            0,
            {"max_new_tokens": 8, "temperature": 0.0},
        )
        assert job.created_at.tzinfo is not None and job.metadata == {"tag": "x"}
        items = await store.get_items(conn, job_id="job_a")
        assert [(i.item_index, i.request_id, i.prompt_token_ids) for i in items] == [
            (0, "job_a.0", [1, 2, 0]),
            (1, "job_a.1", [1, 2, 1]),
        ]
        assert await store.get_job_for_request(conn, request_id="job_a.1") == ("job_a", 1)
        assert await store.get_job_for_request(conn, request_id="nope") is None
        assert await store.get_job(conn, job_id="nope") is None

    run(pg_engine, body)


def test_get_job_scoped_to_an_api_key(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        key, _ = await api_keys.create_api_key(conn, name="k")
        await create(conn, "job_k", api_key_id=key.id)
        assert await store.get_job(conn, job_id="job_k", api_key_id=key.id) is not None
        assert await store.get_job(conn, job_id="job_k", api_key_id=key.id + 1) is None

    run(pg_engine, body)


def test_create_jobs_in_one_batch(pg_engine: AsyncEngine) -> None:
    new = [NewJob(**job_fields(f"job_{i}", kind="interactive")) for i in range(50)]

    async def body(conn: AsyncConnection) -> None:
        made = await store.create_jobs(conn, jobs=new)
        assert [job.id for job in made] == [f"job_{i}" for i in range(50)]
        assert await count(conn, models.job_items) == 50
        assert await get(conn, "job_7") == made[7]
        with pytest.raises(ValueError, match="without an idempotency key"):
            keyed = NewJob(**job_fields("job_x", idempotency_key="k"))
            await store.create_jobs(conn, jobs=[keyed])

    run(pg_engine, body)


def test_list_jobs_pages_newest_first(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> list[list[str]]:
        for i in range(5):
            await create(conn, f"job_{i}")
        await store.cancel_job(conn, job_id="job_3")
        first = await store.list_jobs(conn, limit=2)
        second = await store.list_jobs(conn, limit=2, after=first[-1].id)
        third = await store.list_jobs(conn, limit=2, after=second[-1].id)
        queued = await store.list_jobs(conn, limit=10, status="queued")
        return [[j.id for j in page] for page in (first, second, third, queued)]

    # jobs created in one transaction share created_at: the id breaks the tie
    assert run(pg_engine, body) == [
        ["job_4", "job_3"],
        ["job_2", "job_1"],
        ["job_0"],
        ["job_4", "job_2", "job_1", "job_0"],
    ]


def test_list_jobs_across_timestamps_and_keys(pg_engine: AsyncEngine) -> None:
    key = run(pg_engine, lambda conn: api_keys.create_api_key(conn, name="k"))[0]
    for job_id in ("job_b", "job_a", "job_c"):  # created in this order, separate transactions
        run(pg_engine, functools.partial(create, job_id=job_id, api_key_id=key.id))
    run(pg_engine, lambda conn: create(conn, "job_other"))

    async def body(conn: AsyncConnection) -> list[list[str]]:
        mine = await store.list_jobs(conn, limit=2, api_key_id=key.id)
        rest = await store.list_jobs(conn, limit=2, api_key_id=key.id, after=mine[-1].id)
        unknown = await store.list_jobs(conn, limit=2, after="job_missing")
        return [[j.id for j in page] for page in (mine, rest, unknown)]

    assert run(pg_engine, body) == [["job_c", "job_a"], ["job_b"], []]


# --- idempotency -----------------------------------------------------------------------------


def test_same_idempotency_key_gives_the_same_job(pg_engine: AsyncEngine) -> None:
    keyed: dict[str, Any] = {"idempotency_key": "k1", "idempotency_scope": "7", "fingerprint": "f1"}

    async def body(conn: AsyncConnection) -> None:
        first, created = await store.create_job(conn, **job_fields("job_a", **keyed))
        again, created_again = await store.create_job(
            conn, **job_fields("job_b", **{**keyed, "fingerprint": "f2"})
        )
        assert (created, created_again) == (True, False)
        assert again == first and again.idempotency_fingerprint == "f1"
        other_scope = {**keyed, "idempotency_scope": "8"}
        _, created_elsewhere = await store.create_job(conn, **job_fields("job_c", **other_scope))
        assert created_elsewhere
        assert await count(conn, models.jobs) == 2
        assert await count(conn, models.job_items) == 2

    run(pg_engine, body)


def test_concurrent_creates_with_one_key_make_one_job(pg_engine: AsyncEngine) -> None:
    async def create_in_own_transaction(job_id: str) -> tuple[JobRecord, bool]:
        async with pg_engine.begin() as conn:
            fields = job_fields(job_id, 2, idempotency_key="same")
            return await store.create_job(conn, **fields)

    async def race() -> list[tuple[JobRecord, bool]]:
        return list(await asyncio.gather(*(create_in_own_transaction(f"job_{i}") for i in "ab")))

    (job_a, created_a), (job_b, created_b) = asyncio.run(race())
    assert sorted([created_a, created_b]) == [False, True]
    assert job_a.id == job_b.id
    assert run(pg_engine, lambda conn: count(conn, models.jobs)) == 1
    assert run(pg_engine, lambda conn: count(conn, models.job_items)) == 2


def test_job_ids_and_request_ids_are_unique(pg_engine: AsyncEngine) -> None:
    run(pg_engine, lambda conn: create(conn, "job_a"))
    with pytest.raises(IntegrityError):
        run(pg_engine, lambda conn: create(conn, "job_a"))
    with pytest.raises(IntegrityError):
        run(pg_engine, lambda conn: create(conn, "job_b", items=[("job_a.0", [1])]))


# --- results ---------------------------------------------------------------------------------


def test_record_results_is_idempotent_and_finishes_the_job(pg_engine: AsyncEngine) -> None:
    run(pg_engine, lambda conn: create(conn, "job_a", 2))
    first = run(pg_engine, lambda conn: store.record_results(conn, results=[result("job_a", 0)]))
    job = run(pg_engine, lambda conn: get(conn, "job_a"))
    assert first == [True]
    assert (job.status, job.num_items_done, job.prompt_tokens, job.completion_tokens) == (
        "running",
        1,
        3,
        2,
    )
    assert job.started_at is not None and job.finished_at is None

    again = [result("job_a", 0, attempt=2), result("job_a", 1, "length")]
    assert run(pg_engine, lambda conn: store.record_results(conn, results=again)) == [False, True]
    assert run(pg_engine, lambda conn: store.record_results(conn, results=again)) == [False, False]

    async def check(conn: AsyncConnection) -> None:
        job = await get(conn, "job_a")
        assert (job.status, job.num_items_done, job.num_items_failed) == ("succeeded", 2, 0)
        assert (job.prompt_tokens, job.completion_tokens) == (6, 4)
        assert job.finished_at is not None and job.started_at == first_started
        results = await store.get_results(conn, job_id="job_a")
        assert [(r.item_index, r.attempt, r.finish_reason) for r in results] == [
            (0, 1, "stop"),
            (1, 1, "length"),
        ]
        assert results[0].token_ids == [5, 6] and results[0].logprobs == [-0.5, None]
        items = await store.get_items(conn, job_id="job_a")
        assert [i.status for i in items] == ["succeeded", "succeeded"]
        assert await count(conn, models.usage) == 2

    first_started = job.started_at
    run(pg_engine, check)


def test_job_fails_only_when_every_item_failed(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> list[tuple[str, int]]:
        await create(conn, "job_mixed", 2)
        await create(conn, "job_bad", 2)
        outcomes = [result("job_mixed", 0, "failed"), result("job_mixed", 1, "stop")]
        outcomes += [result("job_bad", 0, "rejected"), result("job_bad", 1, "deadline")]
        assert await store.record_results(conn, results=outcomes) == [True] * 4
        jobs = [await get(conn, job_id) for job_id in ("job_mixed", "job_bad")]
        return [(job.status, job.num_items_failed) for job in jobs]

    assert run(pg_engine, body) == [("succeeded", 1), ("failed", 2)]


def test_results_for_unknown_items_are_ignored(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> list[bool]:
        await create(conn, "job_a")
        return await store.record_results(conn, results=[result("job_a", 5), result("job_z", 0)])

    assert run(pg_engine, body) == [False, False]
    assert run(pg_engine, lambda conn: store.record_results(conn, results=[])) == []


def test_concurrent_results_of_one_job_count_once_each(pg_engine: AsyncEngine) -> None:
    num_items = 40
    run(pg_engine, lambda conn: create(conn, "job_a", num_items))

    async def replica(indices: list[int]) -> list[bool]:
        recorded = []
        for index in indices:  # one transaction per result, interleaved with the other replica
            async with pg_engine.begin() as conn:
                reason = "failed" if index % 4 == 0 else "stop"
                recorded += await store.record_results(
                    conn, results=[result("job_a", index, reason)]
                )
        return recorded

    async def race() -> list[list[bool]]:
        evens, odds = list(range(0, num_items, 2)), list(range(1, num_items, 2))
        everything = list(range(num_items))  # a redelivery of every result, racing the others
        return list(await asyncio.gather(replica(evens), replica(odds), replica(everything)))

    outcomes = asyncio.run(race())
    assert sum(map(sum, outcomes)) == num_items

    async def check(conn: AsyncConnection) -> None:
        job = await get(conn, "job_a")
        assert (job.status, job.num_items_done, job.num_items_failed) == ("succeeded", 40, 10)
        assert (job.prompt_tokens, job.completion_tokens) == (3 * num_items, 2 * num_items)
        assert await count(conn, models.results) == num_items
        assert await count(conn, models.usage) == num_items

    run(pg_engine, check)


def test_mark_running(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        await create(conn, "job_a", 2)
        assert await store.mark_running(conn, request_ids=["job_a.0"]) == 1
        assert await store.mark_running(conn, request_ids=["job_a.0", "job_a.1"]) == 1
        assert await store.mark_running(conn, request_ids=[]) == 0
        job = await get(conn, "job_a")
        assert job.status == "running" and job.started_at is not None
        assert [i.status for i in await store.get_items(conn, job_id="job_a")] == ["running"] * 2

    run(pg_engine, body)


# --- cancellation ----------------------------------------------------------------------------


def test_cancel_then_only_abort_results_are_written(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        await create(conn, "job_a", 3)
        assert await store.record_results(conn, results=[result("job_a", 0)]) == [True]
        assert await store.cancel_job(conn, job_id="job_a") == ["job_a.1", "job_a.2"]
        late = [result("job_a", 1, "stop"), result("job_a", 2, "abort")]
        assert await store.record_results(conn, results=late) == [False, True]
        assert await store.record_results(conn, results=late) == [False, False]
        job = await get(conn, "job_a")
        assert (job.status, job.num_items_done, job.num_items_failed) == ("cancelled", 2, 0)
        assert job.completion_tokens == 4
        items = await store.get_items(conn, job_id="job_a")
        assert [i.status for i in items] == ["succeeded", "cancelled", "cancelled"]
        results = await store.get_results(conn, job_id="job_a")
        assert [(r.item_index, r.finish_reason) for r in results] == [(0, "stop"), (2, "abort")]
        assert await store.cancel_job(conn, job_id="job_a") == []
        assert await store.cancel_job(conn, job_id="job_missing") is None

    run(pg_engine, body)


def test_cancel_of_a_finished_job_changes_nothing(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        await create(conn, "job_a")
        await store.record_results(conn, results=[result("job_a", 0)])
        before = await get(conn, "job_a")
        assert await store.cancel_job(conn, job_id="job_a") == []
        assert await get(conn, "job_a") == before

    run(pg_engine, body)


def test_fail_jobs_withdraws_open_jobs_and_later_results_are_not_written(
    pg_engine: AsyncEngine,
) -> None:
    async def body(conn: AsyncConnection) -> None:
        await create(conn, "job_a", 2)
        await create(conn, "job_b")
        await store.record_results(conn, results=[result("job_b", 0)])  # finished: kept
        reason = "unavailable: the queue could not take it"
        failed = await store.fail_jobs(conn, job_ids=["job_b", "job_a", "job_a"], error=reason)
        assert failed == ["job_a.0", "job_a.1"]
        job = await get(conn, "job_a")
        assert (job.status, job.error, job.finished_at is not None) == ("failed", reason, True)
        items = await store.get_items(conn, job_id="job_a")
        assert [i.status for i in items] == ["failed", "failed"]
        assert (await get(conn, "job_b")).status == "succeeded"
        assert await store.record_results(conn, results=[result("job_a", 0)]) == [False]
        assert await store.get_results(conn, job_id="job_a") == []
        assert await store.fail_jobs(conn, job_ids=["job_a"], error="again") == []
        assert (await get(conn, "job_a")).error == reason

    run(pg_engine, body)


def test_abort_of_a_running_item_completes_the_job(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> tuple[str, str]:
        await create(conn, "job_a", kind="interactive")
        assert await store.record_results(conn, results=[result("job_a", 0, "abort")]) == [True]
        items = await store.get_items(conn, job_id="job_a")
        return (await get(conn, "job_a")).status, items[0].status

    assert run(pg_engine, body) == ("cancelled", "cancelled")  # nothing came of it


# --- reconciler and retention ----------------------------------------------------------------


def test_unfinished_items_and_retention(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        await create(conn, "job_done")
        await create(conn, "job_open", 2)
        await store.record_results(conn, results=[result("job_done", 0), result("job_open", 0)])
        later = datetime.now(UTC) + timedelta(seconds=1)
        unfinished = await store.unfinished_items(conn, created_before=later, limit=10)
        assert [i.request_id for i in unfinished] == ["job_open.1"]
        earlier = later - timedelta(hours=1)
        assert await store.unfinished_items(conn, created_before=earlier, limit=10) == []
        assert await store.delete_finished_before(conn, before=earlier) == 0
        assert await store.delete_finished_before(conn, before=later) == 1
        assert await store.get_job(conn, job_id="job_done") is None
        assert await count(conn, models.results) == 1
        assert await count(conn, models.usage) == 1

    run(pg_engine, body)


# --- api keys --------------------------------------------------------------------------------


def test_api_keys(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        record, key = await api_keys.create_api_key(conn, name="ci")
        assert key.startswith("tgq_") and len(key) > 40 and record.key_prefix == key[:8]
        stored = (await conn.execute(select(models.api_keys))).one()
        assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest()
        assert key not in [str(value) for value in stored]
        verified = await api_keys.verify_api_key(conn, key=key)
        assert verified is not None and verified.id == record.id
        assert verified.last_used_at is not None
        again = await api_keys.verify_api_key(conn, key=key)
        assert again is not None and again.last_used_at == verified.last_used_at
        assert await api_keys.verify_api_key(conn, key=key + "x") is None
        assert await api_keys.revoke_api_key(conn, key_id=record.id)
        assert not await api_keys.revoke_api_key(conn, key_id=record.id)
        assert await api_keys.verify_api_key(conn, key=key) is None
        listed = await api_keys.list_api_keys(conn)
        assert [(k.id, k.name) for k in listed] == [(record.id, "ci")]
        assert listed[0].revoked_at is not None

    run(pg_engine, body)


# --- SQLite ----------------------------------------------------------------------------------


def test_sqlite_create_record_cancel(sqlite_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> None:
        job = await create(conn, "job_a", 2, idempotency_key="k")
        same, created = await store.create_job(conn, **job_fields("job_b", idempotency_key="k"))
        assert same == job and not created
        assert await store.record_results(conn, results=[result("job_a", 0)]) == [True]
        assert await store.record_results(conn, results=[result("job_a", 0)]) == [False]
        assert await store.cancel_job(conn, job_id="job_a") == ["job_a.1"]
        late = [result("job_a", 1, "stop"), result("job_a", 1, "abort")]
        assert await store.record_results(conn, results=late) == [False, True]
        stored = await get(conn, "job_a")
        assert (stored.status, stored.num_items_done, stored.prompt_tokens) == ("cancelled", 2, 6)
        assert stored.created_at == job.created_at and stored.created_at.tzinfo is not None
        assert stored.started_at is not None and stored.finished_at is not None
        assert await store.list_jobs(conn, limit=5, status="cancelled") == [stored]

    run(sqlite_engine, body)


def test_sqlite_concurrent_writers(sqlite_engine: AsyncEngine, sqlite_url: str) -> None:
    run(sqlite_engine, lambda conn: create(conn, "job_a", 10))

    async def replica(indices: range) -> None:
        for index in indices:
            async with sqlite_engine.begin() as conn:
                await store.record_results(conn, results=[result("job_a", index)])

    async def race() -> None:
        await asyncio.gather(replica(range(0, 10, 2)), replica(range(1, 10, 2)))

    asyncio.run(race())
    job = run(sqlite_engine, lambda conn: get(conn, "job_a"))
    assert (job.status, job.num_items_done) == ("succeeded", 10)
    assert current_revision(sqlite_url) == head_revision()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("turn_timeout_s", [10.0, 0.05])
def test_sqlite_writers_take_turns_before_sqlites_lock(
    sqlite_url: str, turn_timeout_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second writer waits for its turn on the engine's lock, holding no connection (so not
    in SQLite's sleeping busy wait), and starts when the first commits; past
    WRITE_TURN_TIMEOUT_S it goes ahead to SQLite's own wait, and both still finish in order."""
    monkeypatch.setattr(db, "WRITE_TURN_TIMEOUT_S", turn_timeout_s)
    engine = create_engine(sqlite_url)
    assert isinstance(engine, db.SqliteEngine)
    run(engine, lambda conn: create(conn, "job_a", 2))
    order: list[str] = []
    release = asyncio.Event()

    async def writer(name: str, index: int, hold: bool) -> None:
        async with engine.begin() as conn:
            order.append(f"{name} in")
            await store.record_results(conn, results=[result("job_a", index)])
            if hold:
                await release.wait()
            order.append(f"{name} out")

    async def race() -> None:
        first = asyncio.create_task(writer("a", 0, hold=True))
        await _until(lambda: order == ["a in"])
        second = asyncio.create_task(writer("b", 1, hold=False))
        pool = engine.sync_engine.pool
        if turn_timeout_s > 1:  # waiting for its turn: no second connection
            await asyncio.sleep(0.05)
            assert pool.checkedout() == 1 and order == ["a in"]  # type: ignore[attr-defined]
        else:  # past its turn's timeout: in SQLite's busy wait, on a connection of its own
            await _until(lambda: pool.checkedout() == 2)  # type: ignore[attr-defined]
        release.set()
        await asyncio.gather(first, second)
        await engine.dispose()

    asyncio.run(race())
    assert order == ["a in", "a out", "b in", "b out"]


def test_a_sqlite_transaction_runs_whole_on_the_writers_thread(sqlite_url: str) -> None:
    """`in_transaction` on a SQLite file: the store's functions run on the writer's thread (one
    hand-off for the whole transaction), commit together or roll back together, and the
    engine's own connections see what was written; work that awaits anything but its
    connection is refused; an in-memory database, which has no writer, takes `begin()`."""
    engine = create_engine(sqlite_url)
    threads: list[str] = []

    async def work(conn: AsyncConnection) -> list[bool]:
        threads.append(threading.current_thread().name)
        await create(conn, "job_a", 2)
        return await store.record_results(conn, results=[result("job_a", 0)])

    async def failing(conn: AsyncConnection) -> None:
        await create(conn, "job_b")
        raise ValueError("refused")

    async def waiting(conn: AsyncConnection) -> None:
        await asyncio.sleep(0)

    async def body() -> tuple[JobRecord | None, JobRecord | None]:
        assert await db.in_transaction(engine, work) == [True]
        with pytest.raises(ValueError, match="refused"):
            await db.in_transaction(engine, failing)
        with pytest.raises(RuntimeError, match="awaited something besides its connection"):
            await db.in_transaction(engine, waiting)
        async with engine.connect() as conn:
            found = (
                await store.get_job(conn, job_id="job_a"),
                await store.get_job(conn, job_id="job_b"),
            )
        await engine.dispose()
        return found

    job_a, job_b = asyncio.run(body())
    assert threads == ["sqlite-writer_0"]
    assert job_a is not None and job_a.num_items_done == 1 and job_a.status == "running"
    assert job_b is None
    memory = create_engine("sqlite+aiosqlite://")
    assert isinstance(memory, db.SqliteEngine) and memory.writer is None


def test_an_item_records_the_attempt_that_finished_it(pg_engine: AsyncEngine) -> None:
    async def body(conn: AsyncConnection) -> list[int]:
        await create(conn, "job_a", 2)
        await store.record_results(
            conn, results=[result("job_a", 0), result("job_a", 1, attempt=3)]
        )
        return [item.attempts for item in await store.get_items(conn, job_id="job_a")]

    assert run(pg_engine, body) == [1, 3]


def test_nul_characters_are_stored_as_replacement_characters(pg_engine: AsyncEngine) -> None:
    """Postgres refuses NUL in text and JSONB; a model can generate one, and a stop string can
    hold one. Neither may block the write (one bad result would stall every persister)."""

    async def body(conn: AsyncConnection) -> tuple[str | None, Any]:
        params = {"stop_strings": ["a\x00b"]}
        await create(conn, "job_a", params=params, metadata={"note": "\x00"})
        generated = dataclasses.replace(result("job_a", 0), text="x\x00y", finish_detail="\x00")
        assert await store.record_results(conn, results=[generated]) == [True]
        (stored,) = await store.get_results(conn, job_id="job_a")
        job = await get(conn, "job_a")
        return stored.text, (job.params, job.metadata, stored.finish_detail)

    text, rest = run(pg_engine, body)
    assert text == "x\ufffdy"
    assert rest == ({"stop_strings": ["a\ufffdb"]}, {"note": "\ufffd"}, "\ufffd")
