"""The api's write path without HTTP: group commit before enqueue, the persister's
commit-then-ack, and admission. Real Postgres; the in-process transport stands in for Redis
(the same contract, tested against both in tests/batcher)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool
from tokenizers import Tokenizer
from tokenizers.models import BPE, WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tests.finals import final_result
from tests.polling import eventually
from tgq.api.admission import Admission, Limits
from tgq.api.db import create_engine, store
from tgq.api.errors import OverloadedError, TemplateError, UnavailableError, ValidationError
from tgq.api.generation import Generation
from tgq.api.health import Health
from tgq.api.ids import new_job_id, parse_request_id, request_id_of
from tgq.api.key_policy import MemoryKeyLimiter
from tgq.api.loops import RECANCEL_S, cancel_and_wait
from tgq.api.metrics import Metrics
from tgq.api.persister import Persister
from tgq.api.recorder import Recorder
from tgq.api.settings import Settings
from tgq.api.tokenizer import INLINE_CHARS, ModelTokenizer
from tgq.batcher.messages import FinalResult, SubmitRequest
from tgq.batcher.request import FinishReason, StoppingParams
from tgq.batcher.transport.base import TransportConfig
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.transport.threaded import ThreadedApiTransport
from tgq.gpu_worker.plan import SamplingParams


def job_of(num_items: int = 1) -> tuple[store.NewJob, list[SubmitRequest]]:
    job_id = new_job_id()
    requests = [
        SubmitRequest(
            request_id=request_id_of(job_id, i),
            prompt_token_ids=[1, 2, 3],
            sampling=SamplingParams(),
            stopping=StoppingParams(),
        )
        for i in range(num_items)
    ]
    job = store.NewJob(
        job_id=job_id,
        kind="job",
        route="/v1/jobs",
        priority=0,
        model="m",
        params={},
        items=[(r.request_id, r.prompt_token_ids) for r in requests],
    )
    return job, requests


def final_of(request_id: str, reason: FinishReason = FinishReason.LENGTH) -> FinalResult:
    return final_result(request_id, [5, 6], finish_reason=reason, num_prompt_tokens=3, text="ab")


def test_request_ids_name_their_row() -> None:
    job_id = new_job_id()
    assert parse_request_id(request_id_of(job_id, 12)) == (job_id, 12)
    assert parse_request_id("r1") is None and parse_request_id("job_x.y") is None


def test_concurrent_submissions_share_commits_and_are_all_enqueued(pg_engine: AsyncEngine) -> None:
    memory = MemoryTransport()

    async def run() -> int:
        transport = ThreadedApiTransport(memory, max_workers=4)
        recorder = Recorder(pg_engine, transport)
        recorder.start()
        jobs = [job_of(2) for _ in range(60)]
        await asyncio.gather(*(recorder.submit(job, requests) for job, requests in jobs))
        await recorder.stop()
        async with pg_engine.connect() as conn:
            for job, _ in jobs:
                assert (await store.get_job(conn, job_id=job.job_id)) is not None
        await transport.close()
        return recorder.num_rounds

    num_rounds = asyncio.run(run())
    assert num_rounds < 60  # grouped
    assert memory.queue_depth() == 120


def test_a_failed_commit_enqueues_nothing() -> None:
    memory = MemoryTransport()
    broken = create_engine("postgresql+asyncpg://root@127.0.0.1:1/none", poolclass=NullPool)

    async def run() -> None:
        transport = ThreadedApiTransport(memory, max_workers=2)
        recorder = Recorder(broken, transport)
        recorder.start()
        job, requests = job_of()
        with pytest.raises(UnavailableError, match="database is unavailable"):
            await recorder.submit(job, requests)
        await recorder.stop()
        await transport.close()

    asyncio.run(run())
    assert memory.queue_depth() == 0


def test_persister_records_then_acks_and_repeats_change_nothing(pg_engine: AsyncEngine) -> None:
    memory = MemoryTransport()
    job, requests = job_of(2)

    async def run() -> None:
        transport = ThreadedApiTransport(memory, max_workers=2)
        async with pg_engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        for request in requests:
            memory.publish_final(final_of(request.request_id))
        persister = Persister(pg_engine, transport, "p0", block_ms=10)
        assert await persister.persist_once() == 2
        assert await persister.persist_once() == 0  # acked: nothing left to take
        memory.publish_final(
            final_of(requests[0].request_id, FinishReason.STOP)
        )  # a repeat is dropped
        assert await persister.persist_once() == 0
        async with pg_engine.connect() as conn:
            stored = await store.get_job(conn, job_id=job.job_id)
            results = await store.get_results(conn, job_id=job.job_id)
        assert stored is not None and stored.status == "succeeded"
        assert [r.finish_reason for r in results] == ["length", "length"]
        assert persister.num_written == 2
        await transport.close()

    asyncio.run(run())


def test_a_result_the_database_refuses_fails_its_item_and_the_rest_are_written(
    pg_engine: AsyncEngine,
) -> None:
    memory = MemoryTransport()
    job, requests = job_of(3)
    unstorable = final_result(
        requests[1].request_id, [5], num_prompt_tokens=3, num_output_tokens=2**31
    )

    async def run() -> None:
        transport = ThreadedApiTransport(memory, max_workers=2)
        async with pg_engine.begin() as conn:
            await store.create_jobs(conn, jobs=[job])
        for request in requests:
            final = unstorable if request == requests[1] else final_of(request.request_id)
            memory.publish_final(final)
        persister = Persister(pg_engine, transport, "p0", block_ms=10)
        assert await persister.persist_once() == 3
        assert await persister.persist_once() == 0  # all acked
        async with pg_engine.connect() as conn:
            stored = await store.get_job(conn, job_id=job.job_id)
            results = await store.get_results(conn, job_id=job.job_id)
        assert stored is not None and stored.status == "succeeded"  # it ended
        assert [r.finish_reason for r in results] == ["length", "failed", "length"]
        assert results[1].finish_detail == "the database refused this result (DBAPIError)"
        await transport.close()

    asyncio.run(run())


def test_persister_does_not_ack_what_it_could_not_commit() -> None:
    memory = MemoryTransport(TransportConfig(lease_s=0.05))
    broken = create_engine("postgresql+asyncpg://root@127.0.0.1:1/none", poolclass=NullPool)
    _, requests = job_of()
    memory.publish_final(final_of(requests[0].request_id))

    async def run() -> None:
        transport = ThreadedApiTransport(memory, max_workers=2)
        persister = Persister(broken, transport, "p0", block_ms=10)
        with pytest.raises(OSError):
            await persister.persist_once()
        await transport.close()

    asyncio.run(run())
    # Past the lease, another persister takes the un-acked result.
    taken = eventually(lambda: memory.pull_finals("p1", 10, 0), 5, "p1 takes the result")
    assert [s.result.request_id for s in taken] == [requests[0].request_id]


def test_cancel_and_wait_ends_a_task_that_swallowed_its_cancellation() -> None:
    """The loop below drops its first cancellation and goes back to sleeping, as the api's
    monitor once did inside a Redis call; a plain cancel-then-await would wait forever."""
    swallowed = 0

    async def stubborn_loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    async def main() -> float:
        task = asyncio.create_task(stubborn_loop())
        await asyncio.sleep(0)
        started = time.monotonic()
        await asyncio.wait_for(cancel_and_wait(task), timeout=5)
        assert task.cancelled()
        return time.monotonic() - started

    assert asyncio.run(main()) < RECANCEL_S + 0.4
    assert swallowed == 1


def test_cancel_and_wait_logs_how_a_task_failed(caplog: pytest.LogCaptureFixture) -> None:
    async def failing() -> None:
        raise RuntimeError("lost Redis")

    async def main() -> None:
        task = asyncio.create_task(failing(), name="monitor")
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    asyncio.run(main())
    assert "task monitor ended with RuntimeError('lost Redis')" in caplog.text


def test_admission_limits() -> None:
    rejected: list[str] = []
    limits = Limits(
        max_concurrent_requests=2, max_queued_requests=5, max_queued_tokens=100, retry_after_s=3
    )
    admission = Admission(limits, on_reject=rejected.append)
    first, second = admission.admit(), admission.admit()
    with pytest.raises(OverloadedError) as caught:
        admission.admit()
    assert caught.value.retry_after_s == 3 and caught.value.headers() == {"Retry-After": "3"}
    first.release()
    first.release()  # idempotent
    third = admission.admit()
    third.add_tokens(100)
    second.release()
    with pytest.raises(OverloadedError, match="tokens in flight"):
        admission.admit()
    third.release()
    admission.set_queue_depth(4)
    admission.check_queue(1)
    with pytest.raises(OverloadedError, match="Queue is full: 4 requests queued"):
        admission.check_queue(2)
    assert rejected == ["concurrency", "queue_tokens", "queue_requests"]
    assert (admission.num_in_flight, admission.num_tokens) == (0, 0)


def test_a_depth_read_racing_a_submission_counts_it_once() -> None:
    """Submissions are noted before their write; a read sent before a note may or may not see
    that write: the larger view is kept, so the request is counted once, not twice or never."""
    admission = Admission(Limits(8, 3, 10**6, 1))
    since = admission.num_submissions
    admission.note_submitted(1)  # the write lands before the read runs: the read sees it
    admission.set_queue_depth(1, since=since)
    assert admission.queue_depth == 1
    since = admission.num_submissions
    admission.note_submitted(1)  # the write lands after the read ran: the read misses it
    admission.set_queue_depth(1, since=since)
    assert admission.queue_depth == 2
    since = admission.num_submissions
    admission.set_queue_depth(0, since=since)  # no submission during the read: the read wins
    assert admission.queue_depth == 0
    with pytest.raises(RuntimeError), admission.submitting(2):
        assert admission.queue_depth == 2  # counted before the write
        raise RuntimeError("the write failed")
    assert admission.queue_depth == 0  # taken back
    with admission.submitting(1) as submission:
        pass  # an idempotent repeat: nothing new queued
    assert admission.queue_depth == 0
    with admission.submitting(1) as submission:
        submission.is_queued = True
    assert admission.queue_depth == 1


def test_admitted_gives_the_ticket_back_only_when_the_request_never_started(
    pg_engine: AsyncEngine,
) -> None:
    """The routes' admit, then validate and start: a start that raises frees the slot and
    counts why (a 422 as `validation` or `template`); one that returns keeps its ticket."""
    settings = Settings.model_validate({})
    metrics = Metrics(max_input_tokens=6, max_total_tokens=10)
    admission = Admission(
        Limits(max_concurrent_requests=1, max_queued_requests=5, max_queued_tokens=100,
               retry_after_s=1),
    )  # fmt: skip

    async def run() -> None:
        transport = ThreadedApiTransport(MemoryTransport(), max_workers=1)
        tokenizer = ModelTokenizer(Tokenizer(BPE()), max_workers=1)
        generation = Generation(
            settings=settings, db=pg_engine, transport=transport, tokenizer=tokenizer,
            metrics=metrics, admission=admission, recorder=Recorder(pg_engine, transport),
            limiter=MemoryKeyLimiter(),
        )  # fmt: skip
        for error in (ValidationError("bad"), TemplateError("broken"), asyncio.CancelledError()):
            with pytest.raises(type(error)), generation.admitted():
                await asyncio.sleep(0)
                raise error
            assert admission.num_in_flight == 0
        with generation.admitted() as ticket:
            await asyncio.sleep(0)
        assert admission.num_in_flight == 1 and not ticket.is_released
        with pytest.raises(OverloadedError), generation.admitted():  # the held ticket's slot
            pytest.fail("a refused request runs nothing")
        generation.release(ticket)
        assert admission.num_in_flight == 0
        tokenizer.close()
        await transport.close()

    asyncio.run(run())
    lines = [line for line in metrics.render().decode().splitlines() if not line.startswith("#")]
    samples = {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)}
    assert samples['tgi_request_failure{err="validation"}'] == 1
    assert samples['tgi_request_failure{err="template"}'] == 1
    assert samples['tgi_request_failure{err="overloaded"}'] == 1
    assert samples["tgi_request_count"] == 5


def test_health_names_its_problem() -> None:
    health = Health()
    assert health.problem == "no batcher is alive"
    health.num_batchers = 1
    assert health.problem is None
    health.observe(
        final_result(
            "r0",
            [],
            finish_reason=FinishReason.FAILED,
            finish_detail="CUDA error: out of memory",
            num_prompt_tokens=3,
        )
    )
    assert health.problem == "the engine is failing: CUDA error: out of memory"
    health.observe(final_of("r1", FinishReason.ABORT))  # an abort says nothing about the engine
    assert health.problem is not None
    health.observe(final_of("r2", FinishReason.STOP))
    assert health.problem is None


def test_a_short_text_is_encoded_on_the_event_loop_and_a_long_one_on_the_pool() -> None:
    """Up to INLINE_CHARS characters the event loop's own thread encodes the text (no hand-off);
    past it, the tokenizer's pool does; both count as calls and give the same ids."""
    threads: list[str] = []
    calls: list[None] = []

    one_letter = Tokenizer(WordLevel(vocab={"a": 0}, unk_token="a"))
    one_letter.pre_tokenizer = Whitespace()
    tokenizer = ModelTokenizer(one_letter, max_workers=1, on_call=lambda: calls.append(None))
    encode_sync = tokenizer.encode_sync

    def recording(text: str, *, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode_sync(text, add_special_tokens=add_special_tokens)

    tokenizer.encode_sync = recording  # type: ignore[method-assign]

    async def run() -> tuple[list[int], list[int], str]:
        short = await tokenizer.encode("a " * (INLINE_CHARS // 2))  # INLINE_CHARS characters
        long = await tokenizer.encode("a " * (INLINE_CHARS // 2) + "a")
        return short, long, threading.current_thread().name

    short, long, loop_thread = asyncio.run(run())
    tokenizer.close()
    assert threads[0] == loop_thread and threads[1].startswith("tokenizer")
    assert len(calls) == 2
    assert short == [0] * (INLINE_CHARS // 2) and long == [0] * (INLINE_CHARS // 2 + 1)
