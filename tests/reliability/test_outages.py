"""Postgres stopped and Redis killed under the real stack: every route answers 503 with
`Retry-After` when it needs what is down (its own body: TGI's or OpenAI's), what it always
answers when it does not, never a 500; `/health` is 503 naming the problem; every route
recovers once the server is back. An interactive request answered 503 while Redis was away is
never run afterwards, while a durable job with an `Idempotency-Key` is, within seconds of
Redis's return (the epoch), although the reconciler's period is left at its default 30 s.

The servers are the tests' own: a Postgres cluster made with `initdb` on a free port and stopped
with `pg_ctl stop -m immediate` (the process is gone: connections are refused, asyncpg raises
`ConnectionRefusedError`), and a `redis-server` without persistence, killed with SIGKILL and
started again empty on the same port.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.api.stack import Stack, migrated_database, running
from tests.polling import eventually
from tests.reliability.pg_server import private_postgres
from tests.reliability.redis_server import RedisServer, private_redis
from tests.reliability.routes_under_outage import (
    BATCH_LINE,
    SHORT,
    Call,
    Known,
    check_answers,
    check_covers,
    routes,
)
from tests.reliability.test_infra_faults import query, scalar
from tgq.api.db.migrate import upgrade
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import RedisKeys

pytestmark = pytest.mark.timeout(120)


def prepare(client: httpx.Client) -> Known:
    """A finished job and an uploaded file, made while all is up."""
    posted = client.post("/v1/jobs", json={"prompt": "before", "parameters": {"max_new_tokens": 2}})
    assert posted.status_code == 202, posted.text
    job_id = posted.json()["id"]
    eventually(
        lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded",
        30,
        f"job {job_id} succeeded",
    )
    content = (json.dumps(BATCH_LINE) + "\n").encode()
    uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a", content)})
    assert uploaded.status_code == 200, uploaded.text
    return Known(job_id, uploaded.json()["id"])


def call_all(client: httpx.Client, calls: list[Call], known: Known) -> list[httpx.Response]:
    return [call.send(client, known) for call in calls]


def report(name: str, calls: list[Call], answers: list[httpx.Response]) -> None:
    refused = [
        str(call) for call, answer in zip(calls, answers, strict=True) if answer.status_code == 503
    ]
    print(f"\n{name}: {len(refused)} of {len(calls)} calls 503: {', '.join(refused)}")


def health(client: httpx.Client) -> httpx.Response:
    return client.get("/health")


def recovered(client: httpx.Client, calls: list[Call], known: Known) -> list[str]:
    """Waits for `/health` 200, then calls every route: [] when each answers as usual."""
    eventually(lambda: health(client).status_code == 200, 30, lambda: health(client).text)
    return check_answers(calls, call_all(client, calls, known), None)


@contextlib.contextmanager
def serving(stack: Stack) -> Iterator[httpx.Client]:
    """The stack's batcher and api started, and a client of the api; all stopped after."""
    with running(stack), httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


def test_postgres_stopped_means_503_on_every_route_that_needs_it(
    text_model_dir: Path, tmp_path: Path
) -> None:
    with private_postgres() as server:
        upgrade(server.url)
        stack = Stack(text_model_dir, server.url, tmp_path)
        with serving(stack) as client:
            known = prepare(client)
            calls = routes()
            check_covers(client, calls)
            server.stop()
            eventually(lambda: health(client).status_code == 503, 10, "/health says 503")
            problem = health(client).json()["error"]
            assert problem.startswith("unhealthy: the database is unreachable"), problem
            answers = call_all(client, calls, known)
            report("postgres stopped", calls, answers)
            assert check_answers(calls, answers, "database") == [], stack.api_log()
            server.start()
            assert recovered(client, calls, known) == [], stack.api_log()
            assert "Traceback" not in stack.api_log()


def redis_stack(model_dir: Path, url: str, log_dir: Path, server: RedisServer) -> Stack:
    """The api and its batcher on `server`; a batch of 2, so that most work waits queued."""
    options = ("--max-batch-size", "2")
    return Stack(model_dir, url, log_dir, redis_url=server.url, batcher_options=options)


def _outage_jobs(url: str, since: str) -> list[Any]:
    """(id, kind, status, error) of the jobs created after the job `since`."""
    sql = (
        "SELECT id, kind, status, error FROM jobs WHERE created_at >"
        f" (SELECT created_at FROM jobs WHERE id = '{since}') ORDER BY created_at"
    )
    return query(url, sql)


def _job_status(client: httpx.Client, job_id: str) -> str:
    status: str = client.get(f"/v1/jobs/{job_id}").json()["status"]
    return status


def _repeat_kept(client: httpx.Client, key: str) -> str:
    """The job posted with `key` during the outage, posted again: the same job (200)."""
    body = {"prompt": "kept", "parameters": {"max_new_tokens": 2}}
    kept = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
    assert kept.status_code == 200, kept.text  # the job of the 503, not a new one
    job_id: str = kept.json()["id"]
    return job_id


def test_redis_killed_means_503_and_what_was_refused_never_runs(
    text_model_dir: Path, tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    with private_redis() as server, migrated_database() as url:
        stack = redis_stack(text_model_dir, url, tmp_path, server)
        with serving(stack) as client:
            known = prepare(client)
            calls = routes(idempotency_key=key)
            check_covers(client, calls)
            server.kill()
            eventually(lambda: health(client).status_code == 503, 10, "/health says 503")
            assert "the queue (Redis) is unreachable" in health(client).json()["error"]
            answers = call_all(client, calls, known)
            report("redis killed", calls, answers)
            assert check_answers(calls, answers, "redis") == [], stack.api_log()
            refused = _outage_jobs(url, known.job_id)
            server.start()
            restarted_at = time.monotonic()
            assert recovered(client, routes(), known) == [], stack.api_log()
            job_id = _repeat_kept(client, key)
            eventually(lambda: _job_status(client, job_id) == "succeeded", 15, stack.api_log)
            # The reconciler's period is 30 s: the new epoch brought the job back at once.
            kept_s = time.monotonic() - restarted_at
            print(f"redis killed: the kept job succeeded {kept_s:.1f} s after the restart")
            assert kept_s < 25
            _check_refused_never_ran(stack, url, refused, key)


NUM_LOST = 8
LONG = {"max_new_tokens": 64, "ignore_eos": True}
WAIT_TOKENS = 200


@pytest.mark.parametrize("fault", ["restart", "flushall"])
def test_redis_losing_its_data_is_reconciled_within_seconds(
    text_model_dir: Path, tmp_path: Path, fault: str
) -> None:
    """The reconciler's period and grace are left at 30 s; the epoch brings back the jobs
    Redis lost within seconds, and a client still waiting (a FLUSHALL breaks no connection)
    gets its whole answer: its replica enqueues its request again."""
    with private_redis() as server, migrated_database() as url:
        stack = redis_stack(text_model_dir, url, tmp_path, server)
        with serving(stack) as client:
            body = {"prompt": "lost", "parameters": LONG}
            job_ids = [client.post("/v1/jobs", json=body).json()["id"] for _ in range(NUM_LOST)]
            waiting = None
            if fault == "flushall":
                waiting = _generate_in_background(stack.url, WAIT_TOKENS)
            eventually(
                lambda: scalar(url, "SELECT count(*) FROM results") >= 1, 60, "a first result"
            )
            fault_at = time.monotonic()
            server.lose_everything(fault)
            eventually(lambda: _all_succeeded(client, job_ids), 20, stack.api_log, interval_s=0.2)
            recover_s = time.monotonic() - fault_at
            print(f"\nredis {fault}: {NUM_LOST} jobs done {recover_s:.1f} s after it")
            if waiting is not None:
                waiting.join(30)
                assert waiting.answer is not None and waiting.answer.status_code == 200
                assert waiting.answer.json()["details"]["generated_tokens"] == WAIT_TOKENS
            num_results = NUM_LOST + (waiting is not None)
            count = "SELECT count(*), count(DISTINCT (job_id, item_index)) FROM results"
            eventually(
                lambda: tuple(query(url, count)[0]) == (num_results, num_results),
                10,
                f"{num_results} results, one per item",
            )


def _all_succeeded(client: httpx.Client, job_ids: list[str]) -> bool:
    return all(_job_status(client, job_id) == "succeeded" for job_id in job_ids)


class _Waiting(threading.Thread):
    def __init__(self, url: str, num_tokens: int) -> None:
        super().__init__()
        self.url = url
        self.num_tokens = num_tokens
        self.answer: httpx.Response | None = None

    def run(self) -> None:
        parameters = {"max_new_tokens": self.num_tokens, "ignore_eos": True, "details": True}
        body = {"inputs": "wait", "parameters": parameters}
        self.answer = httpx.post(f"{self.url}/generate", json=body, timeout=60)


def _generate_in_background(url: str, num_tokens: int) -> _Waiting:
    waiting = _Waiting(url, num_tokens)
    waiting.start()
    return waiting


def _check_refused_never_ran(stack: Stack, url: str, refused: list[Any], key: str) -> None:
    """The jobs answered 503 during the outage are failed, have no result, and no batcher got
    them; the one with the Idempotency-Key is the exception (it is queued, to run)."""
    kept = scalar(url, f"SELECT id FROM jobs WHERE idempotency_key = '{key}'")
    withdrawn = [job for job in refused if job[0] != kept and job[1] != "batch"]
    kinds = sorted(kind for _, kind, _, _ in withdrawn)
    # TGI's three routes (one of them twice), chat and completions twice each; one keyless job
    assert kinds == ["interactive"] * 8 + ["job"], refused
    for _, _, status, error in withdrawn:
        assert status == "failed" and (error or "").startswith("unavailable: the queue"), error
    ids = [job[0] for job in withdrawn]
    in_list = ", ".join(f"'{job_id}'" for job_id in ids)
    assert scalar(url, f"SELECT count(*) FROM results WHERE job_id IN ({in_list})") == 0
    server = redis.Redis.from_url(stack.redis_url or "")
    keys = RedisKeys(stack.prefix)
    entries: Any = server.xrange(keys.started)
    started = {fields[b"r"].decode() for _, fields in entries}
    assert not any(request_id.startswith(tuple(ids)) for request_id in started)
    assert not any(server.exists(keys.final(f"{job_id}.0")) for job_id in ids)
    server.close()


NUM_FOLLOWED = 3


def test_requests_refused_when_redis_died_are_aborted_in_what_it_kept(
    text_model_dir: Path, tmp_path: Path
) -> None:
    """Redis with an append-only file (as in compose) dies while interactive requests wait in
    its queue (no batcher yet): their clients get 503, and although Redis comes back with the
    queue intact, the batcher started afterwards runs none of them (they were aborted once Redis
    was back); a durable job queued with them runs."""
    (tmp_path / "aof").mkdir()
    with private_redis(tmp_path / "aof") as server, migrated_database() as url:
        stack = redis_stack(text_model_dir, url, tmp_path, server)
        try:
            stack.start_api(healthy=False)  # no batcher: everything stays queued
            with httpx.Client(base_url=stack.url, timeout=30) as client:
                durable = client.post("/v1/jobs", json={"prompt": "durable", "parameters": SHORT})
                waiting = [_generate_in_background(stack.url, 2) for _ in range(NUM_FOLLOWED)]
                keys, queued = RedisKeys(stack.prefix), redis.Redis.from_url(server.url)
                interactive = keys.queue(Priority.INTERACTIVE)
                eventually(
                    lambda: queued.xlen(interactive) == NUM_FOLLOWED,
                    30,
                    f"{NUM_FOLLOWED} interactive requests queued",
                )
                server.kill()
                for thread in waiting:
                    thread.join(30)
                    assert thread.answer is not None and thread.answer.status_code == 503
                server.start()
                withdrawn = [row[0] for row in _outage_jobs(url, durable.json()["id"])]
                request_ids = [f"{job_id}.0" for job_id in withdrawn]
                aborted = lambda: all(queued.exists(keys.abort(r)) for r in request_ids)  # noqa: E731
                eventually(aborted, 15, stack.api_log)  # the aborts reached Redis once it was back
                assert queued.xlen(interactive) == NUM_FOLLOWED  # still queued, in what it kept
                stack.start_batcher()
                job_id = durable.json()["id"]
                eventually(lambda: _job_status(client, job_id) == "succeeded", 60, stack.api_log)
                eventually(  # pulled, and dropped
                    lambda: queued.xlen(interactive) == 0, 15, "the interactive queue emptied"
                )
                entries: Any = queued.xrange(keys.started)
                started = {fields[b"r"].decode() for _, fields in entries}
                assert started == {f"{job_id}.0"}  # none of the refused ones ever started
                statuses = [_job_status(client, job_id) for job_id in withdrawn]
                assert statuses == ["failed"] * NUM_FOLLOWED
                queued.close()
        finally:
            stack.stop()
