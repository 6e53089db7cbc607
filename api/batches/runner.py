"""Running one batch: its input file becomes one job of kind `batch` (one item per valid line,
each with its own parameters), fed to the transport in a bounded window, then its results become
the output and error files.

A batch is driven by one runner at a time: the runner holds the batch's lease in the database
and renews it as it goes; a second runner started for the same batch (a task delivered twice,
a reconciler that thought it lost) finds the lease taken and leaves. A runner that dies stops
renewing; when the lease has run out, the reconciler starts another, which goes on where the
database says the batch is: validation resumes after the last committed chunk of lines, the
window enqueues only items the transport does not know (items are rebuilt from their rows, as
the reconciler does for jobs), and finalizing is redone from the start (its files have ids of
the batch's own, so a redo replaces them). Nothing finished is redone.

Statuses, as OpenAI's: validating → in_progress → finalizing → completed; failed (the input
could not be read); cancelling → cancelled; expired (past `expires_at`: unfinished lines go to
the error file as `batch_expired`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.chat_template import TemplateError as RenderError
from tgq.api.chat_template import normalize_messages
from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.db import store
from tgq.api.errors import ApiError
from tgq.api.files.storage import FileStorage
from tgq.api.generation import new_job_id, request_id_of
from tgq.api.reconciler import rebuild_request
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest
from tgq.api.service import job_params
from tgq.api.settings import Settings
from tgq.api.tokenizer import ModelTokenizer
from tgq.api.validated import ValidatedRequest
from tgq.api.validation import chat_params, completion_params, validate_tokens
from tgq.batcher.request import Priority
from tgq.batcher.transport.aio import AsyncApiTransport

log = logging.getLogger(__name__)
POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class BatchContext:
    engine: AsyncEngine
    transport: AsyncApiTransport
    storage: FileStorage
    tokenizer: ModelTokenizer
    settings: Settings
    window: int = 256  # at most this many of a batch's requests in the transport at once
    lease_s: float = 30.0  # a runner silent this long is taken for dead
    chunk_lines: int = 500  # lines validated, committed and written per round
    runner_id: str = field(default_factory=lambda: f"runner-{secrets.token_hex(6)}")


class LeaseLostError(Exception):
    """Another runner took the batch over (this one was too slow to renew its lease)."""


class _Lease:
    """This runner's hold on one batch, renewed at most every third of its length."""

    def __init__(self, ctx: BatchContext, batch_id: str) -> None:
        self.ctx, self.batch_id = ctx, batch_id
        self.renewed = -float("inf")

    async def take(self) -> bool:
        async with self.ctx.engine.begin() as conn:
            taken = await db_batches.claim(
                conn, batch_id=self.batch_id, runner_id=self.ctx.runner_id,
                lease_s=self.ctx.lease_s,
            )  # fmt: skip
        if taken:
            self.renewed = time.monotonic()
        return taken

    async def release(self) -> None:
        async with self.ctx.engine.begin() as conn:
            await db_batches.release(conn, batch_id=self.batch_id, runner_id=self.ctx.runner_id)

    async def renew(self) -> None:
        if time.monotonic() - self.renewed >= self.ctx.lease_s / 3 and not await self.take():
            raise LeaseLostError(self.batch_id)


async def run_batch(ctx: BatchContext, batch_id: str) -> str:
    """Drives the batch to a terminal status and returns it; a batch another runner holds is
    left alone (its status is returned)."""
    lease = _Lease(ctx, batch_id)
    if not await lease.take():
        batch = await _get(ctx, batch_id)
        if not batch.is_finished:
            log.info("batch %s: runner %s holds it", batch_id, batch.runner_id)
        return batch.status
    try:
        batch = await _get(ctx, batch_id)
        if batch.status == "validating":
            batch = await _prepare(ctx, batch, lease)
        if batch.status in ("in_progress", "cancelling"):
            await _drive(ctx, batch, lease)
        if (await _get(ctx, batch_id)).status == "finalizing":
            await _finalize(ctx, batch_id, lease)
    except LeaseLostError:
        log.warning("batch %s: another runner took it over; %s stops", batch_id, ctx.runner_id)
    except asyncio.CancelledError:  # this process stops: the next runner need not wait
        await asyncio.shield(lease.release())
        raise
    return (await _get(ctx, batch_id)).status


async def _get(ctx: BatchContext, batch_id: str) -> db_batches.BatchRecord:
    async with ctx.engine.connect() as conn:
        batch = await db_batches.get_batch(conn, batch_id=batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id!r}")
    return batch


# --- validating: lines → one job, a chunk at a time -------------------------------------------


async def _prepare(
    ctx: BatchContext, batch: db_batches.BatchRecord, lease: _Lease
) -> db_batches.BatchRecord:
    """Validates the lines after those already committed, `chunk_lines` per transaction, then
    moves the batch to `in_progress` (or stops, when it is being cancelled)."""
    job_id = batch.job_id or await _create_job(ctx, batch)
    async with ctx.engine.connect() as conn:
        num_lines, num_items = await db_batches.count_lines(conn, batch_id=batch.id)
    lines: list[db_batches.LineRecord] = []
    items: list[tuple[str, list[int]]] = []
    params: list[dict[str, Any]] = []

    async def commit() -> bool:
        """Writes the chunk; False when the batch is no longer validating (cancelled)."""
        nonlocal num_items
        await lease.renew()
        async with ctx.engine.begin() as conn:
            if await db_batches.lock_status(conn, batch_id=batch.id) != "validating":
                return False
            await db_batches.add_items(
                conn, job_id=job_id, first_index=num_items, items=items, params=params
            )
            await db_batches.add_lines(conn, lines=lines)
        num_items += len(items)
        for chunk in (lines, items, params):
            chunk.clear()
        return True

    try:
        async for line_index, raw in _read_lines(ctx, batch.input_file_id, skip=num_lines):
            custom_id = str(raw.get("custom_id", ""))
            try:
                if raw.get("url") != batch.endpoint:
                    raise ValueError(f"url {raw.get('url')!r} is not the batch's {batch.endpoint}")
                validated = await _validate(ctx, batch.endpoint, raw.get("body", {}))
            except (ApiError, RenderError, ValueError) as error:
                message = error.message if isinstance(error, ApiError) else str(error)
                lines.append(db_batches.LineRecord(batch.id, line_index, custom_id, None, message))
            else:
                item_index = num_items + len(items)
                items.append((request_id_of(job_id, item_index), validated.prompt_token_ids))
                params.append(job_params(validated.params))
                line = db_batches.LineRecord(batch.id, line_index, custom_id, item_index, None)
                lines.append(line)
            if len(lines) >= ctx.chunk_lines and not await commit():
                return await _get(ctx, batch.id)
    except (OSError, LookupError, json.JSONDecodeError) as error:
        async with ctx.engine.begin() as conn:
            await db_batches.set_status(
                conn, batch_id=batch.id, status="failed", only_from=("validating",),
                error=f"the input file could not be read: {error}",
            )  # fmt: skip
        return await _get(ctx, batch.id)
    if not await commit():
        return await _get(ctx, batch.id)
    async with ctx.engine.begin() as conn:
        num_lines, num_items = await db_batches.count_lines(conn, batch_id=batch.id)
        await db_batches.set_num_items(conn, job_id=job_id, num_items=num_items)
        await db_batches.set_status(
            conn, batch_id=batch.id, status="in_progress", only_from=("validating",),
            num_total=num_lines,
        )  # fmt: skip
    return await _get(ctx, batch.id)


async def _create_job(ctx: BatchContext, batch: db_batches.BatchRecord) -> str:
    """The batch's job, without items yet (they come with their lines)."""
    job_id = new_job_id()
    job = store.NewJob(
        job_id=job_id, kind="batch", route=batch.endpoint, priority=int(Priority.BULK),
        model=ctx.settings.model_id, params={}, items=[], api_key_id=batch.api_key_id,
        deadline=batch.expires_at, metadata={"batch_id": batch.id},
    )  # fmt: skip
    async with ctx.engine.begin() as conn:
        await store.create_jobs(conn, jobs=[job])
        await db_batches.set_job(conn, batch_id=batch.id, job_id=job_id)
    return job_id


async def _read_lines(
    ctx: BatchContext, file_id: str, *, skip: int
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The file's non-blank lines after the first `skip`, parsed, streamed from the storage."""
    async with ctx.engine.connect() as conn:
        record = await db_files.get_file(conn, file_id=file_id)
    if record is None:
        raise LookupError(f"file {file_id} is gone")
    line_index, rest = 0, b""
    chunks = ctx.storage.read(record.storage_key)
    while True:
        chunk = await anext(chunks, None)
        rows = (rest + (chunk or b"\n")).split(b"\n")
        rest = rows.pop()
        for row in rows:
            if row.strip():
                if line_index >= skip:
                    yield line_index, json.loads(row)
                line_index += 1
        if chunk is None:
            return


async def _validate(ctx: BatchContext, endpoint: str, body: dict[str, Any]) -> ValidatedRequest:
    """A line's body through the same checks as the interactive route."""
    settings, tokenizer = ctx.settings, ctx.tokenizer
    if endpoint == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        params = chat_params(chat, settings)
        if tokenizer.chat_template is None:
            raise ValueError("this model has no chat template")
        messages = normalize_messages([m.model_dump(exclude_none=True) for m in chat.messages])
        prompt = await tokenizer.run(tokenizer.chat_template.render, messages)
    else:
        completion = CompletionRequest.model_validate(body)
        params = completion_params(completion, settings)
        if not isinstance(completion.prompt, str):
            raise ValueError("a batch line takes one prompt (a string)")
        prompt = completion.prompt
    if params.num_choices > 1:
        raise ValueError("`n` > 1 is not supported in batches")
    token_ids = await tokenizer.encode(prompt, add_special_tokens=params.add_special_tokens)
    return validate_tokens(
        prompt=prompt, token_ids=token_ids, params=params, settings=settings,
        priority=Priority.BULK, eos_token_ids=tokenizer.eos_token_ids,
    )  # fmt: skip


# --- in_progress: the window ------------------------------------------------------------------


async def _drive(ctx: BatchContext, batch: db_batches.BatchRecord, lease: _Lease) -> None:
    """Feeds the window until the job ends, the batch is cancelled or it expires; then moves
    the batch to `finalizing`, recording the status that ends it."""
    while True:
        await lease.renew()
        batch = await _get(ctx, batch.id)
        if batch.status not in ("in_progress", "cancelling") or batch.job_id is None:
            outcome = "cancelled" if batch.status == "cancelling" else "completed"
            break
        if batch.status == "cancelling" or datetime.now(UTC) >= batch.expires_at:
            await _stop_job(ctx, batch.job_id)
            outcome = "cancelled" if batch.status == "cancelling" else "expired"
            break
        async with ctx.engine.connect() as conn:
            job = await store.get_job(conn, job_id=batch.job_id)
            window = await db_batches.open_items(conn, job_id=batch.job_id, limit=ctx.window)
        assert job is not None
        completed = job.num_items_done - job.num_items_failed
        if (completed, job.num_items_failed) != (batch.num_completed, batch.num_failed):
            async with ctx.engine.begin() as conn:
                await db_batches.set_counts(
                    conn, batch_id=batch.id, completed=completed, failed=job.num_items_failed
                )
        if job.is_finished or job.num_items_done >= job.num_items:
            outcome = "completed"
            break
        missing = set(await ctx.transport.missing([item.request_id for item in window]))
        if missing:
            eos = ctx.tokenizer.eos_token_ids
            requests = [
                rebuild_request(item, job, ctx.settings, eos, attempt=item.attempts + 1)
                for item in window
                if item.request_id in missing
            ]
            await ctx.transport.submit(requests)
        await asyncio.sleep(POLL_S)
    async with ctx.engine.begin() as conn:
        await db_batches.set_status(
            conn, batch_id=batch.id, status="finalizing", only_from=("in_progress", "cancelling"),
            finalizing_to=outcome,
        )  # fmt: skip


async def _stop_job(ctx: BatchContext, job_id: str) -> None:
    """Cancels the job's unfinished items (the cancel route may have done it already) and aborts
    those that can be in the transport: the first `window` of them, in item order."""
    async with ctx.engine.begin() as conn:
        request_ids = await store.cancel_job(conn, job_id=job_id) or []
    for request_id in request_ids[: ctx.window]:
        await ctx.transport.abort(request_id, "batch cancelled or expired")


# --- finalizing: the output and error files ---------------------------------------------------


@dataclass
class _Tally:
    num_lines: int = 0
    num_outputs: int = 0
    num_errors: int = 0


async def _finalize(ctx: BatchContext, batch_id: str, lease: _Lease) -> None:
    """Writes the output file, then the error file, a chunk of lines at a time, and ends the
    batch in the status recorded when it entered `finalizing`."""
    batch = await _get(ctx, batch_id)
    outcome = batch.finalizing_to or "completed"
    tally = _Tally()

    async def rows(want_output: bool) -> AsyncIterator[bytes]:
        first = 0
        while True:
            await lease.renew()
            async with ctx.engine.connect() as conn:
                lines = await db_batches.get_lines(
                    conn, batch_id=batch_id, first=first, limit=ctx.chunk_lines
                )
                indexes = [line.item_index for line in lines if line.item_index is not None]
                results = {}
                if batch.job_id is not None and indexes:
                    found = await store.get_results(conn, job_id=batch.job_id, item_indexes=indexes)
                    results = {result.item_index: result for result in found}
            if not lines:
                return
            for line in lines:
                result = None if line.item_index is None else results.get(line.item_index)
                is_output, row = _line_of(ctx, batch, line, result, outcome)
                if is_output == want_output:
                    yield (json.dumps(row, ensure_ascii=False) + "\n").encode()
                if want_output:
                    tally.num_lines += 1
                    tally.num_outputs += is_output
                else:
                    tally.num_errors += not is_output
            first = lines[-1].line_index + 1

    output_id = await _write_file(ctx, batch, "output", rows(want_output=True))
    error_id = await _write_file(ctx, batch, "error", rows(want_output=False))
    async with ctx.engine.begin() as conn:
        await db_batches.set_status(
            conn, batch_id=batch_id, status=outcome, only_from=("finalizing",),
            output_file_id=output_id, error_file_id=error_id, num_total=tally.num_lines,
            num_completed=tally.num_outputs, num_failed=tally.num_errors,
        )  # fmt: skip


def _line_of(
    ctx: BatchContext,
    batch: db_batches.BatchRecord,
    line: db_batches.LineRecord,
    result: store.ResultRecord | None,
    outcome: str,
) -> tuple[bool, dict[str, Any]]:
    """The line's row, and whether it goes to the output file (else the error file)."""
    if line.error is not None:
        return False, _error_line(line, "invalid_request", line.error)
    if result is not None and result.finish_reason in ("stop", "length"):
        return True, _output_line(ctx, batch, line, result)
    if outcome == "expired" and (result is None or result.finish_reason in ("deadline", "abort")):
        # the batcher ends what is still running at `expires_at` itself ("deadline")
        return False, _error_line(line, "batch_expired", "the batch expired first")
    if result is None or result.finish_reason == "abort":
        return False, _error_line(line, "batch_cancelled", "the batch was cancelled first")
    return False, _error_line(line, result.finish_reason, result.finish_detail or "")


def _output_line(
    ctx: BatchContext,
    batch: db_batches.BatchRecord,
    line: db_batches.LineRecord,
    result: store.ResultRecord,
) -> dict[str, Any]:
    usage = {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": result.num_output_tokens,
        "total_tokens": result.num_prompt_tokens + result.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }
    finish_reason = "length" if result.finish_reason == "length" else "stop"
    text = result.text or ""
    created = int(result.created_at.timestamp())
    body: dict[str, Any]
    if batch.endpoint == "/v1/chat/completions":
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"chatcmpl-{result.request_id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"cmpl-{result.request_id}", "object": "text_completion"}
    body.update(created=created, model=ctx.settings.model_id, choices=[choice], usage=usage)
    response = {"status_code": 200, "request_id": result.request_id, "body": body}
    return {"id": _line_id(line), "custom_id": line.custom_id, "response": response, "error": None}


def _error_line(line: db_batches.LineRecord, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": _line_id(line), "custom_id": line.custom_id, "response": None, "error": error}


def _line_id(line: db_batches.LineRecord) -> str:
    """The line's id in the output: the same when finalizing is redone."""
    return f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.line_index}"


async def _write_file(
    ctx: BatchContext, batch: db_batches.BatchRecord, kind: str, rows: AsyncIterator[bytes]
) -> str | None:
    """Streams the rows to the batch's `kind` file; its id, or None when there were no rows.
    The id is the batch's own, so a redone finalizing replaces the file."""
    file_id = f"file-{kind}-{batch.id.removeprefix('batch_')}"
    num_lines = 0

    async def counted() -> AsyncIterator[bytes]:
        nonlocal num_lines
        async for row in rows:
            num_lines += 1
            yield row

    num_bytes = await ctx.storage.write(file_id, counted())
    if num_lines == 0:
        await ctx.storage.delete(file_id)
        return None
    async with ctx.engine.begin() as conn:
        await db_files.purge_file(conn, file_id=file_id)
        await db_files.create_file(
            conn, file_id=file_id, purpose="batch_output", filename=f"{batch.id}_{kind}.jsonl",
            num_bytes=num_bytes, num_lines=num_lines, storage_key=file_id,
            api_key_id=batch.api_key_id,
        )  # fmt: skip
    return file_id
