"""The batch runner on real Postgres, without a batcher (nothing runs the lines unless a test
records their results): one runner per batch through its lease, validation resumed after the
last committed chunk, finalizing redone with the same files."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.db import store
from tgq.api.files.storage import LocalFileStorage
from tgq.api.settings import Settings
from tgq.api.tokenizer import ModelTokenizer
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.transport.threaded import ThreadedApiTransport
from tgq.bulk.batches.context import BatchContext
from tgq.bulk.batches.driver import run_batch

pytestmark = pytest.mark.timeout(60)
CHAT = "/v1/chat/completions"


def jsonl(num_lines: int) -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}", "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3 + i},
        }
        for i in range(num_lines)
    ]  # fmt: skip
    return "\n".join(json.dumps(row) for row in rows).encode()


class SlowStorage(LocalFileStorage):
    """Hands out one line per chunk, and stops handing out after `stall_after` lines."""

    def __init__(self, root_dir: Path, stall_after: int) -> None:
        super().__init__(root_dir)
        self.stall_after = stall_after

    async def read(self, key: str) -> AsyncIterator[bytes]:
        content = b"".join([chunk async for chunk in super().read(key)])
        for index, row in enumerate(content.splitlines(keepends=True)):
            if index == self.stall_after:
                await asyncio.Event().wait()  # forever: the runner is stopped meanwhile
            yield row


@pytest.fixture
def context(pg_engine: AsyncEngine, text_model_dir: Path, tmp_path: Path) -> Iterator[BatchContext]:
    tokenizer = ModelTokenizer.from_model_dir(text_model_dir)
    transport = ThreadedApiTransport(MemoryTransport(), max_workers=2)
    settings = Settings.model_validate({"model_id": "m"})
    storage = LocalFileStorage(tmp_path / "files")
    yield BatchContext(pg_engine, transport, storage, tokenizer, settings, lease_s=0.6)
    tokenizer.close()


async def new_batch(
    ctx: BatchContext, num_lines: int, content: bytes | None = None, endpoint: str = CHAT
) -> str:
    await ctx.storage.write("file-in", _once(content or jsonl(num_lines)))
    async with ctx.db.begin() as conn:
        await db_files.create_file(
            conn, file_id="file-in", purpose="batch", filename="in.jsonl",
            num_bytes=1, num_lines=num_lines, storage_key="file-in",
        )  # fmt: skip
        batch = await db_batches.create_batch(
            conn, batch_id="batch_test", endpoint=endpoint, input_file_id="file-in",
            completion_window="1h", expires_at=datetime.now(UTC) + timedelta(hours=1),
            dispatch_grace_s=0,
        )  # fmt: skip
    return batch.id


async def _once(content: bytes) -> AsyncIterator[bytes]:
    yield content


async def get(ctx: BatchContext, batch_id: str) -> db_batches.BatchRecord:
    async with ctx.db.connect() as conn:
        batch = await db_batches.get_batch(conn, batch_id=batch_id)
    assert batch is not None
    return batch


async def finish_every_item(ctx: BatchContext, batch_id: str) -> None:
    """What the persister would record, had a batcher run the batch's items."""
    job_id = (await get(ctx, batch_id)).job_id
    assert job_id is not None
    async with ctx.db.begin() as conn:
        items = await store.get_items(conn, job_id=job_id)
        await store.record_results(
            conn,
            results=[
                store.NewResult(
                    job_id=job_id, item_index=item.item_index, request_id=item.request_id,
                    text=f"answer {item.item_index}", token_ids=[5], logprobs=None,
                    finish_reason="length", finish_detail=None,
                    num_prompt_tokens=len(item.prompt_token_ids), num_output_tokens=1,
                    num_cached_tokens=0, attempt=1, batcher_id="b0",
                )
                for item in items
            ],
        )  # fmt: skip


async def wait_for(condition: object, timeout_s: float = 10) -> None:
    async def poll() -> None:
        while not await condition():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


def test_one_runner_drives_a_batch_and_a_second_leaves_it_alone(context: BatchContext) -> None:
    async def main() -> None:
        batch_id = await new_batch(context, 5)
        first = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        other = replace(context, runner_id="runner-other")
        assert await run_batch(other, batch_id) == "in_progress"  # held: it left at once
        async with context.db.begin() as conn:  # nobody resumes a batch that is driven
            assert await db_batches.lapsed_batches(conn, grace_s=5) == []
        batch = await get(context, batch_id)
        assert batch.runner_id == context.runner_id and batch.job_id is not None
        await finish_every_item(context, batch_id)
        assert await asyncio.wait_for(first, 10) == "completed"
        done = await get(context, batch_id)
        assert (done.runner_id, done.lease_until) == (None, None)
        assert (done.num_total, done.num_completed, done.num_failed) == (5, 5, 0)

    asyncio.run(main())


def test_a_stopped_runner_lets_the_next_one_take_over_at_once(context: BatchContext) -> None:
    async def main() -> None:
        batch_id = await new_batch(context, 4)
        first = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        async with context.db.begin() as conn:  # released: the reconciler sees it now
            assert await db_batches.lapsed_batches(conn, grace_s=5) == [batch_id]
        await finish_every_item(context, batch_id)
        other = replace(context, runner_id="runner-other")
        assert await run_batch(other, batch_id) == "completed"

    asyncio.run(main())


def test_a_dead_runners_lease_runs_out_before_another_takes_the_batch(
    context: BatchContext,
) -> None:
    async def main() -> None:
        batch_id = await new_batch(context, 2)
        async with context.db.begin() as conn:
            taken = await db_batches.claim(
                conn, batch_id=batch_id, runner_id="runner-dead", lease_s=0.5
            )
        assert taken
        assert await run_batch(context, batch_id) == "validating"  # still the dead one's
        async with context.db.begin() as conn:
            assert await db_batches.lapsed_batches(conn, grace_s=5) == []
        await asyncio.sleep(0.6)
        async with context.db.begin() as conn:
            assert await db_batches.lapsed_batches(conn, grace_s=0) == [batch_id]
        runner = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        await finish_every_item(context, batch_id)
        assert await asyncio.wait_for(runner, 10) == "completed"

    asyncio.run(main())


def test_validation_resumes_after_the_last_committed_chunk(
    context: BatchContext, tmp_path: Path
) -> None:
    async def main() -> None:
        batch_id = await new_batch(context, 10)
        slow = SlowStorage(tmp_path / "files", stall_after=7)
        stalling = replace(context, storage=slow, chunk_lines=3, runner_id="runner-stalled")
        first = asyncio.create_task(run_batch(stalling, batch_id))

        async def two_chunks() -> bool:
            async with context.db.connect() as conn:
                return await db_batches.count_lines(conn, batch_id=batch_id) == (6, 6)

        await wait_for(two_chunks)
        first.cancel()  # the runner dies with line 6 validated but not committed
        with pytest.raises(asyncio.CancelledError):
            await first
        resumed = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        batch = await get(context, batch_id)
        async with context.db.connect() as conn:
            lines = await db_batches.get_lines(conn, batch_id=batch_id)
            job = await store.get_job(conn, job_id=batch.job_id or "")
        assert [line.custom_id for line in lines] == [f"line-{i}" for i in range(10)]
        assert [line.item_index for line in lines] == list(range(10))
        assert job is not None and job.num_items == 10 and batch.num_total == 10
        await finish_every_item(context, batch_id)
        assert await asyncio.wait_for(resumed, 10) == "completed"

    asyncio.run(main())


def test_invalid_lines_get_errors_and_no_item(context: BatchContext) -> None:
    """A line is one sequence: `n` or `best_of` over 1 is refused, as a prompt list is; the
    route's own check words the error as the route does. Valid lines number their items."""
    completions = "/v1/completions"
    bodies = [
        {"prompt": "ok", "max_tokens": 2},
        {"prompt": "two", "max_tokens": 2, "n": 2},
        {"prompt": "best", "max_tokens": 2, "best_of": 2},
        {"prompt": ["a", "b"], "max_tokens": 2},
        {"prompt": "neg", "max_tokens": 2, "temperature": -1},
        {"prompt": "ok too", "max_tokens": 2},
        {"prompt": "schema", "max_tokens": 2, "guided_json": {"type": "strin"}},
        {"prompt": "json", "max_tokens": 8, "guided_json": {"type": "integer"}},
    ]
    rows = [
        {"custom_id": f"l{i}", "method": "POST", "url": completions, "body": body}
        for i, body in enumerate(bodies)
    ]
    rows.append({"custom_id": "chat", "method": "POST", "url": CHAT, "body": bodies[0]})
    content = "\n".join(json.dumps(row) for row in rows).encode()

    async def main() -> None:
        batch_id = await new_batch(context, len(rows), content, endpoint=completions)
        task = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        async with context.db.connect() as conn:
            lines = await db_batches.get_lines(conn, batch_id=batch_id)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        by_id = {line.custom_id: line for line in lines}
        assert [by_id[key].item_index for key in ("l0", "l5", "l7")] == [0, 1, 2]
        assert by_id["l0"].error is None and by_id["l5"].error is None
        assert by_id["l1"].error == "`n` > 1 is not supported in batches"
        assert by_id["l2"].error == "`best_of` > 1 is not supported in batches"
        assert by_id["l3"].error == "a batch line takes one prompt (a string)"
        assert by_id["l6"].error == (
            "`guided_json` is not valid: invalid json_schema: Invalid type: strin"
        )
        assert by_id["l4"].error is not None and "temperature" in by_id["l4"].error
        assert by_id["chat"].error == (f"url '{CHAT}' is not the batch's {completions}")
        rejected = ("l1", "l2", "l3", "l4", "l6", "chat")
        assert all(by_id[key].item_index is None for key in rejected)

    asyncio.run(main())


def test_finalizing_redone_writes_the_same_files(context: BatchContext) -> None:
    async def main() -> None:
        batch_id = await new_batch(context, 3)
        runner = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        await finish_every_item(context, batch_id)
        assert await asyncio.wait_for(runner, 10) == "completed"
        done = await get(context, batch_id)
        first = b"".join([c async for c in context.storage.read(done.output_file_id or "")])
        async with context.db.begin() as conn:  # as if it died while finalizing
            await db_batches.set_status(
                conn, batch_id=batch_id, status="finalizing", only_from=("completed",),
                finalizing_to="completed",
            )  # fmt: skip
        assert await run_batch(context, batch_id) == "completed"
        redone = await get(context, batch_id)
        assert redone.output_file_id == done.output_file_id and redone.error_file_id is None
        again = b"".join([c async for c in context.storage.read(redone.output_file_id or "")])
        assert again == first and len(again.splitlines()) == 3
        async with context.db.connect() as conn:
            outputs = await db_files.list_files(conn, limit=10, purpose="batch_output")
        assert [f.id for f in outputs] == [done.output_file_id]

    asyncio.run(main())


async def _status_is(ctx: BatchContext, batch_id: str, status: str) -> bool:
    return (await get(ctx, batch_id)).status == status
