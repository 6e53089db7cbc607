"""Infrastructure faults under the real stack (Postgres, Redis, api, batcher process, Celery
worker) on the tiny text model: the batcher killed with -9 mid-run and restarted, Redis restarted
or flushed (FLUSHALL) mid-run, Postgres unreachable to the api for a while.

After each fault the same invariants hold: every accepted job reaches exactly one terminal state
(`succeeded`), there is exactly one result row per job item, and the counters agree (job
progress, token usage, usage rows, the api's /metrics). Each test prints what it measured (jobs
lost, duplicates, time to recover); `-s` shows it.

Redis faults use a private `redis-server` and Postgres faults a proxy in front of the shared
server, so that the shared services other tests use are never flushed or stopped.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from tests.api.stack import REDIS_URL, Stack, migrated_database, running
from tests.polling import eventually
from tests.reliability.redis_server import private_redis
from tests.reliability.tcp_proxy import TcpProxy
from tgq.api.db import create_engine
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import GROUP, RedisKeys

NUM_JOBS = 1000
SHORT = {"max_new_tokens": 4, "ignore_eos": True}  # 1,000 jobs in well under a minute
FAST_RECONCILE = {"RECONCILE_INTERVAL_S": "0.5", "RECONCILE_GRACE_S": "0.5"}
NUM_KILL_ROUNDS = 5


def query(url: str, sql: str) -> list[Any]:
    async def run() -> list[Any]:
        engine = create_engine(url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return list((await conn.execute(text(sql))).all())
        finally:
            await engine.dispose()

    return asyncio.run(run())


def scalar(url: str, sql: str) -> Any:
    return query(url, sql)[0][0]


def submit_jobs(
    base_url: str, num_jobs: int, params: dict[str, Any], *, concurrency: int = 32
) -> list[str]:
    """Submits `num_jobs` one-prompt jobs, `concurrency` at a time; each must be accepted."""

    async def run() -> list[str]:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

            async def one(i: int) -> str:
                async with gate:
                    body = {"prompt": f"job {i}", "parameters": params}
                    answer = await client.post("/v1/jobs", json=body)
                assert answer.status_code == 202, answer.text
                job_id: str = answer.json()["id"]
                return job_id

            return await asyncio.gather(*(one(i) for i in range(num_jobs)))

    return asyncio.run(run())


def wait_done(url: str, num_jobs: int, timeout_s: float, *, log: Callable[[], str]) -> float:
    """Waits until `num_jobs` jobs have finished; returns when (time.monotonic)."""
    finished = "SELECT count(*) FROM jobs WHERE finished_at IS NOT NULL"
    eventually(lambda: scalar(url, finished) >= num_jobs, timeout_s, log, interval_s=0.2)
    return time.monotonic()


def check_invariants(url: str, num_jobs: int, num_new_tokens: int) -> dict[str, int]:
    """Exactly one terminal state per job, one result row per item, counters that agree.
    Returns the figures: jobs, lost (not succeeded), duplicates, reruns (attempt > 1)."""
    statuses = dict(query(url, "SELECT status, count(*) FROM jobs GROUP BY status"))
    item_statuses = dict(query(url, "SELECT status, count(*) FROM job_items GROUP BY status"))
    duplicates = query(
        url,
        "SELECT job_id, item_index FROM results GROUP BY job_id, item_index HAVING count(*) > 1",
    )
    without_result = scalar(
        url,
        "SELECT count(*) FROM job_items i LEFT JOIN results r"
        " ON r.job_id = i.job_id AND r.item_index = i.item_index WHERE r.job_id IS NULL",
    )
    totals = query(
        url,
        "SELECT sum(num_items_done), sum(num_items_failed), sum(completion_tokens),"
        " count(*) FILTER (WHERE finished_at IS NULL) FROM jobs",
    )[0]
    results = query(
        url,
        "SELECT count(*), sum(num_output_tokens), count(*) FILTER (WHERE attempt > 1),"
        " count(*) FILTER (WHERE finish_reason <> 'length') FROM results",
    )[0]
    num_usage = scalar(url, "SELECT count(DISTINCT (job_id, item_index)) FROM usage")
    assert statuses == {"succeeded": num_jobs}
    assert item_statuses == {"succeeded": num_jobs}
    assert duplicates == []
    assert without_result == 0
    assert tuple(totals) == (num_jobs, 0, num_jobs * num_new_tokens, 0)
    assert tuple(results[:2]) == (num_jobs, num_jobs * num_new_tokens)
    assert results[3] == 0
    assert num_usage == num_jobs == scalar(url, "SELECT count(*) FROM usage")
    return {
        "jobs": num_jobs,
        "lost": num_jobs - statuses.get("succeeded", 0),
        "duplicates": len(duplicates),
        "reruns": results[2],
    }


def metrics_of(stack: Stack) -> dict[str, float]:
    lines = httpx.get(f"{stack.url}/metrics", timeout=10).text.splitlines()
    samples = (line.rpartition(" ") for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, _, value in samples}


def check_metrics(stack: Stack, num_jobs: int) -> None:
    """The api's view agrees with Postgres and the queue is empty."""

    def agrees() -> bool:
        metrics = metrics_of(stack)
        return (
            metrics['tgq_jobs{status="succeeded"}'] == num_jobs
            and metrics['tgq_jobs{status="queued"}'] == 0
            and metrics['tgq_jobs{status="running"}'] == 0
            and metrics["tgi_queue_size"] == 0
        )

    eventually(agrees, 10, lambda: metrics_of(stack))


def report(name: str, figures: dict[str, Any]) -> None:
    print(f"\n{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


# --- the batcher killed with -9 ---------------------------------------------------------------


def kill_and_restart(stack: Stack, kill_at: int) -> float:
    """Kills the batcher with -9 once it has started `kill_at` requests and holds unfinished
    ones, starts a new one under the same id; returns when it was killed. Progress is watched
    in Redis: the persister writes results in rounds, some seconds behind the batcher."""
    client = redis.Redis.from_url(REDIS_URL)
    keys = RedisKeys(stack.prefix)
    streams = [keys.queue(p) for p in Priority]
    eventually(lambda: client.xlen(keys.started) >= kill_at, 120, stack.api_log)
    # It finishes a short request within a few steps: watched on the consumer group, tightly.
    eventually(lambda: holds_requests(client, streams), 60, stack.api_log, interval_s=0.001)
    (batcher,) = stack.batchers
    batcher.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    client.close()
    batcher.wait()
    stack.batchers.remove(batcher)
    log = stack.log_dir / "batcher-b0.log"
    log.rename(log.with_suffix(".killed.log"))  # the new one writes a log of the same name
    stack.start_batcher()
    return killed_at


def holds_requests(client: redis.Redis, streams: list[str]) -> bool:
    """Whether the batcher has pulled requests it has not acknowledged (finished) yet."""
    return any(client.xpending(stream, GROUP)["pending"] for stream in streams)


def run_with_kill(model_dir: Path, log_dir: Path, kill_at: int) -> dict[str, Any]:
    """1,000 jobs, submitted while the batcher is killed at job `kill_at` and restarted."""
    with (
        migrated_database() as url,
        running(Stack(model_dir, url, log_dir), celery_worker=True) as stack,
    ):
        started_at = time.monotonic()
        job_ids: list[str] = []
        submitter = threading.Thread(
            target=lambda: job_ids.extend(submit_jobs(stack.url, NUM_JOBS, SHORT))
        )
        submitter.start()
        killed_at = kill_and_restart(stack, kill_at)
        rerun = "SELECT count(*) FROM results WHERE attempt > 1"
        eventually(lambda: scalar(url, rerun) > 0, 120, stack.all_logs, interval_s=0.1)
        rerun_at = time.monotonic()  # the killed work is back: rerun and persisted
        submitter.join()
        assert len(job_ids) == NUM_JOBS
        done_at = wait_done(url, NUM_JOBS, 180, log=stack.all_logs)
        figures = check_invariants(url, NUM_JOBS, SHORT["max_new_tokens"])
        check_metrics(stack, NUM_JOBS)
        assert figures["reruns"] > 0  # the kill did hit requests in flight
    return {
        **figures,
        "kill_at": kill_at,
        "first_rerun_s": round(rerun_at - killed_at, 1),
        "all_done_s": round(done_at - killed_at, 1),
        "total_s": round(done_at - started_at, 1),
    }


@pytest.mark.timeout(300)
def test_batcher_kill_9_at_job_300_loses_and_duplicates_nothing(
    text_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_with_kill(text_model_dir, tmp_path, kill_at=300)
    report("batcher kill -9 at 300/1000", figures)
    assert (figures["lost"], figures["duplicates"]) == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_batcher_kill_9_at_random_points(text_model_dir: Path, tmp_path: Path) -> None:
    rounds = random.Random(1000).sample(range(50, NUM_JOBS - 100), NUM_KILL_ROUNDS)
    for i, kill_at in enumerate(rounds):
        log_dir = tmp_path / f"round-{i}"
        log_dir.mkdir()
        figures = run_with_kill(text_model_dir, log_dir, kill_at)
        report(f"batcher kill -9, round {i}", figures)
        assert (figures["lost"], figures["duplicates"]) == (0, 0)


# --- Redis restarted or flushed ---------------------------------------------------------------

NUM_REDIS_JOBS = 40
REDIS_PARAMS = {"max_new_tokens": 32, "ignore_eos": True}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["restart", pytest.param("flushall", marks=pytest.mark.slow)])
def test_redis_losing_everything_mid_run_loses_no_accepted_job(
    text_model_dir: Path, tmp_path: Path, fault: str
) -> None:
    with private_redis() as server, migrated_database() as url:
        stack = Stack(
            text_model_dir,
            url,
            tmp_path,
            api_env=FAST_RECONCILE,
            redis_url=server.url,
            batcher_options=("--max-batch-size", "4"),  # most jobs stay queued in Redis
        )
        with running(stack, celery_worker=True):
            submit_jobs(stack.url, NUM_REDIS_JOBS, REDIS_PARAMS)
            eventually(lambda: scalar(url, "SELECT count(*) FROM results") >= 2, 60, stack.api_log)
            assert scalar(url, "SELECT count(*) FROM results") < NUM_REDIS_JOBS // 2  # mid-run
            fault_at = time.monotonic()
            server.lose_everything(fault)
            done_at = wait_done(url, NUM_REDIS_JOBS, 180, log=stack.api_log)
            figures = check_invariants(url, NUM_REDIS_JOBS, REDIS_PARAMS["max_new_tokens"])
            check_metrics(stack, NUM_REDIS_JOBS)
            assert stack.batchers[0].poll() is None  # the same batcher rode it out
            assert "reconciler: re-enqueued" in (tmp_path / "api.log").read_text()
    report(f"redis {fault}", {**figures, "recover_s": round(done_at - fault_at, 1)})


# --- Postgres unreachable ---------------------------------------------------------------------

NUM_BEFORE = 30
BEFORE_PARAMS = {"max_new_tokens": 48, "ignore_eos": True}  # still running when it is cut


def outage(stack: Stack, proxy: TcpProxy, seconds: float, url: str) -> dict[str, int]:
    """Cuts Postgres off the api for `seconds` while submitting every 0.2 s; each submission
    must be refused with 503, promptly. Returns the answers' status codes counted, and how many
    results the persister still had to write when Postgres came back."""
    codes: dict[int, int] = {}
    client = httpx.Client(base_url=stack.url, timeout=15)
    proxy.cut()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            body = {"prompt": ["during", "the outage"], "parameters": SHORT}
            answer = client.post("/v1/jobs", json=body)
            codes[answer.status_code] = codes.get(answer.status_code, 0) + 1
            assert answer.status_code == 503, answer.text
            assert "nothing was queued" in answer.json()["error"]["message"]
            time.sleep(0.2)
        # `url` reaches Postgres directly: the finals Redis holds that it has not recorded.
        unwritten = len(finished_request_ids(stack)) - scalar(url, "SELECT count(*) FROM results")
    finally:
        proxy.restore()
        client.close()
    return {
        "refused_503": codes.get(503, 0),
        "accepted_2xx": sum(n for code, n in codes.items() if 200 <= code < 300),
        "unwritten_at_restore": unwritten,
    }


def finished_request_ids(stack: Stack) -> set[str]:
    return _ids_under(stack, f"{stack.prefix}:final:")


def known_request_ids(stack: Stack) -> set[str]:
    """The request ids Redis has been given under the stack's prefix."""
    return _ids_under(stack, f"{stack.prefix}:known:")


def _ids_under(stack: Stack, marker: str) -> set[str]:
    client = redis.Redis.from_url(stack.redis_url or "")
    ids = {key.decode()[len(marker) :] for key in client.scan_iter(match=f"{marker}*")}
    client.close()
    return ids


def run_with_outage(model_dir: Path, log_dir: Path, seconds: float) -> dict[str, Any]:
    with migrated_database() as url:
        where = make_url(url)
        proxy = TcpProxy((where.host or "127.0.0.1", where.port or 5432))
        proxied = where.set(port=proxy.port).render_as_string(hide_password=False)
        stack = Stack(model_dir, proxied, log_dir, api_env=FAST_RECONCILE)
        try:
            with running(stack, celery_worker=True):
                submit_jobs(stack.url, NUM_BEFORE, BEFORE_PARAMS)
                accepted = known_request_ids(stack)
                figures = outage(stack, proxy, seconds, url)
                restored_at = time.monotonic()
                assert known_request_ids(stack) == accepted  # nothing new reached Redis
                assert figures["unwritten_at_restore"] > 0  # the persister had to retry
                # Promptly: well within the 30 s lease after which pending results are claimed.
                done_at = wait_done(url, NUM_BEFORE, 15, log=stack.api_log)
                figures |= check_invariants(url, NUM_BEFORE, BEFORE_PARAMS["max_new_tokens"])
                committed = {row[0] for row in query(url, "SELECT request_id FROM job_items")}
                assert committed == accepted  # and nothing of the outage reached Postgres
                check_metrics(stack, NUM_BEFORE)
                assert all(p.poll() is None for p in stack.workers)  # Celery rode it out
                after = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "after"}, timeout=30)
                assert after.status_code == 202, after.text
        finally:
            proxy.close()
    return {**figures, "recover_s": round(done_at - restored_at, 1)}


@pytest.mark.timeout(240)
def test_postgres_unreachable_5s_means_503_and_everything_reconciles(
    text_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_with_outage(text_model_dir, tmp_path, 5)
    report("postgres unreachable 5 s", figures)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_postgres_unreachable_20s_means_503_and_everything_reconciles(
    text_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_with_outage(text_model_dir, tmp_path, 20)
    report("postgres unreachable 20 s", figures)
