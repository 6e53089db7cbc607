"""Request-level faults on the real stack (Postgres, Redis, the api and batcher processes, a tiny
model): cancels at random moments, clients that go away, an engine that fails mid-batch, SIGTERM
of the api and of the batcher under load, and 500 concurrent requests that must not see each
other's data.

Each test checks the invariants as well as its own fault: every accepted job reaches one terminal
state, result rows are unique per job item, the job counters match the rows, and the batcher's
KV blocks are all free again (the batcher's heartbeat in Redis carries its free blocks).
Figures (time to cancelled, time to free blocks, drain times) are printed; run with `-s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import Row, text
from sqlalchemy.pool import NullPool

from tests.api.stack import (
    NUM_BLOCKS,
    REDIS_URL,
    Stack,
    migrated_database,
    running,
    write_text_model,
)
from tests.api.test_http_limits import paused
from tests.polling import eventually
from tgq.api.db import create_engine
from tgq.batcher.faults import FailingRunner, InjectedFaultError, inject_fault, parse_fault
from tgq.batcher.messages import FinalResult, Heartbeat
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import RedisKeys
from tgq.batcher.transport.redis_wire import decode_as

FAST_BEATS = ("--heartbeat-ttl-s", "1")  # a heartbeat every 0.25 s: KV state seen promptly
NUM_USABLE_BLOCKS = NUM_BLOCKS - 1  # block 0 is reserved
SUCCESS = ("stop", "length")


# --- the stack and what it shows ---------------------------------------------------------------


@contextlib.contextmanager
def fresh_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    batcher_options: tuple[str, ...] = (),
    api_env: dict[str, str] | None = None,
    with_batcher: bool = True,
) -> Iterator[Stack]:
    """A stack on a database of its own; without a batcher the api starts unhealthy."""
    with migrated_database() as url:
        stack = Stack(
            model_dir, url, log_dir, api_env=api_env or {}, batcher_options=batcher_options
        )
        with running(stack, batcher=with_batcher):
            yield stack


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def shared(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One batcher (batches of 64, 511 blocks) for the tests that leave it as they found it."""
    env = {"MAX_CONCURRENT_REQUESTS": "600"}
    log_dir = tmp_path_factory.mktemp("logs")
    with fresh_stack(text_model_dir, log_dir, batcher_options=FAST_BEATS, api_env=env) as stack:
        yield stack


def rows(stack: Stack, sql: str, **params: Any) -> list[Row[Any]]:
    async def run() -> list[Row[Any]]:
        engine = create_engine(stack.database_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return list((await conn.execute(text(sql), params)).all())
        finally:
            await engine.dispose()

    return asyncio.run(run())


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def heartbeat(stack: Stack, batcher_id: str = "b0") -> Heartbeat | None:
    data: Any = redis_client().get(RedisKeys(stack.prefix).heartbeat(batcher_id))
    return None if data is None else decode_as(data, Heartbeat)


def is_idle(beat: Heartbeat | None) -> bool:
    """Nothing running or waiting, every KV block free (cached blocks count as free)."""
    return (
        beat is not None
        and (beat.num_running, beat.num_waiting) == (0, 0)
        and beat.num_free_blocks == NUM_USABLE_BLOCKS
    )


def idle_heartbeat_after(stack: Stack, since: float, timeout_s: float = 10) -> float:
    """The send time of the first heartbeat sent after `since` (unix time) that shows the batcher
    idle with every block free."""
    eventually(
        lambda: (b := heartbeat(stack)) is not None and b.time > since and is_idle(b),
        timeout_s,
        lambda: f"batcher not idle: {heartbeat(stack)}",
        interval_s=0.02,
    )
    beat = heartbeat(stack)
    assert beat is not None
    return beat.time


def final_reason(stack: Stack, request_id: str) -> tuple[str, int] | None:
    """(finish reason, tokens) of the request's final result in Redis, once the batcher wrote
    it: the moment the request left the batch."""
    data: Any = redis_client().get(RedisKeys(stack.prefix).final(request_id))
    if data is None:
        return None
    final = decode_as(data, FinalResult)
    return final.finish_reason, final.num_output_tokens


def metric(stack: Stack, name: str) -> float:
    body = httpx.get(f"{stack.url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", body, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def check_job_invariants(stack: Stack, job_ids: list[str]) -> None:
    """Terminal jobs and items, one result row per item at most, counters = rows."""
    jobs = rows(
        stack,
        "SELECT j.id, j.status, j.num_items, j.num_items_done, j.completion_tokens,"
        " (SELECT count(*) FROM results r WHERE r.job_id = j.id) AS num_results,"
        " (SELECT coalesce(sum(r.num_output_tokens), 0) FROM results r WHERE r.job_id = j.id)"
        "   AS num_result_tokens,"
        " (SELECT count(*) FROM usage u WHERE u.job_id = j.id) AS num_usage,"
        " (SELECT count(*) FROM job_items i WHERE i.job_id = j.id"
        "   AND i.status NOT IN ('succeeded', 'failed', 'cancelled')) AS num_open"
        " FROM jobs j WHERE j.id = ANY(:ids)",
        ids=job_ids,
    )
    assert len(jobs) == len(job_ids)
    for job in jobs:
        assert job.status in ("succeeded", "failed", "cancelled"), job
        assert job.num_open == 0, job
        assert job.num_results <= job.num_items, job
        assert job.num_items_done == job.num_results == job.num_usage, job
        assert job.completion_tokens == job.num_result_tokens, job
    duplicates = rows(
        stack,
        "SELECT request_id FROM results WHERE job_id = ANY(:ids)"
        " GROUP BY request_id HAVING count(*) > 1",
        ids=job_ids,
    )
    assert duplicates == []


def check_stack_idle(stack: Stack, since: float) -> None:
    idle_heartbeat_after(stack, since)
    queues = RedisKeys(stack.prefix)
    client = redis_client()
    assert sum(client.xlen(queues.queue(p)) for p in Priority) == 0
    eventually(lambda: metric(stack, "tgq_requests_in_flight") == 0, 5, "requests in flight")


# --- 1. cancels at random moments --------------------------------------------------------------

NUM_CANCELS = 100
CANCEL_TOKENS = 64
NUM_FROZEN = 5  # more cancels, certainly while queued (see cancel_while_frozen)
# Each job's cancel moment, drawn with a seed: ("queued", seconds after its 202) for jobs sent
# once the batch is full, ("running", after that many token events) or ("finishing", two
# events before the last).
Moment = tuple[str, float]


def cancel_moments(rng: random.Random) -> list[Moment]:
    def draw() -> Moment:
        kind = rng.choices(("queued", "running", "finishing"), weights=(3, 4, 3))[0]
        if kind == "queued":
            return kind, rng.uniform(0, 0.05)
        if kind == "running":
            return kind, rng.randint(1, CANCEL_TOKENS - 8)
        return kind, CANCEL_TOKENS - 2

    return [draw() for _ in range(NUM_CANCELS)]


class Watcher:
    """One poller for every job's progress: a tick is one Redis round trip, however many jobs
    wait (a poll per job would starve the batcher of CPU on a small machine)."""

    def __init__(self, r: aioredis.Redis, keys: RedisKeys) -> None:
        self.r, self.keys = r, keys
        self._events: dict[str, tuple[float, asyncio.Future[None]]] = {}
        self._finals: dict[str, asyncio.Future[tuple[FinalResult, float]]] = {}

    def num_events(self, request_id: str, at_least: float) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self._events[request_id] = (at_least, future)
        return future

    def final(self, request_id: str) -> asyncio.Future[tuple[FinalResult, float]]:
        """(its final result, the time it was first seen)."""
        future = asyncio.get_running_loop().create_future()
        self._finals[request_id] = future
        return future

    async def run(self) -> None:
        while True:
            await self._tick()
            await asyncio.sleep(0.01)

    async def _tick(self) -> None:
        event_ids, final_ids = list(self._events), list(self._finals)
        pipe = self.r.pipeline(transaction=False)
        for request_id in event_ids:
            pipe.xlen(self.keys.tokens(request_id))
        for request_id in final_ids:
            pipe.get(self.keys.final(request_id))
        replies: list[Any] = await pipe.execute() if event_ids or final_ids else []
        now = time.time()
        for request_id, length in zip(event_ids, replies, strict=False):
            at_least, future = self._events[request_id]
            if length >= at_least:
                future.set_result(None)
                del self._events[request_id]
        for request_id, data in zip(final_ids, replies[len(event_ids) :], strict=True):
            if data is not None:
                self._finals.pop(request_id).set_result((decode_as(data, FinalResult), now))


class Gate:
    """Opens once `num_first` jobs are accepted."""

    def __init__(self, num_first: int) -> None:
        self.num_left = num_first
        self.opened = asyncio.Event()

    def count(self) -> None:
        self.num_left -= 1
        if self.num_left == 0:
            self.opened.set()


async def submit_and_cancel(
    client: httpx.AsyncClient, watcher: Watcher, at: Moment, gate: Gate
) -> dict[str, Any]:
    """POST a job, DELETE it at its moment, then wait (10 s at most) until the batcher has let
    go of it: its final result is in Redis."""
    body = {
        "prompt": f"cancel me {uuid.uuid4().hex}",
        "parameters": {"max_new_tokens": CANCEL_TOKENS, "ignore_eos": True},
    }
    if at[0] == "queued":
        await gate.opened.wait()
    accepted = await client.post("/v1/jobs", json=body)
    assert accepted.status_code == 202, accepted.text
    if at[0] != "queued":
        gate.count()
    job = accepted.json()
    (request_id,) = job["request_ids"]
    kind, value = at
    if kind == "queued":
        await asyncio.sleep(value)
    else:
        await asyncio.wait_for(watcher.num_events(request_id, value), 60)
    cancel = await client.delete(f"/v1/jobs/{job['id']}")
    acked_at = time.time()
    assert cancel.status_code == 200, cancel.text
    final, seen_at = await asyncio.wait_for(watcher.final(request_id), 10)
    seen = (await client.get(f"/v1/jobs/{job['id']}")).json()["status"]
    return {
        "id": job["id"], "moment": at[0], "acked_at": acked_at, "answer": cancel.json()["status"],
        "seen": seen, "left_batch_s": max(seen_at - acked_at, 0.0),
        "final": (final.finish_reason, final.num_output_tokens),
    }  # fmt: skip


async def cancel_all(stack: Stack, moments: list[Moment]) -> list[dict[str, Any]]:
    """Every job at once, the "queued" ones only once the others are accepted (the batch is
    full then)."""
    limits = httpx.Limits(max_connections=NUM_CANCELS + 10, keepalive_expiry=1)  # < uvicorn's 5
    r = aioredis.Redis.from_url(REDIS_URL)
    watcher = Watcher(r, RedisKeys(stack.prefix))
    polling = asyncio.create_task(watcher.run())
    gate = Gate(sum(kind != "queued" for kind, _ in moments))
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            jobs = (submit_and_cancel(client, watcher, at, gate) for at in moments)
            return await asyncio.gather(*jobs)
    finally:
        polling.cancel()
        await r.aclose()


async def cancel_while_frozen(stack: Stack, num_jobs: int) -> list[dict[str, Any]]:
    """`num_jobs` jobs accepted and cancelled while the batcher is frozen (SIGSTOP), so they are
    certainly still queued when their cancel is acknowledged: the tiny model may finish the
    random "queued" ones of `cancel_all` before their DELETE."""
    r = aioredis.Redis.from_url(REDIS_URL)
    watcher = Watcher(r, RedisKeys(stack.prefix))
    polling = asyncio.create_task(watcher.run())
    body = {"parameters": {"max_new_tokens": CANCEL_TOKENS, "ignore_eos": True}}
    outcomes = []
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            with paused(stack.batchers[0]):
                cancels = []
                for _ in range(num_jobs):
                    job = (await client.post("/v1/jobs", json={**body, "prompt": "held"})).json()
                    answer = (await client.delete(f"/v1/jobs/{job['id']}")).json()["status"]
                    cancels.append((job, answer, time.time()))
            for job, answer, acked_at in cancels:
                (request_id,) = job["request_ids"]
                final, seen_at = await asyncio.wait_for(watcher.final(request_id), 10)
                seen = (await client.get(f"/v1/jobs/{job['id']}")).json()["status"]
                outcomes.append({
                    "id": job["id"], "moment": "frozen", "acked_at": acked_at, "answer": answer,
                    "seen": seen, "left_batch_s": max(seen_at - acked_at, 0.0),
                    "final": (final.finish_reason, final.num_output_tokens),
                })  # fmt: skip
    finally:
        polling.cancel()
        await r.aclose()
    return outcomes


@pytest.mark.timeout(180)
def test_a_hundred_cancels_at_random_moments(shared: Stack) -> None:
    moments = cancel_moments(random.Random(20240610))
    started = time.time()
    outcomes = asyncio.run(cancel_all(shared, moments))
    outcomes += asyncio.run(cancel_while_frozen(shared, NUM_FROZEN))
    frozen = [o for o in outcomes if o["moment"] == "frozen"]
    assert all(o["answer"] == "cancelled" and o["final"] == ("abort", 0) for o in frozen), frozen
    for outcome in outcomes:
        assert outcome["final"] is not None, f"the batcher never let go of {outcome}"
        if outcome["answer"] == "cancelled":
            assert outcome["seen"] == "cancelled", outcome
        else:  # it finished before the cancel: the DELETE answers the job as it stands
            assert outcome["answer"] == outcome["seen"] == "succeeded", outcome
            assert outcome["final"] == ("length", CANCEL_TOKENS), outcome
    cancelled = [o for o in outcomes if o["answer"] == "cancelled"]
    times = [o["left_batch_s"] for o in cancelled]
    assert max(times) <= 10
    ends = {
        "aborted before its first token": sum(o["final"] == ("abort", 0) for o in cancelled),
        "aborted while running": sum(
            o["final"][0] == "abort" and o["final"][1] > 0 for o in cancelled
        ),
        "batcher finished first": sum(o["final"][0] in SUCCESS for o in cancelled),
        "finished before the DELETE": len(outcomes) - len(cancelled),
    }
    assert ends["aborted before its first token"] and ends["aborted while running"], ends

    job_ids = [o["id"] for o in outcomes]
    check_stack_idle(shared, started)
    eventually(lambda: _num_unpersisted(shared, outcomes) == 0, 10, "abort results not persisted")
    check_job_invariants(shared, job_ids)
    acked = {o["id"]: o["acked_at"] for o in outcomes}
    successes = rows(
        shared,
        "SELECT job_id, extract(epoch FROM created_at) AS at FROM results"
        " WHERE job_id = ANY(:ids) AND finish_reason IN ('stop', 'length')",
        ids=job_ids,
    )
    late = [s for s in successes if s.at >= acked[s.job_id]]
    assert late == [], "a success was written after its cancel was acknowledged"
    found = rows(shared, "SELECT id, status FROM jobs WHERE id = ANY(:ids)", ids=job_ids)
    statuses = {r.id: r.status for r in found}
    assert all(statuses[o["id"]] == o["answer"] for o in outcomes)
    print(
        f"\ncancels: {ends}; DELETE answered -> left the batch: "
        f"p50 {statistics.median(times) * 1000:.0f} ms, p99 {percentile(times, 0.99) * 1000:.0f} ms"
    )


def _num_unpersisted(stack: Stack, outcomes: list[dict[str, Any]]) -> int:
    """Cancelled jobs whose batcher answered `abort` but whose abort row is not written yet."""
    aborted = [o["id"] for o in outcomes if o["answer"] == "cancelled" and o["final"][0] == "abort"]
    written = rows(
        stack,
        "SELECT count(*) FROM results WHERE job_id = ANY(:ids) AND finish_reason = 'abort'",
        ids=aborted,
    )
    return len(aborted) - int(written[0][0])


# --- 2. clients that go away -------------------------------------------------------------------

LONG = 900  # tokens: far longer than any test waits


def open_request(stack: Stack, path: str, body: dict[str, Any]) -> socket.socket:
    """An HTTP/1.1 POST on a raw socket, so the test closes the connection exactly when it
    wants to."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    sock.sendall(head + payload)
    return sock


def latest_started(stack: Stack) -> str | None:
    """The request id whose first token was published last."""
    entries: Any = redis_client().xrevrange(RedisKeys(stack.prefix).started, count=1)
    return entries[0][1][b"r"].decode() if entries else None


def disconnect_cases() -> dict[str, tuple[str, dict[str, Any], bool]]:
    tgi = {"inputs": "go away", "parameters": {"max_new_tokens": LONG, "ignore_eos": True}}
    chat = {
        "model": "tgq-test", "messages": [{"role": "user", "content": "go away"}],
        "max_tokens": LONG, "ignore_eos": True,
    }  # fmt: skip
    return {
        "tgi stream": ("/generate_stream", tgi, True),
        "tgi plain": ("/generate", tgi, False),
        "openai stream": ("/v1/chat/completions", {**chat, "stream": True}, True),
        "openai plain": ("/v1/chat/completions", chat, False),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(disconnect_cases()))
def test_a_client_that_goes_away_frees_its_blocks_within_a_second(shared: Stack, case: str) -> None:
    path, body, is_stream = disconnect_cases()[case]
    before = latest_started(shared)
    dropped_before = metric(shared, 'tgi_request_failure{err="dropped"}')
    sock = open_request(shared, path, body)
    if is_stream:
        received = b""
        while b"data:" not in received:  # the stream has started
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    eventually(lambda: latest_started(shared) not in (before, None), 30, "it never started")
    request_id = latest_started(shared)
    assert request_id is not None
    eventually(lambda: not is_idle(heartbeat(shared)), 5, "its blocks never showed")
    sock.close()
    closed_at = time.time()
    eventually(lambda: final_reason(shared, request_id) is not None, 5, "it never left the batch")
    left_batch_s = time.time() - closed_at
    reason, num_tokens = final_reason(shared, request_id) or ("", 0)
    assert reason == "abort" and 0 < num_tokens < LONG
    freed_s = idle_heartbeat_after(shared, closed_at) - closed_at
    assert left_batch_s <= 1.0 and freed_s <= 1.0, (left_batch_s, freed_s)
    eventually(lambda: metric(shared, "tgq_requests_in_flight") == 0, 5, "still in flight")
    assert metric(shared, 'tgi_request_failure{err="dropped"}') == dropped_before + 1
    job_id = rows(shared, "SELECT job_id FROM job_items WHERE request_id = :r", r=request_id)[0][0]
    eventually(
        lambda: (
            rows(shared, "SELECT status FROM jobs WHERE id = :j", j=job_id)[0][0] == "cancelled"
        ),
        5,
        "its job is not cancelled",
    )
    check_job_invariants(shared, [job_id])
    print(
        f"\n{case}: closed -> left the batch {left_batch_s * 1000:.0f} ms, "
        f"-> heartbeat with every block free {freed_s * 1000:.0f} ms ({num_tokens} tokens)"
    )


# --- 3. 500 concurrent requests, each with its own nonce -------------------------------------

NUM_NONCES = 500
NUM_RERUNS = 16
NONCE = re.compile(r"nonce[0-9a-f]{12}z")


def nonce_request(index: int, nonce: str) -> tuple[str, dict[str, Any]]:
    prompt = f"Tell me about {nonce} please"
    parameters = {"max_new_tokens": 8, "ignore_eos": True, "return_full_text": True}
    if index % 3 == 0:
        return "/generate", {"inputs": prompt, "parameters": {**parameters, "details": True}}
    if index % 3 == 1:
        completion = {"model": "tgq-test", "prompt": prompt, "max_tokens": 8, "echo": True}
        return "/v1/completions", {**completion, "ignore_eos": True}
    return "/generate_stream", {"inputs": prompt, "parameters": parameters}


def answer_text(path: str, response: httpx.Response) -> str:
    """Everything the client got back: the whole body, or every SSE event of the stream."""
    assert response.status_code == 200, response.text
    if path == "/generate_stream":
        events = [
            json.loads(line[5:]) for line in response.text.splitlines() if line[:5] == "data:"
        ]
        assert events and events[-1]["generated_text"] is not None, response.text
    return response.text


@pytest.mark.timeout(240)
def test_five_hundred_concurrent_requests_see_only_their_own_nonce(shared: Stack) -> None:
    rng = random.Random(500)
    nonces = [f"nonce{rng.getrandbits(48):012x}z" for _ in range(NUM_NONCES)]
    requests = [nonce_request(i, nonce) for i, nonce in enumerate(nonces)]
    success_before = metric(shared, "tgi_request_success")
    started = time.time()

    async def run_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=NUM_NONCES + 10)
        async with httpx.AsyncClient(base_url=shared.url, timeout=180, limits=limits) as client:
            return await asyncio.gather(*(client.post(p, json=b) for p, b in requests))

    responses = asyncio.run(run_all())
    elapsed_s = time.time() - started
    for nonce, (path, _), response in zip(nonces, requests, responses, strict=True):
        found = set(NONCE.findall(answer_text(path, response)))
        assert found == {nonce}, f"{path}: {found - {nonce}} in the answer for {nonce}"
    assert metric(shared, "tgi_request_success") == success_before + NUM_NONCES
    check_engine_outputs_are_their_own(shared, requests, responses)
    check_stack_idle(shared, started)
    job_ids = [
        r.job_id
        for r in rows(
            shared,
            "SELECT job_id FROM job_items WHERE created_at >= to_timestamp(:t)",
            t=started,
        )
    ]
    assert len(job_ids) == NUM_NONCES + NUM_RERUNS
    check_job_invariants(shared, job_ids)
    mismatched = rows(
        shared,
        "SELECT r.request_id FROM results r JOIN job_items i USING (job_id, item_index)"
        " WHERE r.job_id = ANY(:ids) AND (r.request_id <> i.request_id"
        " OR r.num_prompt_tokens <> json_array_length(i.prompt_token_ids::json))",
        ids=job_ids,
    )
    assert mismatched == []
    print(f"\n{NUM_NONCES} concurrent nonce requests: {elapsed_s:.1f} s, no cross-talk")


def check_engine_outputs_are_their_own(
    stack: Stack, requests: list[tuple[str, dict[str, Any]]], responses: list[httpx.Response]
) -> None:
    """Greedy output depends only on the prompt: sixteen of the batched answers, rerun alone,
    give the same tokens (an answer carrying another request's tokens would not)."""
    sampled = [i for i, (path, _) in enumerate(requests) if path == "/generate"][:NUM_RERUNS]
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for index in sampled:
            path, body = requests[index]
            alone = client.post(path, json=body).json()["details"]["tokens"]
            batched = responses[index].json()["details"]["tokens"]
            assert [t["id"] for t in alone] == [t["id"] for t in batched]


# --- 4. an engine failure with requests in flight ---------------------------------------------

NUM_IN_FLIGHT = 8


def test_fault_option_parsing_and_wrapping() -> None:
    assert parse_fault("engine_step:10") == 10
    for bad in ("engine_step:0", "engine_step:", "engine_step:x", "rank:3", "10"):
        with pytest.raises(ValueError, match="engine_step:N"):
            parse_fault(bad)
    runner: Any = object()
    assert inject_fault(runner, None) is runner
    assert isinstance(inject_fault(runner, "engine_step:2"), FailingRunner)


NO_BATCHER = "unhealthy: no batcher is alive"


@pytest.mark.timeout(180)
def test_engine_fault_at_step_ten_fails_the_batch_and_health(
    text_model_dir: Path, tmp_path: Path
) -> None:
    options = ("--inject-fault", "engine_step:10")
    with fresh_stack(text_model_dir, tmp_path, batcher_options=options, with_batcher=False) as st:
        body = {"inputs": "doomed", "parameters": {"max_new_tokens": 64, "ignore_eos": True}}

        async def in_flight() -> list[tuple[httpx.Response, float]]:
            async with httpx.AsyncClient(base_url=st.url, timeout=120) as client:

                async def one() -> tuple[httpx.Response, float]:
                    response = await client.post("/generate", json=body)
                    return response, time.time()

                requests = [asyncio.create_task(one()) for _ in range(NUM_IN_FLIGHT)]
                await asyncio.to_thread(wait_queued, st, NUM_IN_FLIGHT)
                st.start_batcher()  # takes all eight at once: they share every step
                return await asyncio.gather(*requests)

        answers = asyncio.run(in_flight())
        fault_at = min(at for _, at in answers)
        for response, _ in answers:
            assert response.status_code == 424, response.text
            assert "injected fault at engine step 10" in response.json()["error"]
        eventually(lambda: httpx.get(f"{st.url}/health").status_code == 503, 5, "still healthy")
        unhealthy_s = time.time() - fault_at
        (batcher,) = st.batchers
        assert batcher.wait(10) != 0
        exited_s = time.time() - fault_at
        assert InjectedFaultError.__name__ in (tmp_path / "batcher-b0.log").read_text()
        job_ids = [r.id for r in rows(st, "SELECT id FROM jobs")]
        assert len(job_ids) == NUM_IN_FLIGHT
        eventually(lambda: _statuses(st) == {"failed"}, 10, lambda: _statuses(st))
        check_job_invariants(st, job_ids)
        reasons = rows(st, "SELECT finish_reason, count(*) FROM results GROUP BY finish_reason")
        assert [tuple(r) for r in reasons] == [("failed", NUM_IN_FLIGHT)]
        # Still unhealthy once the dead batcher's heartbeat has lapsed (4 s) and the monitor
        # has seen it: no batcher, where it said the engine was failing.
        eventually(
            lambda: httpx.get(f"{st.url}/health").json().get("error") == NO_BATCHER,
            15,
            "/health says no batcher is alive",
        )
        print(
            f"\nengine fault at step 10 with {NUM_IN_FLIGHT} in flight: all 424, /health 503 "
            f"after {unhealthy_s * 1000:.0f} ms, batcher exited {batcher.returncode} "
            f"after {exited_s:.1f} s"
        )


def wait_queued(stack: Stack, num_requests: int) -> None:
    keys, client = RedisKeys(stack.prefix), redis_client()

    def depth() -> int:
        return sum(client.xlen(keys.queue(p)) for p in Priority)

    eventually(lambda: depth() == num_requests, 30, lambda: f"queue depth {depth()}")


def _statuses(stack: Stack) -> set[str]:
    return {r.status for r in rows(stack, "SELECT status FROM jobs")}


# --- 5. SIGTERM under load ---------------------------------------------------------------------

NUM_DRAINED = 16
DRAIN_TOKENS = 300
API_DRAIN_TIMEOUT_S = 30  # past the stacks' DRAIN_TIMEOUT_S (5 s) and the persister's last round
BATCHER_DRAIN_TIMEOUT_S = 20  # --drain-timeout-s
# What the api's and the batcher's signal handlers log once they run.
DRAINING = f"signal {int(signal.SIGTERM)}: draining"


async def sigterm_mid_streams(
    stack: Stack,
    client: httpx.AsyncClient,
    process: subprocess.Popen[bytes],
    log_name: str,
    outcome: dict[str, Any],
) -> asyncio.Task[Any]:
    """Opens `NUM_DRAINED` long streams and, once each has its first token, sends SIGTERM to
    `process`; returns when its handler has run (its log `log_name` says so: the api answers
    503 from then on, the batcher pulls nothing more). The streams' task is returned; `outcome`
    gets the process's children and when the signal was sent."""
    started = asyncio.Event()
    streams = asyncio.create_task(open_streams(stack, client, started))
    await asyncio.wait_for(started.wait(), 60)
    outcome["children"] = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    outcome["sigterm_at"] = time.monotonic()
    await asyncio.to_thread(wait_logged, stack, log_name, DRAINING)
    return streams


def wait_logged(stack: Stack, log_name: str, line: str) -> None:
    """Waits until the log `log_name` of the stack's process holds `line`."""
    log = stack.log_dir / f"{log_name}.log"
    eventually(lambda: line in log.read_text(errors="replace"), 30, f"{log.name} says {line!r}")


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.update(children)
        todo += children
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def new_request_refused(stack: Stack) -> str:
    """What a request sent during the drain gets: 503 from a socket that is still open."""
    response = httpx.post(
        f"{stack.url}/generate", json={"inputs": "late", "parameters": {}}, timeout=10
    )
    assert response.status_code == 503, response.text
    assert "shutting down" in response.json()["error"]
    assert response.headers["retry-after"]
    return "503"


async def open_streams(stack: Stack, client: httpx.AsyncClient, started: asyncio.Event) -> Any:
    """NUM_DRAINED long streams; `started` is set once every one has its first token."""
    body = {
        "inputs": "drain me",
        "parameters": {"max_new_tokens": DRAIN_TOKENS, "ignore_eos": True},
    }
    num_started = 0

    async def one() -> dict[str, Any]:
        nonlocal num_started
        events = []
        async with client.stream("POST", "/generate_stream", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 1:
                        num_started += 1
                        if num_started == NUM_DRAINED:
                            started.set()
        return events[-1]

    return await asyncio.gather(*(one() for _ in range(NUM_DRAINED)))


@pytest.mark.timeout(180)
def test_sigterm_of_the_api_finishes_in_flight_streams(
    text_model_dir: Path, tmp_path: Path
) -> None:
    with fresh_stack(text_model_dir, tmp_path) as stack:
        api = stack.api
        assert api is not None
        outcome: dict[str, Any] = {}

        async def run() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
                streams = await sigterm_mid_streams(stack, client, api, stack.name, outcome)
                outcome["new"] = await asyncio.to_thread(new_request_refused, stack)
                finals: list[dict[str, Any]] = await streams
                return finals

        finals = asyncio.run(run())
        for final in finals:
            assert final.get("generated_text") is not None, final
            assert final["index"] == DRAIN_TOKENS, final
        returncode = api.wait(API_DRAIN_TIMEOUT_S + 10)
        drained_s = time.monotonic() - outcome["sigterm_at"]
        assert returncode == 0, stack.api_log()
        assert drained_s <= API_DRAIN_TIMEOUT_S
        assert not [pid for pid in outcome["children"] if is_alive(pid)]
        job_ids = [r.id for r in rows(stack, "SELECT id FROM jobs")]
        assert len(job_ids) == NUM_DRAINED
        assert _statuses(stack) == {"succeeded"}  # persisted before the api exited
        check_job_invariants(stack, job_ids)
        print(
            f"\nSIGTERM api with {NUM_DRAINED} streams: new request {outcome['new']}, all "
            f"{DRAIN_TOKENS} tokens delivered, exit 0 after {drained_s:.1f} s"
        )


@pytest.mark.timeout(180)
def test_sigterm_of_the_batcher_drains_in_flight_and_takes_nothing_new(
    text_model_dir: Path, tmp_path: Path
) -> None:
    options = ("--drain-timeout-s", str(BATCHER_DRAIN_TIMEOUT_S))
    with fresh_stack(text_model_dir, tmp_path, batcher_options=options) as stack:
        (batcher,) = stack.batchers
        outcome: dict[str, Any] = {}
        late = {"prompt": "late", "parameters": {"max_new_tokens": 4}}

        async def run() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
                streams = await sigterm_mid_streams(stack, client, batcher, "batcher-b0", outcome)
                accepted = await client.post("/v1/jobs", json=late)
                assert accepted.status_code == 202, accepted.text
                outcome["late"] = accepted.json()["id"]
                finals: list[dict[str, Any]] = await streams
                return finals

        finals = asyncio.run(run())
        for final in finals:
            assert final.get("generated_text") is not None, final
            assert final["index"] == DRAIN_TOKENS, final
        returncode = batcher.wait(BATCHER_DRAIN_TIMEOUT_S + 10)
        drained_s = time.monotonic() - outcome["sigterm_at"]
        assert returncode == 0
        assert drained_s <= BATCHER_DRAIN_TIMEOUT_S
        assert not [pid for pid in outcome["children"] if is_alive(pid)]
        eventually(lambda: httpx.get(f"{stack.url}/health").status_code == 503, 6, "healthy")
        unhealthy_s = time.monotonic() - outcome["sigterm_at"]
        wait_queued(stack, 1)  # the late job waits for another batcher
        statuses = {r.id: r.status for r in rows(stack, "SELECT id, status FROM jobs")}
        assert statuses.pop(outcome["late"]) == "queued"
        assert set(statuses.values()) == {"succeeded"} and len(statuses) == NUM_DRAINED
        check_job_invariants(stack, list(statuses))
        print(
            f"\nSIGTERM batcher with {NUM_DRAINED} streams: all {DRAIN_TOKENS} tokens delivered, "
            f"exit 0 after {drained_s:.1f} s, a new job stays queued, /health 503 after "
            f"{unhealthy_s:.1f} s"
        )
