"""`validating`: a batch's input lines become one job of kind `batch`, one item per valid line
(each with its own parameters), `chunk_lines` lines per transaction; validation resumes after
the last committed chunk."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tgq.api.chat_prompt import render_chat
from tgq.api.db import api_keys, store
from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.errors import ApiError
from tgq.api.ids import new_job_id, request_id_of
from tgq.api.openai_validation import chat_params, completion_params
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest
from tgq.api.submit import job_params
from tgq.api.tools import prompt_tools
from tgq.api.validated import ValidatedRequest
from tgq.api.validation import validate_tokens
from tgq.batcher.request import Priority
from tgq.bulk.batches.context import BatchContext, get_batch
from tgq.bulk.batches.lease import BatchLease


async def validate_lines(
    ctx: BatchContext, batch: db_batches.BatchRecord, lease: BatchLease
) -> db_batches.BatchRecord:
    """Validates the lines after those already committed, `chunk_lines` per transaction, then
    moves the batch to `in_progress` (or stops, when it is being cancelled)."""
    job_id = batch.job_id or await _create_job(ctx, batch)
    async with ctx.db.connect() as conn:
        num_lines, num_items = await db_batches.count_lines(conn, batch_id=batch.id)
        record = None
        if batch.api_key_id is not None:
            record = await api_keys.get_api_key(conn, key_id=batch.api_key_id)
    key = None if record is None else record.access()
    lines: list[db_batches.LineRecord] = []
    items: list[tuple[str, list[int]]] = []
    params: list[dict[str, Any]] = []

    async def commit() -> bool:
        """Writes the chunk; False when the batch is no longer validating (cancelled)."""
        nonlocal num_items
        await lease.renew()
        async with ctx.db.begin() as conn:
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
                if key is not None:  # a key restricted to some models: the line's must be one
                    key.check_model(validated.params.adapter or ctx.settings.model_id)
            except ApiError as error:
                lines.append(
                    _invalid(batch, line_index, custom_id, error.openai_prefix + error.message)
                )
            except ValueError as error:
                lines.append(_invalid(batch, line_index, custom_id, str(error)))
            else:
                item_index = num_items + len(items)
                items.append((request_id_of(job_id, item_index), validated.prompt_token_ids))
                params.append(job_params(validated.params))
                line = db_batches.LineRecord(batch.id, line_index, custom_id, item_index, None)
                lines.append(line)
            if len(lines) >= ctx.chunk_lines and not await commit():
                return await get_batch(ctx, batch.id)
    except (OSError, LookupError, json.JSONDecodeError) as error:
        async with ctx.db.begin() as conn:
            await db_batches.set_status(
                conn, batch_id=batch.id, status="failed", only_from=("validating",),
                error=f"the input file could not be read: {error}",
            )  # fmt: skip
        return await get_batch(ctx, batch.id)
    if not await commit():
        return await get_batch(ctx, batch.id)
    async with ctx.db.begin() as conn:
        num_lines, num_items = await db_batches.count_lines(conn, batch_id=batch.id)
        await db_batches.set_num_items(conn, job_id=job_id, num_items=num_items)
        await db_batches.set_status(
            conn, batch_id=batch.id, status="in_progress", only_from=("validating",),
            num_total=num_lines,
        )  # fmt: skip
    return await get_batch(ctx, batch.id)


def _invalid(
    batch: db_batches.BatchRecord, line_index: int, custom_id: str, message: str
) -> db_batches.LineRecord:
    """An invalid line: no item, its error message (as the interactive route words it)."""
    return db_batches.LineRecord(batch.id, line_index, custom_id, None, message)


async def _create_job(ctx: BatchContext, batch: db_batches.BatchRecord) -> str:
    """The batch's job, without items yet (they come with their lines)."""
    job_id = new_job_id()
    job = store.NewJob(
        job_id=job_id, kind="batch", route=batch.endpoint, priority=int(Priority.BULK),
        model=ctx.settings.model_id, params={}, items=[], api_key_id=batch.api_key_id,
        deadline=batch.expires_at, metadata={"batch_id": batch.id},
    )  # fmt: skip
    async with ctx.db.begin() as conn:
        await store.create_jobs(conn, jobs=[job])
        await db_batches.set_job(conn, batch_id=batch.id, job_id=job_id)
    return job_id


async def _read_lines(
    ctx: BatchContext, file_id: str, *, skip: int
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The file's non-blank lines after the first `skip`, parsed, streamed from the storage."""
    async with ctx.db.connect() as conn:
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
        params = chat_params(chat, settings, tokenizer.chat_template)
        prompt = await render_chat(
            tokenizer, chat.messages, tools=prompt_tools(chat), tool_prompt=chat.tool_prompt
        )
    else:
        completion = CompletionRequest.model_validate(body)
        params = completion_params(completion, settings)
        if not isinstance(completion.prompt, str):
            raise ValueError("a batch line takes one prompt (a string)")
        prompt = completion.prompt
    # A line is one item, one sequence: its output line has one choice.
    if params.num_choices > 1:
        raise ValueError("`n` > 1 is not supported in batches")
    if params.best_of > 1:
        raise ValueError("`best_of` > 1 is not supported in batches")
    token_ids = await tokenizer.encode(prompt, add_special_tokens=params.add_special_tokens)
    return validate_tokens(
        prompt=prompt, token_ids=token_ids, params=params, settings=settings,
        priority=Priority.BULK, eos_token_ids=tokenizer.eos_token_ids,
    )  # fmt: skip
